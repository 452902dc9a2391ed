"""KV cache storage for DeepSeek-V4: per-slot sliding windows and compressor states, paged compressed pools.

Storage only; the engine hands out slots and pages. Per layer:
  - window: the last `sliding_window` raw KV entries of each slot, a ring of `sliding_window + spare`
    rows indexed by position % rows;
  - compressed (CSA/HCA): one entry per `ratio` tokens, page p holding entries of tokens p*P .. p*P + P - 1;
  - index_keys (CSA): the lightning indexer's compressed keys, paged the same way (with kv_cache_dtype
    "fp8" and 128-dim keys: the packed e4m3 indexer cache of ds4.kernels.indexer, read by its kernels);
  - compressor / indexer state (fp32, per slot): the projected kv and gate scores of the last tokens, a ring
    of `coff * ratio + spare` rows indexed by position % rows (coff = 2 for overlapping CSA compression,
    which pools the previous window too, else 1).

Every per-slot state is a function of positions, never of "what came last": a step may write `spare`
positions past what the request keeps (speculative tokens the verification rejects) and nothing needs
undoing, because the rows those writes land on are read again only after the kept tokens at those
positions have rewritten them. The paged pools need no spare: an entry a rejected token completed is
visible to no position before its window completes again, which rewrites it first.
Attention entries (window and compressed) are rows of the compute dtype with kv_cache_dtype "bf16", or with
"fp8" the reference's FP8 entries as stored bytes (uint8 rows of ds4.kernels.fp8_kv.kv_entry_bytes: e4m3
non-RoPE channels with power-of-two block scales, bf16 RoPE channels; 584 bytes for DeepSeek-V4), which
ds4.kernels.sparse_attention reads directly; "auto" is "fp8" on CUDA where the dims allow it, else "bf16".
The fp8 mode's indexer keys are MXFP4-rounded, which the packed e4m3 indexer cache holds exactly.

Boundary snapshots (prefix caching): the state a request needs to resume at a page end e, for `num_snapshots`
snapshot ids. At a page end every compressor window is complete (page_size is a multiple of every ratio), so
the unfinished-window rows hold nothing and only two things are kept per layer: the window ring (raw entries
of tokens e - sliding_window .. e - 1, ring order) and, for CSA, the previous full window's rows of the
compressor and indexer states (the overlap), in window order. `save_snapshots` / `restore_snapshots` copy them
from / to slots, whose rings they address by position (so they take the page ends); the model also writes
them directly for page ends inside a prefill chunk (ForwardBatch.snapshots).

Every paged pool has one page more than num_pages: the last page (index num_pages) is a scratch page
that no block table names. The decode path writes there what must go nowhere (entries of windows that
did not complete, padding rows of a CUDA-graph batch), so its writes need no data-dependent shapes (the
compressor's kernel skips such windows altogether: the page's content is unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4.config import CSA, WINDOW, ModelConfig
from ds4.kernels.fp8_kv import KV_QUANT_BLOCK, kv_entry_bytes
from ds4.kernels.indexer import ENTRY_BYTES, HEAD_DIM, new_indexer_cache, page_entries, write_indexer_keys

FP8, BF16 = "fp8", "bf16"
KV_CACHE_DTYPES = ("auto", BF16, FP8)
SCRATCH_PAGES = 1


@dataclass
class CompressorState:
    """A ring of the last tokens' projections: token p in row p % rows."""

    kv: torch.Tensor  # [slots, coff * ratio + spare, coff * head_dim] fp32
    score: torch.Tensor  # same shape, gate logits (the position bias is added when they are pooled)


@dataclass
class LayerCache:
    kind: str
    ratio: int
    # Attention entries are rows of `entry` elements: head_dim values, or kv_entry_bytes bytes with the fp8 cache.
    window: torch.Tensor  # [slots, sliding_window + spare, entry], token p in row p % rows
    compressed: torch.Tensor | None = None  # [pages + 1, page_size // ratio, entry], the last page scratch
    # [pages + 1, page_size // ratio, index_head_dim] or packed (see packed_index_keys); the last page scratch
    index_keys: torch.Tensor | None = None
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    snapshot: LayerSnapshots | None = None


@dataclass
class LayerSnapshots:
    """One layer's boundary snapshots (see the module docstring); `compressor` / `indexer` only for CSA."""

    window: torch.Tensor  # [snapshots, sliding_window, entry]
    compressor: CompressorState | None = None  # kv / score [snapshots, ratio, 2 * head_dim]
    indexer: CompressorState | None = None  # [snapshots, ratio, 2 * index_head_dim]


def _fp8_fits(cfg: ModelConfig) -> bool:
    return cfg.nope_head_dim > 0 and cfg.nope_head_dim % KV_QUANT_BLOCK == 0


