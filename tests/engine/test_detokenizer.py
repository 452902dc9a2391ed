"""Incremental detokenizing against the tokenizers library's own whole-sequence decode."""

import random

import pytest
from tokenizers import Tokenizer, models

from ds4.engine.detokenizer import IncrementalDetokenizer, TokenBytes
from ds4.tokenizer import default_tokenizer_path

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(default_tokenizer_path()))


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return TokenBytes(tokenizer)


def deltas(token_bytes, ids, skip_special_tokens=True):
    detokenizer = IncrementalDetokenizer(token_bytes, skip_special_tokens)
    return [detokenizer.add_token(token_id) for token_id in ids], detokenizer.flush()


def test_every_token_decodes_like_the_tokenizer(tokenizer, token_bytes):
    ids = range(tokenizer.get_vocab_size(with_added_tokens=True))
    expected = tokenizer.decode_batch([[token_id] for token_id in ids], skip_special_tokens=False)
    wrong = [i for i in ids if token_bytes.bytes_of[i].decode("utf-8", errors="replace") != expected[i]]
    assert wrong == []


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox.",
        "你好，世界。深度求索的模型很好用。",
        "emoji 😀👍🏽🇫🇷 and family 👨‍👩‍👧‍👦 done",
        "mixed: naïve café — Ωμέγα, русский, العربية, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢\n\ttabs",
    ],
)
def test_deltas_of_real_text_are_whole_characters_and_add_up(tokenizer, token_bytes, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces, tail = deltas(token_bytes, ids)
    assert all(REPLACEMENT not in piece for piece in pieces)
    assert "".join(pieces) + tail == tokenizer.decode(ids) == text
    assert tail == ""


def test_a_character_split_across_tokens_is_held_until_complete(tokenizer, token_bytes):
    ids = tokenizer.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1, "the test needs an emoji the tokenizer splits"
    pieces, _ = deltas(token_bytes, ids)
    assert pieces == [""] * (len(ids) - 1) + ["😀"]
    assert all(REPLACEMENT in tokenizer.decode([token_id]) for token_id in ids)


def test_random_ids_including_broken_bytes_add_up_to_the_full_decode(tokenizer, token_bytes):
    rng = random.Random(0)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    # Single-byte tokens make split and invalid UTF-8 likely; rare ids bring special tokens in.
    byte_tokens = [i for i in range(vocab) if len(token_bytes.bytes_of[i]) == 1 and token_bytes.bytes_of[i][0] >= 0x80]
    for trial in range(30):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(200)]
        ids += [0, 1, 128803][: trial % 4]
        for skip in (True, False):
            pieces, tail = deltas(token_bytes, ids, skip)
            assert "".join(pieces) + tail == tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_skipped_only_when_asked(tokenizer, token_bytes):
    bos_text, eos_text = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    bos, eos, user = (tokenizer.token_to_id(t) for t in (bos_text, eos_text, "<｜User｜>"))
    ids = [bos, user] + tokenizer.encode("hi there", add_special_tokens=False).ids + [eos]
    assert "".join(deltas(token_bytes, ids, True)[0]) == "<｜User｜>hi there"
    assert "".join(deltas(token_bytes, ids, False)[0]) == f"{bos_text}<｜User｜>hi there{eos_text}"


def test_flush_turns_an_unfinished_character_into_a_replacement(tokenizer, token_bytes):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False).ids[:-1]
    pieces, tail = deltas(token_bytes, ids)
    assert "".join(pieces) == "ok "
    assert "".join(pieces) + tail == tokenizer.decode(ids) and tail.endswith(REPLACEMENT)


def test_rejects_unknown_ids_and_non_byte_level_tokenizers(token_bytes):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        IncrementalDetokenizer(token_bytes).add_token(len(token_bytes.bytes_of))
    with pytest.raises(ValueError, match="byte-level"):
        TokenBytes(Tokenizer(models.BPE()))
