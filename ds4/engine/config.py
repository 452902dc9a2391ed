"""The engine's flags: defaults, meaning and validation (the CLI and `LLM(...)` keyword arguments map onto these)."""

from __future__ import annotations

from dataclasses import dataclass, fields

GiB = 1 << 30


class EngineConfigError(ValueError):
    """An engine flag with a value the engine cannot run with."""


@dataclass
class EngineConfig:
    # Tokens run through the model in one step (decodes plus prefill chunks).
    max_num_batched_tokens: int = 8192
    # Requests holding a cache slot at once (decoding or prefilling).
    max_num_seqs: int = 256
    # Longest prompt + output; None: the model's limit, lowered to what the cache can hold.
    max_model_len: int | None = None
    # A prompt with more tokens than this left to prefill is "long" and prefills in chunks of at most this
    # many tokens; 0 picks max_num_batched_tokens // 2.
    long_prefill_token_threshold: int = 0
    # Prompts that get prefill tokens in one step, and how many of those may be long; short prompts go first,
    # so a short request never waits for a long prompt to finish prefilling.
    max_num_partial_prefills: int = 4
    max_long_partial_prefills: int = 1
    # CUDA: fraction of the device's memory ds4 may use in all (weights, activations, caches).
    gpu_memory_utilization: float = 0.9
    # Bytes for the caches (any device); overrides gpu_memory_utilization. CPU default: 1 GiB.
    kv_cache_memory: int | None = None
    # Tokens per cache page; a multiple of every compression ratio of the model.
    page_size: int = 256
    # CUDA: run decode steps eagerly instead of replaying CUDA graphs.
    enforce_eager: bool = False
    # CUDA: the largest decode batch captured as a graph (larger decode batches run eagerly).
    max_cuda_graph_batch_size: int = 256

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        positive = ("max_num_batched_tokens", "max_num_seqs", "max_num_partial_prefills", "max_long_partial_prefills",
                    "page_size", "max_cuda_graph_batch_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that every running request can decode in each step")
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise EngineConfigError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise EngineConfigError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise EngineConfigError(f"max_model_len must be an integer >= 2 (a prompt token and an output), got {self.max_model_len!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise EngineConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")

    @property
    def prefill_chunk_limit(self) -> int:
        """The resolved long_prefill_token_threshold."""
        return self.long_prefill_token_threshold or max(1, self.max_num_batched_tokens // 2)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, naming any that is not an engine flag."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise EngineConfigError(f"unknown engine flag(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def add_engine_args(parser) -> None:
    """Add every engine flag to an argparse parser as --kebab-case options (defaults from EngineConfig)."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            group.add_argument(flag, action="store_true", help=f"(default: {f.default})")
        else:
            kind = float if f.name == "gpu_memory_utilization" else int
            group.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default})")


def engine_flags_from_args(args) -> dict:
    """The EngineConfig keyword arguments from parsed arguments (see add_engine_args)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
