"""How one request wants its tokens chosen and when it stops: vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Temperatures below this are greedy: dividing logits by a near-zero value only amplifies noise.
GREEDY_TEMPERATURE = 1e-5
_MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request (OpenAI / vLLM semantics).

    temperature: 0 (below 1e-5) means greedy. top_k: 0 or -1 means off. max_tokens: None means
    "until the context is full" (the engine decides). stop / stop_token_ids / logit_bias are
    normalised to a list / list / dict[int, float]. logprobs / prompt_logprobs: how many most likely
    tokens to return per position, besides the chosen token's own log-probability.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # A per-request grammar state (ds4.engine.structured_output.StructuredOutput) the sampler masks logits
    # with; it belongs to one request, so params carrying one must not be shared between requests.
    structured_output: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        # JSON object keys arrive as strings: {"50256": -100}.
        self.logit_bias = (
            {}
            if self.logit_bias is None
            else {_as_int("logit_bias key", k): float(v) for k, v in self.logit_bias.items()}
        )
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first out-of-range field; with `vocab_size`, check token ids too."""
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, f"top_k must be -1 or 0 (off) or a positive count, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        _check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty, got {self.stop!r}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        )
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= 0, f"{name} must be >= 0, got {value}")
        for token_id, bias in self.logit_bias.items():
            _check(
                -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS,
                f"logit_bias for token {token_id} must be in [-100, 100], got {bias}",
            )
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            for token_id in ids:
                _check(isinstance(token_id, int) and token_id >= 0, f"{name}: token id {token_id!r} must be >= 0")
                _check(
                    vocab_size is None or token_id < vocab_size,
                    f"{name}: token id {token_id} is outside the vocabulary (size {vocab_size})",
                )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _as_int(what: str, value: object) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a token id, got {value!r}") from None
