"""The engine's flags: defaults, meaning and validation (the CLI and `LLM(...)` keyword arguments map onto these)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields

GiB = 1 << 30
DEFAULT_MASTER_PORT = 29500
SPECULATIVE_METHODS = ("mtp",)


class EngineConfigError(ValueError):
    """An engine flag with a value the engine cannot run with."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's shape): `{"method": "mtp", "num_speculative_tokens": k}`.

    The model's MTP layer drafts k tokens per step (itself again for k > 1); the main model verifies them."""

    method: str = "mtp"
    num_speculative_tokens: int = 1

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict or its JSON text; None (or an empty dict) turns speculation off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise EngineConfigError(f"speculative_config: not JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise EngineConfigError(f"speculative_config must be a JSON object, got {value!r}")
        if not value:
            return None
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise EngineConfigError(
                f"speculative_config: unknown field(s) {unknown}; known: method, num_speculative_tokens"
            )
        spec = cls(value.get("method", "mtp"), value.get("num_speculative_tokens", 1))
        if spec.method not in SPECULATIVE_METHODS:
            raise EngineConfigError(f"speculative_config: method {spec.method!r} is not one of {SPECULATIVE_METHODS}")
        k = spec.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            raise EngineConfigError(f"speculative_config: num_speculative_tokens must be an integer in 1..8, got {k!r}")
        return spec


def _flag(default, help: str):
    """A field whose help text is also the CLI flag's help."""
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    max_num_batched_tokens: int = _flag(8192, "tokens run through the model in one step (decodes plus prefill chunks)")
    max_num_seqs: int = _flag(256, "requests holding a cache slot at once (decoding or prefilling)")
    max_model_len: int | None = _flag(
        None, "longest prompt + output (default: the model's limit, lowered to what the cache holds)"
    )
    long_prefill_token_threshold: int = _flag(
        0,
        "prompts with more tokens than this left to prefill are long and prefill in chunks of at most this "
        "many (0: half of max_num_batched_tokens)",
    )
    max_num_partial_prefills: int = _flag(
        4, "prompts that get prefill tokens in one step; short ones go first, so they never wait for a long one"
    )
    max_long_partial_prefills: int = _flag(1, "how many of those prompts may be long")
    gpu_memory_utilization: float = _flag(
        0.9, "CUDA: fraction of the device's memory ds4 may use in all (weights, activations, caches)"
    )
    kv_cache_memory: int | None = _flag(
        None, "bytes for the caches on any device; overrides gpu_memory_utilization (CPU default: 1 GiB)"
    )
    page_size: int = _flag(256, "tokens per cache page; a multiple of every compression ratio of the model")
    enforce_eager: bool = _flag(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    async_decode: bool = _flag(
        True,
        "CUDA graphs: launch a plain decode step before the previous one's tokens reach the host, so the engine's "
        "host work per step overlaps the GPU's (--no-async-decode: each step waits for its tokens first)",
    )
    enable_prefix_caching: bool = _flag(
        True, "keep full pages of prompts and outputs under a hash of their tokens; requests reuse cached prefixes"
    )
    prefix_cache_snapshots: int | None = _flag(
        None,
        "prefix caching: page-end states kept (sliding window + CSA overlap rows; a cached prefix resumes only "
        "where one is kept; default: a tenth of the cache memory)",
    )
    max_cuda_graph_batch_size: int = _flag(
        256, "CUDA: the largest decode batch captured as a graph (larger decode batches run eagerly)"
    )
    speculative_config: SpeculativeConfig | None = _flag(
        None, 'speculative decoding, JSON: {"method": "mtp", "num_speculative_tokens": k} (default: off)'
    )
    tensor_parallel_size: int = _flag(
        1, "ranks the model is split across, one per GPU (on CPU: processes over gloo); rank 0 runs the engine"
    )
    enable_expert_parallel: bool = _flag(
        False, "with tensor_parallel_size > 1: whole routed experts per rank instead of every expert split"
    )
    distributed_timeout_s: float = _flag(
        300.0, "with tensor_parallel_size > 1: seconds a collective may wait for a rank before the engine fails"
    )

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.validate()

    @property
    def num_speculative_tokens(self) -> int:
        """Draft tokens per step (0 without speculative decoding)."""
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def validate(self) -> None:
        positive = (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_num_partial_prefills",
            "max_long_partial_prefills",
            "page_size",
            "max_cuda_graph_batch_size",
            "tensor_parallel_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so that every running request can decode in each step"
            )
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise EngineConfigError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise EngineConfigError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold!r}"
            )
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise EngineConfigError(
                f"max_model_len must be an integer >= 2 (a prompt token and an output), got {self.max_model_len!r}"
            )
        if self.prefix_cache_snapshots is not None and (
            not isinstance(self.prefix_cache_snapshots, int) or self.prefix_cache_snapshots < 1
        ):
            raise EngineConfigError(f"prefix_cache_snapshots must be >= 1, got {self.prefix_cache_snapshots!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise EngineConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not self.distributed_timeout_s > 0:
            raise EngineConfigError(f"distributed_timeout_s must be > 0 seconds, got {self.distributed_timeout_s!r}")

    @property
    def prefill_chunk_limit(self) -> int:
        """The resolved long_prefill_token_threshold."""
        return self.long_prefill_token_threshold or max(1, self.max_num_batched_tokens // 2)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keyword arguments, naming any that is not an engine flag."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise EngineConfigError(f"unknown engine flag(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


@dataclass(frozen=True)
class Launch:
    """Where the ranks of a tensor-parallel engine run (torchrun's flags): nnodes hosts, this one's node_rank, and
    the address and port of node 0 where the ranks meet (default: a free port on one host, 29500 across hosts)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.master_port is None and self.nnodes > 1:
            object.__setattr__(self, "master_port", DEFAULT_MASTER_PORT)


def add_launch_args(parser) -> None:
    """torchrun's flags, for a tensor-parallel engine over several hosts (ds4.engine.workers)."""
    group = parser.add_argument_group("hosts (with --tensor-parallel-size; torchrun's names)")
    group.add_argument("--nnodes", type=int, default=1, help="hosts the ranks run on, N / nnodes each")
    group.add_argument("--node-rank", type=int, default=0, help="this host's index; host 0 runs the engine and the API")
    group.add_argument("--master-addr", default="127.0.0.1", help="address of host 0, where the ranks meet")
    group.add_argument(
        "--master-port", type=int, default=None, help=f"port on host 0 (default: {DEFAULT_MASTER_PORT} across hosts)"
    )


def launch_from_args(args) -> Launch:
    return Launch(args.nnodes, args.node_rank, args.master_addr, args.master_port)


def add_model_args(parser) -> None:
    """The flags that choose and place the model, shared by every command that loads one."""
    parser.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16 or float32"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "bf16", "fp8"),
        help="fp8: the reference's FP8 KV cache, stored as such (584 bytes an attention entry); bf16: entries "
        "unquantised in the compute dtype; auto: fp8 on CUDA (where the model's dims allow it), else bf16",
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="auto: read the checkpoint; dummy: random weights of the checkpoint's shapes made on the device, "
        "from --config or --model's config.json alone",
    )
    parser.add_argument(
        "--config", default=None, help="with --load-format dummy: flash, pro (the shipped configs) or a directory"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="with --load-format dummy: keep the first L layers (num_hidden_layers)"
    )


def add_engine_args(parser) -> None:
    """Add every engine flag to an argparse parser as --kebab-case options (defaults from EngineConfig)."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        help = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if f.type in (bool, "bool"):
            # Flags on by default get their --no- form too (--enable-prefix-caching / --no-enable-prefix-caching).
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            group.add_argument(flag, action=action, default=f.default, help=help)
        else:
            kinds = {"gpu_memory_utilization": float, "speculative_config": str, "distributed_timeout_s": float}
            group.add_argument(flag, type=kinds.get(f.name, int), default=f.default, help=help)


def model_flags_from_args(args) -> dict:
    """LLM / LLMEngine.from_pretrained keyword arguments from the flags of add_model_args."""
    return dict(
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        load_format=args.load_format,
        config=args.config,
        num_layers=args.layers,
    )


def engine_flags_from_args(args) -> dict:
    """The EngineConfig keyword arguments from parsed arguments (see add_engine_args)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
