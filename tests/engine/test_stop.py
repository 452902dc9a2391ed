"""Stop strings over streamed text, against a whole-text reference, for every way the text can be split."""

import itertools
import random

import pytest

from ds4.engine.sampling_params import SamplingParams
from ds4.engine.stop import LENGTH, STOP, StopChecker, token_finish_reason


def reference(text, stops, include):
    """Scan the whole text end by end; the first end at which a stop string is complete wins."""
    for end in range(1, len(text) + 1):
        matches = [s for s in stops if text[:end].endswith(s)]
        if matches:
            found = max(matches, key=len)
            return (text[:end] if include else text[: end - len(found)]), found
    return text, None


def stream(pieces, stops, include):
    checker = StopChecker(stops, include)
    emitted = ""
    prefixes = []
    for piece in pieces:
        emitted += checker.feed(piece)
        prefixes.append(emitted)
        if checker.stopped_by is not None:
            return emitted, checker.stopped_by, prefixes
    return emitted + checker.flush(), None, prefixes


def splits(text, cuts):
    for points in itertools.combinations(range(1, len(text)), cuts):
        bounds = (0, *points, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


CASES = [
    ("The answer is 42.\n\nUser: hi", ["\n\nUser:", "42", "answer is 4"]),
    ("xabcdx", ["abc", "bcd", "c"]),
    ("aaab", ["aab", "ab"]),
    ("你好世界！再见", ["世界", "再"]),
    ("no stop in here", ["STOP", "here!"]),
    ("ends with a partial ST", ["STOP"]),
    ("</think>then text", ["</think>"]),
]


@pytest.mark.parametrize("text, stops", CASES)
@pytest.mark.parametrize("include", [False, True])
def test_every_split_gives_the_whole_text_answer_and_never_retracts(text, stops, include):
    expected_text, expected_stop = reference(text, stops, include)
    for cuts in (1, 2):
        for pieces in splits(text, cuts):
            emitted, stopped_by, prefixes = stream(pieces, stops, include)
            assert (emitted, stopped_by) == (expected_text, expected_stop), pieces
            assert all(expected_text.startswith(prefix) for prefix in prefixes), pieces
    assert stream(list(text), stops, include)[:2] == (expected_text, expected_stop)


def test_random_texts_and_stops_match_the_reference():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("ab ") for _ in range(rng.randrange(1, 25)))
        stops = ["".join(rng.choice("ab ") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        include = rng.random() < 0.5
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8))))
        bounds = (0, *cuts, len(text))
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        emitted, stopped_by, prefixes = stream(pieces, stops, include)
        expected_text, expected_stop = reference(text, stops, include)
        assert (emitted, stopped_by) == (expected_text, expected_stop), (text, stops, pieces)
        assert all(expected_text.startswith(prefix) for prefix in prefixes)


def test_only_a_possible_stop_prefix_is_held_back():
    checker = StopChecker(["STOP", "END"])
    assert checker.feed("hello") == "hello"
    assert checker.feed(" wor ST") == " wor "
    assert checker.feed("ILL E") == "STILL "
    assert checker.flush() == "E"
    assert StopChecker([]).feed("anything STOP") == "anything STOP"


def test_matches_before_min_tokens_are_passed_over():
    checker = StopChecker(["STOP"])
    assert checker.feed("a STOP b STO", can_stop=False) == "a STOP b "
    assert checker.feed("P c") == ""
    assert checker.stopped_by == "STOP"
    with pytest.raises(RuntimeError):
        checker.feed("more")
    # A passed-over match held back as the start of a longer stop string stays passed over.
    checker = StopChecker(["STOP", "STOPX"])
    assert checker.feed("a STOP", can_stop=False) == "a "
    assert checker.feed("Y") == "STOPY"


def test_token_finish_reasons():
    eos = {1}
    params = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[7])
    assert token_finish_reason(1, 1, params, eos) is None  # before min_tokens
    assert token_finish_reason(1, 2, params, eos) == STOP
    assert token_finish_reason(7, 3, params, eos) == STOP
    assert token_finish_reason(9, 4, params, eos) is None
    assert token_finish_reason(9, 5, params, eos) == LENGTH
    assert token_finish_reason(7, 5, params, eos) == STOP
    ignoring = SamplingParams(max_tokens=None, ignore_eos=True)
    assert token_finish_reason(1, 10_000, ignoring, eos) is None
