"""Tensor and expert parallelism: which layout a model runs in, and the collectives one rank's shard calls.

SPMD: every rank holds its own shard of the model and its own caches and runs the same step; the collectives
happen inside the model's forward. At world size 1 every collective returns its input unchanged and moves no
bytes, so the single-rank model runs exactly the ops it ran before parallelism existed.

Collectives take and return tensors of shapes fixed by their inputs and never read a value back to the host,
so a decode step that calls them can be captured in a CUDA graph (NCCL collectives are capturable).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ds4.config import ModelConfig

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor_parallel_size ranks, the routed experts split inside each expert (TP) or
    placed whole on ranks (enable_expert_parallel; EP reuses the same ranks)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def validate(self, cfg: ModelConfig, num_devices: int | None = None, weight_format: str = "auto") -> None:
        """Refuse a layout this model cannot be split into (ValueError naming every reason), before any weight
        is read. num_devices: the GPUs available (None: CPU processes, no limit). weight_format as the model's:
        "checkpoint" keeps FP8 / MXFP4 weights quantised, so a rank's part must be whole scale blocks; "auto" is
        "checkpoint" on GPUs (num_devices given) and "dequantized" on CPU."""
        if weight_format == "auto":
            weight_format = "checkpoint" if num_devices is not None else "dequantized"
        reasons = layout_errors(cfg, self, weight_format == "checkpoint")
        n = self.tensor_parallel_size
        if num_devices is not None and n > num_devices:
            reasons.append(f"{n} ranks need {n} GPUs, {num_devices} available")
        if reasons:
            kind = "expert parallel" if self.enable_expert_parallel else "tensor parallel"
            raise ValueError(f"cannot split {_describe(cfg)} over {n} ranks ({kind}): " + "; ".join(reasons))


def _describe(cfg: ModelConfig) -> str:
    return f"the model ({cfg.num_attention_heads} heads, {cfg.o_groups} o_groups, {cfg.n_routed_experts} experts)"


def layout_errors(cfg: ModelConfig, pc: ParallelConfig, quantised: bool) -> list[str]:
    """Every reason the model cannot be split this way (empty: it can). quantised: weights stay in checkpoint
    precision, so a rank holds whole FP8 blocks (128 x 128) and whole MXFP4 groups, and each rank's inputs to
    act_quant'ed GEMMs are whole 128-wide quantisation groups (so the split computes what one rank would)."""
    n = pc.tensor_parallel_size
    if n < 1:
        return [f"tensor_parallel_size must be at least 1, got {n}"]
    if n == 1:
        return []
    reasons = []

    def split(what: str, total: int, unit: int = 1, why: str = "") -> None:
        if total % (n * unit):
            reasons.append(f"{what} ({total}) does not split {n} ways" + (f" into {why} of {unit}" if unit > 1 else ""))

    split("num_attention_heads", cfg.num_attention_heads)
    split("vocab_size", cfg.vocab_size)
    groups = cfg.o_groups
    if groups % n and (quantised or n % groups):
        more = "" if quantised else f" (nor do {n} ranks split each of its groups evenly)"
        reasons.append(f"o_groups ({groups}) does not split {n} ways{more}")
    if pc.enable_expert_parallel:
        split("n_routed_experts", cfg.n_routed_experts)
    else:
        split("moe_intermediate_size", cfg.moe_intermediate_size)
    if not quantised or cfg.fp8_block is None:
        return reasons
    block = max(cfg.fp8_block)
    whole = "whole FP8 blocks"
    split("attention rows (num_attention_heads x head_dim)", cfg.num_attention_heads * cfg.head_dim, block, whole)
    split("o_groups x o_lora_rank", groups * cfg.o_lora_rank, block, whole)
    if cfg.n_shared_experts:
        split("shared expert moe_intermediate_size", cfg.moe_intermediate_size, block, whole)
    if not pc.enable_expert_parallel and cfg.expert_dtype == "fp4":
        split("routed expert moe_intermediate_size", cfg.moe_intermediate_size, 128, "whole act_quant groups")
    return reasons


@dataclass
class Parallel:
    """One rank's view of the process group: its rank, the world, the layout, and the collectives (no-ops at
    world size 1). bytes_moved counts, per collective kind, the bytes of the tensors each rank passes in."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    group: dist.ProcessGroup | None = None
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))

    @staticmethod
    def single() -> Parallel:
        return Parallel()

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def reset_counters(self) -> None:
        for kind in COLLECTIVES:
            self.bytes_moved[kind] = 0
            self.calls[kind] = 0

    def _count(self, kind: str, x: torch.Tensor) -> None:
        self.bytes_moved[kind] += x.numel() * x.element_size()
        self.calls[kind] += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (in place on x, which is returned)."""
        if self.world_size == 1:
            return x
        self._count(ALL_REDUCE, x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        if self.world_size == 1:
            return x
        self._count(ALL_GATHER, x)
        x = x.contiguous()
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=self.group)
        if dim in (0, -x.dim()):
            return out
        return torch.cat(out.chunk(self.world_size, dim=0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's 1/world_size slice (along dim) of the sum of x over the ranks."""
        if self.world_size == 1:
            return x
        self._count(REDUCE_SCATTER, x)
        if dim not in (0, -x.dim()):
            x = torch.cat(x.chunk(self.world_size, dim=dim), dim=0)
        x = x.contiguous()
        out = torch.empty((x.shape[0] // self.world_size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=self.group)
        return out

    def shard(self, total: int) -> slice:
        """This rank's contiguous 1/world_size of range(total) (validated divisible beforehand)."""
        per = total // self.world_size
        return slice(self.rank * per, (self.rank + 1) * per)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = 300.0,
    *,
    expert_parallel: bool = False,
    local_rank: int | None = None,
) -> Parallel:
    """Join the process group (gloo on CPU, nccl when CUDA is available, unless backend says) and return this
    rank's Parallel; with nccl, first select the CUDA device of the local rank (default: rank)."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    return Parallel(rank=rank, world_size=world_size, expert_parallel=expert_parallel, group=dist.group.WORLD)


def destroy() -> None:
    """Leave the process group (a no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()