def resolve_kv_cache_dtype(cfg: ModelConfig, kv_cache_dtype: str, device: torch.device | str) -> str:
    """ "bf16" or "fp8": "auto" is the FP8 cache on CUDA (the reference's own semantics) where the config's
    non-RoPE dims are whole fp8 blocks, else "bf16" (entries unquantised, in the compute dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype == "auto":
        return FP8 if torch.device(device).type == "cuda" and _fp8_fits(cfg) else BF16
    if kv_cache_dtype == FP8 and not _fp8_fits(cfg):
        raise ValueError(
            f"kv_cache_dtype 'fp8': the non-RoPE head dims ({cfg.head_dim} - {cfg.qk_rope_head_dim} = "
            f"{cfg.nope_head_dim}) must be a multiple of the fp8 block {KV_QUANT_BLOCK}"
        )
    return kv_cache_dtype


def _resolved(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in (BF16, FP8):
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r}: byte counts need 'bf16' or 'fp8' (resolve 'auto' first)")
    return kv_cache_dtype


def kv_entry_size(cfg: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes one attention entry (window or compressed) takes in the cache."""
    if _resolved(kv_cache_dtype) == FP8:
        return kv_entry_bytes(cfg.head_dim, cfg.qk_rope_head_dim)
    return cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def cache_layers(cfg: ModelConfig, with_mtp: bool) -> range:
    """Layer indices that own a cache: the main layers, then the MTP layer when present."""
    return range(cfg.num_hidden_layers + (1 if with_mtp else 0))


def check_page_size(cfg: ModelConfig, page_size: int, with_mtp: bool) -> None:
    ratios = {cfg.compress_ratios[i] for i in cache_layers(cfg, with_mtp) if cfg.layer_kinds[i] != WINDOW}
    bad = sorted(r for r in ratios if page_size % r)
    if page_size < 1 or bad:
        raise ValueError(f"page_size {page_size} must be a positive multiple of every compression ratio; not of {bad}")


def _compressor_shape(kind: str, ratio: int, head_dim: int, spare: int) -> tuple[int, int]:
    coff = 2 if kind == CSA else 1
    return coff * ratio + spare, coff * head_dim


def packed_index_keys(cfg: ModelConfig, kv_cache_dtype: str) -> bool:
    """Whether the indexer keys live in the packed e4m3 cache (fp8 mode, keys of the kernels' 128 dims)."""
    return kv_cache_dtype == FP8 and cfg.index_head_dim == HEAD_DIM


def bytes_per_page(
    cfg: ModelConfig, page_size: int, dtype: torch.dtype, with_mtp: bool = False, kv_cache_dtype: str = BF16
) -> int:
    """Bytes one page of page_size tokens takes across every paged pool."""
    check_page_size(cfg, page_size, with_mtp)
    item = torch.empty((), dtype=dtype).element_size()
    entry = kv_entry_size(cfg, kv_cache_dtype, dtype)
    index_entry = ENTRY_BYTES if packed_index_keys(cfg, kv_cache_dtype) else cfg.index_head_dim * item
    total = 0
    for i in cache_layers(cfg, with_mtp):
        kind, ratio = cfg.layer_kinds[i], cfg.compress_ratios[i]
        if kind != WINDOW:
            total += page_size // ratio * entry
        if kind == CSA:
            total += page_size // ratio * index_entry
    return total


def entries_per_page(pool: torch.Tensor) -> int:
    """Entries one page of a compressed pool holds ([pages, entries, entry] or the packed indexer keys)."""
    return page_entries(pool) if pool.dim() == 2 else pool.shape[1]


def store_entries(pool: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor) -> None:
    """Writes entries [N, dim] to flat rows [N] (row = page * entries_per_page + offset) of a pool: the packed
    indexer keys (quantised here) or rows of the pool's dtype (FP8 attention entries come already stored)."""
    if pool.dim() == 2:
        write_indexer_keys(pool, rows, entries)
    else:
        pool.view(-1, pool.shape[-1])[rows] = entries.to(pool.dtype)


def bytes_per_slot(
    cfg: ModelConfig, dtype: torch.dtype, with_mtp: bool = False, spare: int = 0, kv_cache_dtype: str = BF16
) -> int:
    """Bytes one request slot takes: sliding windows plus fp32 compressor states (`spare`: see the module doc)."""
    entry = kv_entry_size(cfg, kv_cache_dtype, dtype)
    total = 0
    for i in cache_layers(cfg, with_mtp):
        kind, ratio = cfg.layer_kinds[i], cfg.compress_ratios[i]
        total += (cfg.sliding_window + spare) * entry
        if kind != WINDOW:
            rows, width = _compressor_shape(kind, ratio, cfg.head_dim, spare)
            total += 2 * rows * width * 4
        if kind == CSA:
            rows, width = _compressor_shape(kind, ratio, cfg.index_head_dim, spare)
            total += 2 * rows * width * 4
    return total


def bytes_per_snapshot(cfg: ModelConfig, dtype: torch.dtype, with_mtp: bool = False, kv_cache_dtype: str = BF16) -> int:
    """Bytes one boundary snapshot takes: windows plus CSA's overlap rows (fp32 kv and score)."""
    entry = kv_entry_size(cfg, kv_cache_dtype, dtype)
    total = 0
    for i in cache_layers(cfg, with_mtp):
        total += cfg.sliding_window * entry
        if cfg.layer_kinds[i] == CSA:
            total += 2 * cfg.compress_ratios[i] * 2 * (cfg.head_dim + cfg.index_head_dim) * 4
    return total


