"""Token ids -> text deltas, one token at a time, never emitting half of a UTF-8 character.

DeepSeek-V4's tokenizer is byte-level BPE: every token stands for a fixed byte string, and the text
of a sequence is the UTF-8 decoding (invalid bytes -> U+FFFD) of the concatenated bytes. So
detokenising incrementally is exact and O(1) per token: look the token's bytes up, feed them to an
incremental UTF-8 decoder, which holds back a character whose bytes have not all arrived yet.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders


def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes for each byte: printable Latin-1 bytes stand for
    themselves; the other bytes (controls, space, soft hyphen...) take code points 256, 257, ... in order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + n): b for n, b in enumerate(others)})
    return alphabet


class TokenBytes:
    """The bytes each token id stands for, and which ids are special. Build once per tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise ValueError(
                f"incremental detokenizing needs a byte-level BPE tokenizer, got decoder {tokenizer.decoder}"
            )
        alphabet = _byte_level_alphabet()

        def to_bytes(token: str) -> bytes:
            # Like the ByteLevel decoder: a token with a character outside the alphabet is literal text.
            if all(ch in alphabet for ch in token):
                return bytes(alphabet[ch] for ch in token)
            return token.encode("utf-8")

        size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bytes_of = [to_bytes(tokenizer.id_to_token(token_id) or "") for token_id in range(size)]
        self.special_ids = frozenset(
            token_id for token_id, added in tokenizer.get_added_tokens_decoder().items() if added.special
        )


class IncrementalDetokenizer:
    """One request's output text: `add_token` returns the new text, `flush` the held tail at the end.

    The concatenation of all deltas and the flush equals `tokenizer.decode(ids, skip_special_tokens)`.
    """

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool = True):
        self._bytes_of = token_bytes.bytes_of
        self._skipped = token_bytes.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_token(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._bytes_of):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {len(self._bytes_of)}")
        if token_id in self._skipped:
            return ""
        return self._utf8.decode(self._bytes_of[token_id])

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add_token(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """At the end of the sequence: bytes of a character that never completed become U+FFFD."""
        return self._utf8.decode(b"", final=True)
