"""KV cache storage for DeepSeek-V4: per-slot sliding windows and compressor states, paged compressed pools.

Storage only; the engine hands out slots and pages. Per layer:
  - window: the last `sliding_window` raw KV entries of each slot, a ring indexed by position % window;
  - compressed (CSA/HCA): one entry per `ratio` tokens, page p holding entries of tokens p*P .. p*P + P - 1;
  - index_keys (CSA): the lightning indexer's compressed keys, paged the same way (with kv_cache_dtype
    "fp8" and 128-dim keys: the packed e4m3 indexer cache of ds4.kernels.indexer, read by its kernels);
  - compressor / indexer state (fp32, per slot): the unfinished window's projected kv and gate scores and,
    for overlapping (CSA) compression, the previous full window.
With kv_cache_dtype "fp8" the stores hold fp8-rounded values (kept dequantised in the compute dtype for now,
except the indexer keys, whose MXFP4-rounded values the packed e4m3 cache holds exactly).

Every paged pool has one page more than num_pages: the last page (index num_pages) is a scratch page
that no block table names. The decode path writes there what must go nowhere (entries of windows that
did not complete, padding rows of a CUDA-graph batch), so its writes need no data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4.config import CSA, WINDOW, ModelConfig
from ds4.kernels.fp8_kv import KV_QUANT_BLOCK
from ds4.kernels.indexer import ENTRY_BYTES, HEAD_DIM, new_indexer_cache, page_entries, write_indexer_keys

KV_CACHE_DTYPES = ("auto", "fp8")
SCRATCH_PAGES = 1


@dataclass
class CompressorState:
    """Rows [0, ratio) hold the previous window (overlap only), the next `ratio` rows the current one."""

    kv: torch.Tensor  # [slots, coff * ratio, coff * head_dim] fp32
    score: torch.Tensor  # same shape, gate logits with the position bias already added


@dataclass
class LayerCache:
    kind: str
    ratio: int
    window: torch.Tensor  # [slots, sliding_window, head_dim]
    compressed: torch.Tensor | None = None  # [pages + 1, page_size // ratio, head_dim], the last page scratch
    # [pages + 1, page_size // ratio, index_head_dim] or packed (see packed_index_keys); the last page scratch
    index_keys: torch.Tensor | None = None
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


def check_kv_cache_dtype(cfg: ModelConfig, kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype == "fp8" and cfg.nope_head_dim % KV_QUANT_BLOCK:
        raise ValueError(
            f"kv_cache_dtype 'fp8': the non-RoPE head dims ({cfg.head_dim} - {cfg.qk_rope_head_dim} = "
            f"{cfg.nope_head_dim}) must be a multiple of the fp8 block {KV_QUANT_BLOCK}"
        )


def cache_layers(cfg: ModelConfig, with_mtp: bool) -> range:
    """Layer indices that own a cache: the main layers, then the MTP layer when present."""
    return range(cfg.num_hidden_layers + (1 if with_mtp else 0))


def check_page_size(cfg: ModelConfig, page_size: int, with_mtp: bool) -> None:
    ratios = {cfg.compress_ratios[i] for i in cache_layers(cfg, with_mtp) if cfg.layer_kinds[i] != WINDOW}
    bad = sorted(r for r in ratios if page_size % r)
    if page_size < 1 or bad:
        raise ValueError(f"page_size {page_size} must be a positive multiple of every compression ratio; not of {bad}")


def _compressor_shape(kind: str, ratio: int, head_dim: int) -> tuple[int, int]:
    coff = 2 if kind == CSA else 1
    return coff * ratio, coff * head_dim


def packed_index_keys(cfg: ModelConfig, kv_cache_dtype: str) -> bool:
    """Whether the indexer keys live in the packed e4m3 cache (fp8 mode, keys of the kernels' 128 dims)."""
    return kv_cache_dtype == "fp8" and cfg.index_head_dim == HEAD_DIM


def bytes_per_page(
    cfg: ModelConfig, page_size: int, dtype: torch.dtype, with_mtp: bool = False, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one page of page_size tokens takes across every paged pool."""
    check_page_size(cfg, page_size, with_mtp)
    item = torch.empty((), dtype=dtype).element_size()
    index_entry = ENTRY_BYTES if packed_index_keys(cfg, kv_cache_dtype) else cfg.index_head_dim * item
    total = 0
    for i in cache_layers(cfg, with_mtp):
        kind, ratio = cfg.layer_kinds[i], cfg.compress_ratios[i]
        if kind != WINDOW:
            total += page_size // ratio * cfg.head_dim * item
        if kind == CSA:
            total += page_size // ratio * index_entry
    return total


def entries_per_page(pool: torch.Tensor) -> int:
    """Entries one page of a compressed pool holds (dense [pages, entries, dim] or packed indexer keys)."""
    return page_entries(pool) if pool.dtype == torch.uint8 else pool.shape[1]


def store_entries(pool: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor) -> None:
    """Writes entries [N, dim] to flat rows [N] (row = page * entries_per_page + offset) of a pool."""
    if pool.dtype == torch.uint8:
        write_indexer_keys(pool, rows, entries)
    else:
        pool.view(-1, pool.shape[-1])[rows] = entries.to(pool.dtype)


def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, with_mtp: bool = False) -> int:
    """Bytes one request slot takes: sliding windows plus fp32 compressor states."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for i in cache_layers(cfg, with_mtp):
        kind, ratio = cfg.layer_kinds[i], cfg.compress_ratios[i]
        total += cfg.sliding_window * cfg.head_dim * item
        if kind != WINDOW:
            rows, width = _compressor_shape(kind, ratio, cfg.head_dim)
            total += 2 * rows * width * 4
        if kind == CSA:
            rows, width = _compressor_shape(kind, ratio, cfg.index_head_dim)
            total += 2 * rows * width * 4
    return total


class ModelCache:
    """Every layer's cache storage, allocated up front."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        with_mtp: bool = False,
    ):
        check_kv_cache_dtype(cfg, kv_cache_dtype)
        check_page_size(cfg, page_size, with_mtp)
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"ModelCache: need at least one slot and one page (got {num_slots}, {num_pages})")
        self.num_slots, self.num_pages, self.page_size = num_slots, num_pages, page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.layers = [self._layer(cfg, i, dtype, torch.device(device)) for i in cache_layers(cfg, with_mtp)]

    def _layer(self, cfg: ModelConfig, i: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        kind, ratio = cfg.layer_kinds[i], cfg.compress_ratios[i]
        layer = LayerCache(
            kind, ratio, torch.zeros(self.num_slots, cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device)
        )
        if kind == WINDOW:
            return layer
        entries, pages = self.page_size // ratio, self.num_pages + SCRATCH_PAGES
        layer.compressed = torch.zeros(pages, entries, cfg.head_dim, dtype=dtype, device=device)
        layer.compressor = self._state(kind, ratio, cfg.head_dim, device)
        if kind == CSA:
            if packed_index_keys(cfg, self.kv_cache_dtype):
                layer.index_keys = new_indexer_cache(pages, device, entries_per_page=entries)
            else:
                layer.index_keys = torch.zeros(pages, entries, cfg.index_head_dim, dtype=dtype, device=device)
            layer.indexer = self._state(kind, ratio, cfg.index_head_dim, device)
        return layer

    def _state(self, kind: str, ratio: int, head_dim: int, device: torch.device) -> CompressorState:
        shape = (self.num_slots, *_compressor_shape(kind, ratio, head_dim))
        return CompressorState(
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
        )