class ModelCache:
    """Every layer's cache storage, allocated up front; `spare` positions a step may write past what it keeps."""

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
        spare: int = 0,
        num_snapshots: int = 0,
    ):
        kv_cache_dtype = resolve_kv_cache_dtype(cfg, kv_cache_dtype, device)
        check_page_size(cfg, page_size, with_mtp)
        if num_slots < 1 or num_pages < 1:
            raise ValueError(f"ModelCache: need at least one slot and one page (got {num_slots}, {num_pages})")
        self.num_slots, self.num_pages, self.page_size = num_slots, num_pages, page_size
        if spare < 0:
            raise ValueError(f"ModelCache: spare must be >= 0, got {spare}")
        self.kv_cache_dtype, self.spare = kv_cache_dtype, spare
        self.num_snapshots = num_snapshots
        self.layers = [self._layer(cfg, i, dtype, torch.device(device)) for i in cache_layers(cfg, with_mtp)]

    def _layer(self, cfg: ModelConfig, i: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        kind, ratio = cfg.layer_kinds[i], cfg.compress_ratios[i]
        fp8 = self.kv_cache_dtype == FP8
        entry, entry_dtype = (
            (kv_entry_bytes(cfg.head_dim, cfg.qk_rope_head_dim), torch.uint8) if fp8 else (cfg.head_dim, dtype)
        )
        layer = LayerCache(
            kind,
            ratio,
            torch.zeros(self.num_slots, cfg.sliding_window + self.spare, entry, dtype=entry_dtype, device=device),
        )
        if self.num_snapshots:
            window = torch.zeros(self.num_snapshots, cfg.sliding_window, entry, dtype=entry_dtype, device=device)
            layer.snapshot = LayerSnapshots(window)
        if kind == WINDOW:
            return layer
        entries, pages = self.page_size // ratio, self.num_pages + SCRATCH_PAGES
        layer.compressed = torch.zeros(pages, entries, entry, dtype=entry_dtype, device=device)
        layer.compressor = self._state(kind, ratio, cfg.head_dim, device)
        if kind == CSA:
            if packed_index_keys(cfg, self.kv_cache_dtype):
                layer.index_keys = new_indexer_cache(pages, device, entries_per_page=entries)
            else:
                layer.index_keys = torch.zeros(pages, entries, cfg.index_head_dim, dtype=dtype, device=device)
            layer.indexer = self._state(kind, ratio, cfg.index_head_dim, device)
            if layer.snapshot is not None:
                layer.snapshot.compressor = _overlap_rows(layer.compressor, self.num_snapshots, ratio)
                layer.snapshot.indexer = _overlap_rows(layer.indexer, self.num_snapshots, ratio)
        return layer

    def _state(self, kind: str, ratio: int, head_dim: int, device: torch.device) -> CompressorState:
        shape = (self.num_slots, *_compressor_shape(kind, ratio, head_dim, self.spare))
        return CompressorState(
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
        )

    def save_snapshots(self, slots: list[int], snapshots: list[int], page_ends: list[int]) -> None:
        """Keep each slot's state, which must stand at (or, with spare rows, past) page end page_ends[i], as its
        boundary snapshot."""
        if slots:
            self._copy_snapshots(self._index(snapshots), self._index(slots), self._index(page_ends), save=True)

    def restore_snapshots(self, snapshots: list[int], slots: list[int], page_ends: list[int]) -> None:
        """Put each slot in the state of its boundary snapshot (requests resuming at those page ends)."""
        if slots:
            self._copy_snapshots(self._index(snapshots), self._index(slots), self._index(page_ends), save=False)

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.layers[0].window.device)

    def _copy_snapshots(self, snapshots: torch.Tensor, slots: torch.Tensor, ends: torch.Tensor, save: bool) -> None:
        """A kept span holds the n tokens before e in ring order (position % n); the slot's ring, position % rows."""

        def span(n: int, rows: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
            positions = ends[:, None] - n + torch.arange(n, device=ends.device)
            return (slots[:, None], positions % rows), (snapshots[:, None], positions % n)

        for layer in self.layers:
            kept = layer.snapshot
            pairs = [(layer.window, kept.window, *span(kept.window.shape[1], layer.window.shape[1]))]
            for state, rows in ((layer.compressor, kept.compressor), (layer.indexer, kept.indexer)):
                if rows is not None:
                    where = span(layer.ratio, state.kv.shape[1])
                    pairs += [(state.kv, rows.kv, *where), (state.score, rows.score, *where)]
            for live, store, live_rows, store_rows in pairs:
                if save:
                    store[store_rows] = live[live_rows]
                else:
                    live[live_rows] = store[store_rows]


def _overlap_rows(state: CompressorState, num_snapshots: int, ratio: int) -> CompressorState:
    shape = (num_snapshots, ratio, state.kv.shape[-1])
    return CompressorState(
        torch.zeros(shape, dtype=torch.float32, device=state.kv.device),
        torch.full(shape, float("-inf"), dtype=torch.float32, device=state.kv.device),
    )
