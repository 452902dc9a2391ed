"""When a request stops: on a token (EOS, stop_token_ids), at max_tokens, or on a stop string in its text.

Where each rule lives:
- The sampler (ds4/engine/sampler.py) gives EOS and stop_token_ids -inf until min_tokens outputs exist.
- `token_finish_reason` decides, after each output token, whether the request ends on that token.
  The engine should not detokenize a token that ended the request (EOS, stop_token_ids) unless
  include_stop_str_in_output; EOS is a special token, so skip_special_tokens drops it anyway.
- `StopChecker` watches the detokenized text for stop strings.
Both report OpenAI finish reasons: "stop" or "length"; the context-window limit is the engine's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from ds4.engine.sampling_params import SamplingParams

STOP, LENGTH = "stop", "length"


def token_finish_reason(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """Whether output token number `num_output_tokens` (1-based, `token_id`) ends the request.

    Stops count once the request has min_tokens outputs; a stop token wins over max_tokens.
    """
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids or (token_id in eos_token_ids and not params.ignore_eos):
            return STOP
    if params.max_tokens is not None and num_output_tokens >= params.max_tokens:
        return LENGTH
    return None


class StopChecker:
    """Finds the first stop string in a stream of text deltas, however the deltas split it.

    `feed` returns only text that can never be retracted: it holds back the longest tail that could
    still grow into a stop string. "First" means the match that is complete earliest in the text
    (ties: the one starting earliest), i.e. the one a reader of the stream would see first. The text
    returned at the stop ends before the stop string, or after it with include_stop_str_in_output.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stopped_by: str | None = None
        self._held = ""

    def feed(self, delta: str, can_stop: bool = True) -> str:
        """Text to emit after `delta`. With can_stop False (before min_tokens), matches completed by
        this delta are passed over as ordinary text."""
        if self.stopped_by is not None:
            raise RuntimeError(f"text fed after the stop string {self.stopped_by!r} ended the request")
        if not self.stop:
            return delta
        text = self._held + delta
        match = self._first_match(text, len(self._held)) if can_stop else None
        if match is not None:
            start, stop_string = match
            self.stopped_by = stop_string
            self._held = ""
            return text[: start + len(stop_string)] if self.include_stop_str_in_output else text[:start]
        keep = self._longest_partial_tail(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """When the request ends for another reason: the held-back text, which is no stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(start, stop string) of the earliest-ending match that ends after `new_from`."""
        best: tuple[int, int, str] | None = None
        for stop_string in self.stop:
            start = text.find(stop_string, max(0, new_from - len(stop_string) + 1))
            if start >= 0:
                candidate = (start + len(stop_string), start, stop_string)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[1], best[2])

    def _longest_partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop_string in self.stop:
            for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
                if text.endswith(stop_string[:length]):
                    longest = length
                    break
        return longest
