"""How many cache pages and slots the engine allocates at start-up, from a memory budget.

The budget is --kv-cache-memory bytes when given; on CUDA otherwise --gpu-memory-utilization of the
device minus what is already in use (weights), the activation peak of one full step, measured by
running one, and the logits buffer the decode graphs share; on CPU otherwise 1 GiB. Slots (sliding
windows, compressor states) and the prefix cache's boundary snapshots (ds4.engine.prefix_cache) are
paid first, the rest becomes pages. Pages beyond max_num_seqs requests of max_model_len tokens would
never be used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ds4.engine.config import EngineConfig, GiB
from ds4.model.batch import ForwardBatch
from ds4.model.cache import SCRATCH_PAGES, bytes_per_page, bytes_per_slot, bytes_per_snapshot

logger = logging.getLogger(__name__)

CPU_DEFAULT_CACHE_BYTES = GiB
# Share of the cache budget given to boundary snapshots when --prefix-cache-snapshots is not set.
DEFAULT_SNAPSHOT_SHARE = 0.1


@dataclass(frozen=True)
class CachePlan:
    num_pages: int
    num_slots: int  # allocated in the cache; the scheduler hands out max_num_seqs of them
    page_size: int
    max_model_len: int
    page_bytes: int
    slot_bytes: int
    num_snapshots: int = 0  # prefix caching's boundary snapshots (0: prefix caching off)
    snapshot_bytes: int = 0
    kv_cache_dtype: str = "bf16"

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes + self.snapshot_bytes_total

    @property
    def snapshot_bytes_total(self) -> int:
        return self.num_snapshots * self.snapshot_bytes

    def describe(self) -> str:
        return (
            f"KV cache ({self.kv_cache_dtype}): {self.num_pages} pages x {self.page_size} tokens = "
            f"{self.capacity_tokens} tokens of context at {self.page_bytes / self.page_size:.0f} bytes a token, "
            f"{self.num_slots} request slots of {self.slot_bytes} bytes, {self.total_bytes / GiB:.3f} GiB; "
            f"max_model_len {self.max_model_len}; "
            + (
                f"prefix caching on: {self.num_snapshots} page-end snapshots "
                f"({self.snapshot_bytes_total / GiB:.3f} GiB, {self.snapshot_bytes} bytes each)"
                if self.num_snapshots
                else "prefix caching off"
            )
        )


def plan_cache(model, config: EngineConfig, device: torch.device, num_slots: int, reserved: int = 0) -> CachePlan:
    """reserved: bytes the engine holds beside the cache that the measured step does not (the decode graphs' shared
    logits), taken from a budget measured on CUDA."""
    cfg = model.cfg
    kv = model.kv_cache_dtype
    page_bytes = bytes_per_page(cfg, config.page_size, model.dtype, model.with_mtp, kv)
    slot_bytes = bytes_per_slot(cfg, model.dtype, model.with_mtp, config.num_speculative_tokens, kv)
    budget = config.kv_cache_memory
    if budget is None and device.type == "cuda":
        budget = cuda_cache_budget(model, config, device, reserved)
    elif budget is None:
        budget = CPU_DEFAULT_CACHE_BYTES
    snapshot_bytes = bytes_per_snapshot(cfg, model.dtype, model.with_mtp, kv)
    num_snapshots = 0
    if config.enable_prefix_caching:
        num_snapshots = config.prefix_cache_snapshots or max(1, int(budget * DEFAULT_SNAPSHOT_SHARE) // snapshot_bytes)
    # The cache also holds scratch pages that absorb writes going nowhere (padding rows, unfinished windows).
    # A model of sliding-window layers only has nothing paged: its pages cost nothing.
    num_pages = (budget - num_slots * slot_bytes - num_snapshots * snapshot_bytes) // max(page_bytes, 1) - SCRATCH_PAGES
    if num_pages < 1:
        raise ValueError(
            f"the cache budget of {budget} bytes does not cover {num_slots} request slots ({slot_bytes} bytes each), "
            f"{num_snapshots} prefix-cache snapshots ({snapshot_bytes} bytes each) and one page ({page_bytes} bytes): "
            "give more memory, lower max_num_seqs or prefix_cache_snapshots"
        )
    wanted_len = config.max_model_len or cfg.max_position_embeddings
    num_pages = min(num_pages, config.max_num_seqs * -(-wanted_len // config.page_size))
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, num_pages * config.page_size)
    if config.prefix_cache_snapshots is None:
        num_snapshots = min(num_snapshots, num_pages)  # no use for more than one per page
    plan = CachePlan(
        num_pages, num_slots, config.page_size, max_model_len, page_bytes, slot_bytes, num_snapshots, snapshot_bytes, kv
    )
    logger.info(plan.describe())
    return plan


def cuda_cache_budget(model, config: EngineConfig, device: torch.device, reserved: int = 0) -> int:
    """Bytes left for the cache under gpu_memory_utilization after the weights, one full step's activations and
    `reserved`."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    peak = _activation_peak(model, config, device)
    budget = int(total * config.gpu_memory_utilization) - in_use - peak - reserved
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no room for the cache: "
            f"{in_use / GiB:.1f} GiB in use, one step needs {peak / GiB:.1f} GiB of activations, "
            f"the decode graphs' logits {reserved / GiB:.1f} GiB, "
            f"device {total / GiB:.1f} GiB"
        )
    return budget


def _activation_peak(model, config: EngineConfig, device: torch.device) -> int:
    """Peak bytes of one step of max_num_batched_tokens prompt tokens plus the logits of max_num_seqs rows (each
    with its drafts' rows under speculative decoding)."""
    n = config.max_num_batched_tokens
    pages = -(-n // config.page_size)
    scratch = model.new_cache(1, pages, config.page_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long, device=device),
        positions=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        context_lens=torch.zeros(1, dtype=torch.int32, device=device),
        slots=torch.zeros(1, dtype=torch.int32, device=device),
        block_tables=torch.arange(pages, dtype=torch.int32, device=device).unsqueeze(0),
    )
    hidden = model.forward(batch, scratch)
    model.compute_logits(hidden[-min(n, config.max_num_seqs * (1 + config.num_speculative_tokens)) :])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, hidden, batch
    torch.cuda.empty_cache()
    return peak
