"""The compressor's gated pooling: one entry from a window of token projections, a per-channel softmax of their
scores (plus the position bias `ape` of each token's place in its block of `ratio`) weighting their values.

Window rows name rows of two sources, each kv and score [., width] fp32: the per-slot rings (flat, slot * ring
rows + row) first, then the step's fresh projections; -1 names an empty row (kv 0, score -inf). With overlap (CSA)
a window spans two blocks of `ratio` tokens: the first block gives the first half of the channels
(width = 2 * head_dim), the second block the second half.

The pooled entries are then finished like every attention entry (ds4.kernels.norm_rope: RMSNorm, RoPE at the
window's first position, the cache's form) and written to their pool rows. On CUDA one launch does it all,
reading the rows in place (torch's path gathers every window into new tensors, splits and joins the halves,
then softmax, product and sum, and the finish's ops after).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early
from ds4.kernels.norm_rope import EntryForm, finish_entries, pair_block, rounded

# Chosen settings: scores (and as many values) a program pools at a time (a window's span x a block of channels,
# at least MIN_CHANNELS of them), and its warps.
POOL_TILE, MIN_CHANNELS, WARPS = 4096, 16, 8
VECTOR = 4  # fp32 values in one 16-byte load


def window_rows(ring: torch.Tensor, fresh: torch.Tensor, rows: torch.Tensor, empty: float) -> torch.Tensor:
    """The rows `rows` of ring [S, width] then fresh [T, width]; -1 gives a row of `empty`."""
    return torch.cat((ring, fresh, ring.new_full((1, ring.shape[1]), empty)))[rows]


def gated_pool_reference(
    ring: tuple[torch.Tensor, torch.Tensor], fresh: tuple[torch.Tensor, torch.Tensor], ape: torch.Tensor, rows
) -> torch.Tensor:
    """(kv, score) of the rings and of the fresh rows, ape [ratio, width], window rows [N, span] -> entries
    [N, head_dim] fp32 (head_dim = width, or width / 2 when span is two blocks: overlap)."""
    ratio = ape.shape[0]
    kv = window_rows(ring[0], fresh[0], rows, 0.0)
    score = window_rows(ring[1], fresh[1], rows, float("-inf"))
    span = rows.shape[1]
    score = score + ape[torch.arange(span, device=rows.device) % ratio]
    if span > ratio:
        d = kv.shape[-1] // 2
        kv = torch.cat((kv[:, :ratio, :d], kv[:, ratio:, d:]), dim=1)
        score = torch.cat((score[:, :ratio, :d], score[:, ratio:, d:]), dim=1)
    return (kv * score.softmax(dim=1)).sum(dim=1)


@triton.jit
def _pooled_block(sources, window, head_dim, start, OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr, RUN: tl.constexpr):
    """The pooled channels start .. start + BLOCK_C of a window (fp32, 0 past head_dim): `sources` the rings, the
    fresh rows and ape, `window` its rows (index j, span, where each is) and their offsets in the sources."""
    ring_kv_ptr, ring_score_ptr, fresh_kv_ptr, fresh_score_ptr, ape_ptr = sources
    j, span, in_ring, in_fresh, ring_at, fresh_at, ape_at = window
    c = start + tl.arange(0, BLOCK_C) // RUN * RUN + tl.arange(0, BLOCK_C) % RUN  # runs of RUN: see channel_run
    col = c[None, :]
    if OVERLAP:
        col += (j >= span // 2).to(tl.int32)[:, None] * head_dim
    ok = (c < head_dim)[None, :]
    from_ring, from_fresh = ok & in_ring[:, None], ok & in_fresh[:, None]
    score = tl.load(ring_score_ptr + ring_at + col, mask=from_ring, other=0.0)
    score = tl.where(from_fresh, tl.load(fresh_score_ptr + fresh_at + col, mask=from_fresh, other=0.0), score)
    score = score + tl.load(ape_ptr + ape_at + col, mask=ok & (j < span)[:, None], other=0.0)
    score = tl.where(from_ring | from_fresh, score, float("-inf"))  # empty rows and padding weigh nothing
    kv = tl.load(ring_kv_ptr + ring_at + col, mask=from_ring, other=0.0)
    kv = tl.where(from_fresh, tl.load(fresh_kv_ptr + fresh_at + col, mask=from_fresh, other=0.0), kv)
    e = tl.exp(score - tl.max(score, axis=0)[None, :])
    return tl.where(c < head_dim, tl.sum(kv * (e / tl.sum(e, axis=0)[None, :]), axis=0), 0.0)


@triton.jit(do_not_specialize=["ring_rows", "skip", "span", "ratio", "out_stride"])
def _pooled_entries_kernel(
    ring_kv_ptr,
    ring_score_ptr,
    fresh_kv_ptr,
    fresh_score_ptr,
    fresh_stride,
    ring_rows,
    ape_ptr,
    rows_ptr,
    index_ptr,
    pooled_ptr,
    w_ptr,
    freq_ptr,
    out_ptr,
    out_stride,
    target_ptr,
    skip,
    span,
    ratio,
    head_dim,
    eps,
    OVERLAP: tl.constexpr,
    TARGETS: tl.constexpr,
    FP8: tl.constexpr,
    HALF: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    RUN: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_launch_start(PDL)  # PDL: launched early
    n = tl.program_id(0).to(tl.int64)
    width = (2 if OVERLAP else 1) * head_dim
    j = tl.arange(0, SPAN)
    row = tl.load(rows_ptr + n * span + j, mask=j < span, other=-1).to(tl.int64)
    in_ring = (row >= 0) & (row < ring_rows)
    in_fresh = row >= ring_rows
    ring_at = row[:, None] * width
    fresh_at = (row - ring_rows)[:, None] * fresh_stride
    ape_at = (j % ratio)[:, None] * width
    pooled_row = pooled_ptr + n * head_dim
    target = n
    if TARGETS:
        target = tl.load(target_ptr + n).to(tl.int64)
    # A window whose entry nothing reads (decode: unfinished, padding) costs no work: neither pooled nor finished.
    if target != skip:
        sources = (ring_kv_ptr, ring_score_ptr, fresh_kv_ptr, fresh_score_ptr, ape_ptr)
        window = (j, span, in_ring, in_fresh, ring_at, fresh_at, ape_at)
        # Pooled values are rounded to the compute dtype, as the entry is.
        dtype = pooled_ptr.dtype.element_ty
        pair = tl.arange(0, BLOCK_P)
        if BLOCK_C == 2 * BLOCK_P:  # one block is the whole row: its pairs are split apart in registers
            pooled = rounded(_pooled_block(sources, window, head_dim, 0, OVERLAP, BLOCK_C, RUN), dtype)
            even, odd = tl.split(tl.reshape(pooled, (BLOCK_P, 2)))
        else:  # a block at a time into the pooled row, then read back in pairs by the program's other threads
            for start in range(0, head_dim, BLOCK_C):
                c = start + tl.arange(0, BLOCK_C) // RUN * RUN + tl.arange(0, BLOCK_C) % RUN
                pooled = rounded(_pooled_block(sources, window, head_dim, start, OVERLAP, BLOCK_C, RUN), dtype)
                tl.store(pooled_row + c, pooled.to(dtype), mask=c < head_dim)
            tl.debug_barrier()
            p_ok = pair < head_dim // 2
            even = tl.load(pooled_row + 2 * pair, mask=p_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            odd = tl.load(pooled_row + 2 * pair + 1, mask=p_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        position = tl.load(index_ptr + n + tl.arange(0, 1)) * ratio
        finish_entries(
            even[None, :],
            odd[None, :],
            pair,
            tl.full((1,), 1, tl.int1),
            out_ptr + target * out_stride + tl.arange(0, 1),
            w_ptr,
            position,
            freq_ptr,
            head_dim,
            eps,
            True,
            FP8,
            HALF,
            1,
            BLOCK_P,
            pooled_ptr.dtype.element_ty,
        )


def channel_run(block_c: int) -> int:
    """Contiguous channels a thread loads of a window row: a 16-byte vector, or fewer where that spreads the block
    over all the program's threads. Each thread then holds whole spans of its channels: the softmax and the sum
    over the span stay in its registers, and the pooled row is already in its store's layout (16-byte runs would
    split a CSA window's 8 rows over two warps: sums across warps through shared memory, the row moved for the
    store)."""
    threads = 32 * WARPS
    return VECTOR if block_c < threads else min(VECTOR, block_c // threads)


def pooled_entries_reference(ring, fresh, ape, rows, index, form: EntryForm, pool=None, targets=None, skip=-1):
    """The spec of pooled_entries, composed of torch ops."""
    pooled = gated_pool_reference(ring, fresh, ape, rows).to(form.dtype)
    entries = form.reference(pooled, index * ape.shape[0])
    if pool is None:
        return entries
    pool[targets] = entries  # the skipped rows too: their content is unspecified (no host sync to leave them out)
    return None


def pooled_entries_triton(ring, fresh, ape, rows, index, form: EntryForm, pool=None, targets=None, skip=-1):
    """pooled_entries_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    (ring_kv, ring_score), (kv, score) = ring, fresh
    n, span = rows.shape
    ratio, width = ape.shape
    overlap = span > ratio
    head_dim = width // 2 if overlap else width
    rings_ok = all(t.dim() == 2 and t.shape[1] == width and t.is_contiguous() for t in (ring_kv, ring_score, ape))
    # The fresh rows may be row slices of a wider buffer (StackedLinears' outputs), of one row stride.
    fresh_ok = all(t.dim() == 2 and t.shape[1] == width and t.stride(1) == 1 for t in (kv, score))
    if not (rings_ok and fresh_ok and kv.stride(0) == score.stride(0)) or span % ratio:
        raise ValueError(
            f"pooled_entries: rings {list(ring_kv.shape)}, fresh {list(kv.shape)}, ape {list(ape.shape)} and rows "
            f"{list(rows.shape)} do not fit rows of {width} (contiguous rings, fresh rows of one stride)"
        )
    if not form.fits_kernel(head_dim):
        raise ValueError(f"pooled_entries: {form.rope_dim} RoPE dims do not fit entries of {head_dim}")
    size, dtype = form.entry_size(head_dim), form.entry_dtype()
    out = pool if pool is not None else torch.empty(n, size, dtype=dtype, device=kv.device)
    if out.dim() != 2 or out.shape[1] != size or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"pooled_entries: pool rows {out.dtype} {list(out.shape)} do not hold entries of {size}")
    if n:
        pooled = torch.empty(n, head_dim, dtype=form.dtype, device=kv.device)
        block_c = max(MIN_CHANNELS, min(triton.next_power_of_2(head_dim), POOL_TILE // triton.next_power_of_2(span)))
        pdl = launches_dependents_early(kv.device)
        _pooled_entries_kernel[(n,)](
            ring_kv,
            ring_score,
            kv,
            score,
            kv.stride(0),
            ring_kv.shape[0],
            ape,
            rows.contiguous(),
            index,
            pooled,
            form.weight,
            form.inv_freq.to(device=kv.device, dtype=torch.float32).contiguous(),
            out,
            out.stride(0),
            targets if targets is not None else rows,
            skip,
            span,
            ratio,
            head_dim,
            form.eps,
            OVERLAP=overlap,
            TARGETS=pool is not None,
            FP8=form.fp8,
            HALF=form.inv_freq.numel(),
            SPAN=triton.next_power_of_2(span),
            BLOCK_C=block_c,
            BLOCK_P=pair_block(head_dim),
            RUN=channel_run(block_c),
            PDL=pdl,
            num_warps=WARPS,
            launch_pdl=pdl,
        )
    return None if pool is not None else out


def pooled_entries(ring, fresh, ape, rows, index, form: EntryForm, pool=None, targets=None, skip=-1):
    """The entries of windows `rows` [N, span] of window index `index` [N]: pooled from ring and fresh (each a
    (kv, score) pair of flat [., width] fp32 rows; see the module) with the position bias ape [ratio, width],
    finished as `form` says at position index * ratio. Returned [N, entry], or written to rows `targets` [N] of
    `pool` [rows, entry] when a pool is given; windows whose target is `skip` (a scratch row nothing reads) are
    neither pooled nor written by the kernel, so that row's content is unspecified."""
    args = (ring, fresh, ape, rows, index, form, pool, targets, skip)
    if fresh[0].is_cuda and form.fits_kernel(fresh[0].shape[1] // (rows.shape[1] // ape.shape[0])):
        return pooled_entries_triton(*args)
    return pooled_entries_reference(*args)
