"""Exact top-k indices of fp32 score rows (the lightning indexer's selection).

`topk_indices(scores, lengths, k)` returns, for every row, the int32 indices of the k largest among
the row's first `lengths[row]` entries, padded with -1 when the row is shorter than k.

Order (the spec, shared by the torch reference and the Triton kernels):
  * values compare as numbers; -0.0 and +0.0 are equal; NaN ranks above +inf and all NaNs are equal
    (torch.topk also treats NaN as the largest value);
  * equal values are taken lowest index first, so the chosen set never depends on timing;
  * each row lists its chosen indices in ascending order, then the -1s (a fixed order, so
    consumers that sum over the selection get the same bits every run).
`lengths` are clamped to [0, scores.shape[1]]; rows may have any stride (the last dim is contiguous).

How the Triton path stays exact and fast (one zeroed workspace and one or two launches, no host sync):
  1. scan (many programs per row when rows are few): every row is cut into groups of G entries and
     read once, in whole tiles of 16-byte loads; each group's maximum order key is kept in a
     workspace and counted in a 256-bin histogram of its top byte.
  2. the program that finishes a row last (an atomic arrival count; nobody waits) histograms the
     next byte of the group maxima in the threshold bin. That gives tau, a 16-bit-precise lower bound
     with at least min(k, groups) group maxima >= tau: every group maximum >= tau is itself an
     entry >= tau, so the top k are all among the entries >= tau. G is chosen so a full-length row
     has >= 8k groups, which leaves about k + a few percent such entries on spread-out data.
  3. collection: the numbers of the groups whose maximum reaches tau are compacted, and only those
     groups are read again; their entries >= tau go to a per-row buffer of CAP slots (an atomic
     slot counter per row).
  4. the last program of the row: when the candidates fit in CAP, an exact radix select over them in
     registers (and a second one over column numbers when the k-th value has more ties than places),
     then the chosen columns in ascending order; when they do not (tie-dominated rows, for
     instance), an exact radix select over the whole row instead (4 byte passes, then an in-order
     gather that takes the lowest-column ties). Either way the answer is exact: an overflowing buffer
     only changes which path runs, never the result.
With one program per row (many rows) all four steps run in one launch; with several per row, step 3
and 4 run in a second launch, since tau needs the whole row. No program ever waits on another;
workspaces are sized from the shapes alone, so the call is safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import num_sms

MAX_K = 2048
_TILE = 4096  # entries per streaming step
_GATHER = 2048  # entries per candidate-gather step
_GM_BLOCK = 2048  # group maxima per step
_GROUPS_PER_K = 8  # a row wants >= 8k groups so that tau lands close to the k-th value
_MAX_GROUP = 256
_EXACT_TILE = 1024  # entries per step of the rare whole-row fallback (small, so it costs no registers elsewhere)
_PROGRAMS_PER_SM = 4  # programs per SM when a batch has few rows
_FINISH_IN_SCAN = True
_WS_COLS = 260  # per row: histogram[256], candidate count, two arrival counts, tau

INT_MIN = tl.constexpr(-(2**31))
INT_MAX = tl.constexpr(2**31 - 1)
WS_COLS = tl.constexpr(_WS_COLS)
FOUND = tl.constexpr(256)
ARRIVED_SCAN = tl.constexpr(257)
ARRIVED_COLLECT = tl.constexpr(258)
TAU = tl.constexpr(259)


# ----------------------------------------------------------------------------------------------
# torch reference (the spec, and the CPU path)
# ----------------------------------------------------------------------------------------------


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys whose signed order is the top-k order of fp32 values (see the module docstring)."""
    bits = x.float().contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = torch.where(x == 0, torch.zeros_like(keys), keys)
    return torch.where(torch.isnan(x), torch.full_like(keys, 2**31 - 1), keys)


def topk_indices_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Plain torch: a stable descending sort of the order keys, first k kept and put in column order."""
    rows, cols = scores.shape
    lengths = lengths.to(device=scores.device, dtype=torch.int64).clamp(0, cols)
    positions = torch.arange(cols, device=scores.device)
    valid = positions[None, :] < lengths[:, None]
    keys = order_keys(scores).to(torch.int64)
    keys = torch.where(valid, keys, torch.full_like(keys, -(2**40)))
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]
    kept = order.shape[1]
    rank = torch.arange(kept, device=scores.device)
    order = torch.where(rank[None, :] < lengths[:, None], order, torch.full_like(order, cols + 1))
    order = order.sort(dim=1).values  # chosen columns ascending, the unused places last
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    out[:, :kept] = torch.where(order > cols, torch.full_like(order, -1), order).to(torch.int32)
    return out


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _order_key(x):
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = tl.where(x == 0.0, 0, key)
    return tl.where(x != x, INT_MAX, key)


@triton.jit
def _byte(key, shift: tl.constexpr):
    """Byte `shift/8` of the key in unsigned order (sign bit flipped), as a bin number 0..255."""
    return ((key ^ INT_MIN) >> shift) & 0xFF


@triton.jit
def _threshold_bin(hist, rank):
    """Highest bin b whose count together with all higher bins reaches `rank`; also the count above b."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    b = tl.max(tl.where(at_or_above >= rank, bins, -1), axis=0)
    above = tl.sum(tl.where(bins > b, hist, 0), axis=0)
    return b, above


@triton.jit
def _row_length(lengths_ptr, row, n_cols):
    return tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)


@triton.jit
def _row_scores(scores_ptr, row, stride_row, VEC: tl.constexpr):
    """The row's base pointer; VEC promises 16-byte aligned rows, so whole tiles load as 16-byte vectors."""
    offset = row.to(tl.int64) * stride_row
    if VEC:
        offset = tl.multiple_of(offset, 4)
    return scores_ptr + offset


@triton.jit
def _tile_maxima(row_scores, off, length, G: tl.constexpr, TILE: tl.constexpr, MASKED: tl.constexpr):
    """Maximum order key of each of the TILE // G groups of the tile at column `off` (INT_MIN past the row)."""
    cols = off + tl.arange(0, TILE // G)[:, None] * G + tl.arange(0, G)[None, :]
    if MASKED:
        inside = cols < length
        key = tl.where(inside, _order_key(tl.load(row_scores + cols, mask=inside, other=0.0)), INT_MIN)
    else:
        key = _order_key(tl.load(row_scores + cols))
    return tl.max(key, axis=1)


@triton.jit
def _row_tau(hist1, row_gm, length, k, G: tl.constexpr, GM_BLOCK: tl.constexpr):
    """The collection threshold of a row from the top-byte histogram of its group maxima."""
    groups = (length + G - 1) // G
    rank = tl.minimum(k, groups)
    b1, above1 = _threshold_bin(hist1, rank)
    hist2 = tl.zeros([256], dtype=tl.int32)
    for g0 in range(0, groups, GM_BLOCK):
        g = g0 + tl.arange(0, GM_BLOCK)
        real = g < groups
        gmax = tl.load(row_gm + g, mask=real, other=INT_MIN, cache_modifier=".cg")
        hist2 += tl.histogram(_byte(gmax, 16), 256, mask=real & (_byte(gmax, 24) == b1))
    b2, _ = _threshold_bin(hist2, rank - above1)
    tau = ((b1 << 24) | (b2 << 16)) ^ INT_MIN
    # With k or fewer groups every entry may be needed: only the minimum over all entries is safe.
    return tl.where(groups <= k, INT_MIN, tau)


@triton.jit
def _collect(row_scores, row_gm, ws_row, cand_row, g_first, g_end, length, tau,
             G: tl.constexpr, GM_BLOCK: tl.constexpr, GATHER: tl.constexpr, CAP: tl.constexpr, SHARED: tl.constexpr):
    """Appends the entries >= tau of groups [g_first, g_end) to the row's candidates.

    The hot groups' numbers are first compacted in place over their (already used) maxima: a slot
    never passes the group being read, and a block is wholly loaded before any of it is overwritten.
    SHARED: several programs fill the row's buffer (slots from an atomic counter); otherwise this
    program alone does, in column order, and stores the count at the end.
    """
    hot_count = 0
    for g0 in range(g_first, g_end, GM_BLOCK):
        g = g0 + tl.arange(0, GM_BLOCK)
        real = g < g_end
        hot = real & (tl.load(row_gm + g, mask=real, other=INT_MIN, cache_modifier=".cg") >= tau)
        slot = g_first + hot_count + tl.cumsum(hot.to(tl.int32), axis=0) - 1
        tl.store(row_gm + slot, g, mask=hot)
        hot_count += tl.sum(hot.to(tl.int32), axis=0)
    tl.debug_barrier()
    written = hot_count * 0
    for h0 in range(0, hot_count, GATHER // G):
        j = h0 + tl.arange(0, GATHER // G)
        listed = j < hot_count
        group = tl.load(row_gm + g_first + j, mask=listed, other=0, cache_modifier=".cg")
        cols = group[:, None] * G + tl.arange(0, G)[None, :]
        inside = listed[:, None] & (cols < length)
        key = _order_key(tl.load(row_scores + cols, mask=inside, other=0.0))
        take = tl.reshape(inside & (key >= tau), [GATHER]).to(tl.int32)
        if SHARED:
            base = tl.atomic_add(ws_row + FOUND, tl.sum(take, axis=0), sem="relaxed")
        else:
            base = written
        slot = base + tl.cumsum(take, axis=0) - 1
        keep = (take != 0) & (slot < CAP)
        tl.store(cand_row + slot, tl.reshape(key, [GATHER]), mask=keep)
        tl.store(cand_row + CAP + slot, tl.reshape(cols, [GATHER]), mask=keep)
        written += tl.sum(take, axis=0)
    if not SHARED:
        tl.store(ws_row + FOUND, written)


@triton.jit
def _kth_largest(keys, live, rank):
    """Exact rank-th largest of keys[live] (radix select over the 4 key bytes), and how many live keys exceed it."""
    prefix = 0
    above = 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        match = live
        if p > 0:
            match = live & (((keys ^ INT_MIN) >> (shift + 8)) == (prefix >> (shift + 8)))
        b, more = _threshold_bin(tl.histogram(_byte(keys, shift), 256, mask=match), rank - above)
        above += more
        prefix = prefix | (b << shift)
    return prefix ^ INT_MIN, above


@triton.jit
def _select_candidates(keys, cols, live, rank, out_row, k, ORDERED: tl.constexpr, K_PAD: tl.constexpr):
    """Writes the top `rank` live candidates' columns ascending to out_row, then -1 up to k.

    ORDERED: the candidates already sit in column order (one program collected them); otherwise the
    chosen columns are sorted after they are written.
    """
    threshold, above = _kth_largest(keys, live, rank)
    tie = live & (keys == threshold)
    ties_wanted = rank - above
    lowest_first = INT_MAX - cols  # larger for lower columns, so ties resolve by the same select
    cut = tl.sum(tie.to(tl.int32), axis=0) * 0 + INT_MIN
    if tl.sum(tie.to(tl.int32), axis=0) > ties_wanted:
        cut = _kth_largest(lowest_first, tie, ties_wanted)[0]
    take = (live & (keys > threshold)) | (tie & (lowest_first >= cut))
    take = take & (rank > 0)
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot, cols, mask=take)
    pad = tl.arange(0, K_PAD)
    if not ORDERED:
        tl.debug_barrier()
        chosen = tl.load(out_row + pad, mask=pad < rank, other=INT_MAX, cache_modifier=".cg")
        tl.store(out_row + pad, tl.sort(chosen), mask=pad < rank)
    tl.store(out_row + pad, tl.full([K_PAD], -1, tl.int32), mask=(pad >= rank) & (pad < k))


@triton.jit
def _exact_row(row_scores, length, rank, out_row, k, TILE: tl.constexpr, K_PAD: tl.constexpr):
    """Exact top-`rank` of one whole row by streaming radix select; used when the candidates did not fit."""
    lanes = tl.arange(0, TILE)
    prefix = 0
    above = 0
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros([256], dtype=tl.int32)
        for off in range(0, length, TILE):
            cols = off + lanes
            inside = cols < length
            key = _order_key(tl.load(row_scores + cols, mask=inside, other=0.0))
            if p > 0:
                inside = inside & (((key ^ INT_MIN) >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(_byte(key, shift), 256, mask=inside)
        b, more = _threshold_bin(hist, rank - above)
        above += more
        prefix = prefix | (b << shift)
    threshold = prefix ^ INT_MIN
    ties_wanted = rank - above
    written = 0
    ties_seen = 0
    for off in range(0, length, TILE):
        cols = off + lanes
        inside = cols < length
        key = _order_key(tl.load(row_scores + cols, mask=inside, other=0.0))
        tie = inside & (key == threshold)
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = (inside & (key > threshold)) | (tie & (tie_rank < ties_wanted))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, cols, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
    pad = tl.arange(0, K_PAD)
    tl.store(out_row + pad, tl.full([K_PAD], -1, tl.int32), mask=(pad >= rank) & (pad < k))


@triton.jit
def _finish(row_scores, length, k, ws_row, cand_row, out_row, ORDERED: tl.constexpr, EXACT_TILE: tl.constexpr,
            CAP: tl.constexpr, K_PAD: tl.constexpr):
    rank = tl.minimum(k, length)
    found = tl.load(ws_row + FOUND, cache_modifier=".cg")
    if found <= CAP:
        slots = tl.arange(0, CAP)
        live = slots < found
        keys = tl.load(cand_row + slots, mask=live, other=INT_MIN, cache_modifier=".cg")
        cols = tl.load(cand_row + CAP + slots, mask=live, other=0, cache_modifier=".cg")
        _select_candidates(keys, cols, live, rank, out_row, k, ORDERED, K_PAD)
    else:
        _exact_row(row_scores, length, rank, out_row, k, EXACT_TILE, K_PAD)


@triton.jit(do_not_specialize=["stride_row", "n_cols", "k", "tiles_per_split", "n_splits"])
def _scan_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, gm_ptr, stride_gm, ws_ptr, cand_ptr, out_ptr, k,
                 tiles_per_split, n_splits, G: tl.constexpr, TILE: tl.constexpr, GM_BLOCK: tl.constexpr,
                 GATHER: tl.constexpr, CAP: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr,
                 EXACT_TILE: tl.constexpr, FINISH: tl.constexpr):
    """Steps 1-2 over one split of a row; with a single split per row, step 3 and (FINISH) step 4 too."""
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    row_scores = _row_scores(scores_ptr, row, stride_row, VEC)
    row_gm = gm_ptr + row.to(tl.int64) * stride_gm
    ws_row = ws_ptr + row.to(tl.int64) * WS_COLS
    first = tl.program_id(1) * tiles_per_split
    end = tl.maximum(first, tl.minimum(first + tiles_per_split, (length + TILE - 1) // TILE))
    full = tl.minimum(end, tl.maximum(first, length // TILE))
    per_tile = tl.arange(0, TILE // G)
    hist = tl.zeros([256], dtype=tl.int32)
    for t in range(first, full):
        gmax = _tile_maxima(row_scores, t * TILE, length, G, TILE, False)
        tl.store(row_gm + t * (TILE // G) + per_tile, gmax)
        hist += tl.histogram(_byte(gmax, 24), 256)
    if full < end:
        gmax = _tile_maxima(row_scores, full * TILE, length, G, TILE, True)
        group = full * (TILE // G) + per_tile
        real = group * G < length
        tl.store(row_gm + group, gmax, mask=real)
        hist += tl.histogram(_byte(gmax, 24), 256, mask=real)
    bins = tl.arange(0, 256)
    tl.debug_barrier()
    arrived = n_splits - 1
    if n_splits > 1:
        tl.atomic_add(ws_row + bins, hist, mask=hist > 0, sem="relaxed")
        tl.debug_barrier()
        arrived = tl.atomic_add(ws_row + ARRIVED_SCAN, 1, sem="acq_rel")
    if arrived == n_splits - 1:
        if n_splits > 1:
            hist = tl.load(ws_row + bins, cache_modifier=".cg")
        tau = _row_tau(hist, row_gm, length, k, G, GM_BLOCK)
        if n_splits > 1:
            tl.store(ws_row + TAU, tau)
        else:
            cand_row = cand_ptr + row.to(tl.int64) * (2 * CAP)
            _collect(row_scores, row_gm, ws_row, cand_row, 0, (length + G - 1) // G, length, tau,
                     G, GM_BLOCK, GATHER, CAP, False)
            if FINISH:
                tl.debug_barrier()
                _finish(row_scores, length, k, ws_row, cand_row, out_ptr + row.to(tl.int64) * k, True, EXACT_TILE,
                        CAP, K_PAD)


@triton.jit(do_not_specialize=["stride_row", "n_cols", "k", "tiles_per_split", "n_splits"])
def _collect_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, gm_ptr, stride_gm, ws_ptr, cand_ptr, out_ptr, k,
                    tiles_per_split, n_splits, G: tl.constexpr, TILE: tl.constexpr, GM_BLOCK: tl.constexpr,
                    GATHER: tl.constexpr, CAP: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr,
                    EXACT_TILE: tl.constexpr, FINISH: tl.constexpr):
    """Steps 3-4 when a row has several splits: each collects its own groups, the last one selects."""
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    row_scores = _row_scores(scores_ptr, row, stride_row, VEC)
    row_gm = gm_ptr + row.to(tl.int64) * stride_gm
    ws_row = ws_ptr + row.to(tl.int64) * WS_COLS
    cand_row = cand_ptr + row.to(tl.int64) * (2 * CAP)
    g_first = tl.program_id(1) * tiles_per_split * (TILE // G)
    g_end = tl.minimum(g_first + tiles_per_split * (TILE // G), (length + G - 1) // G)
    _collect(row_scores, row_gm, ws_row, cand_row, g_first, g_end, length, tl.load(ws_row + TAU),
             G, GM_BLOCK, GATHER, CAP, True)
    tl.debug_barrier()
    if tl.atomic_add(ws_row + ARRIVED_COLLECT, 1, sem="acq_rel") == n_splits - 1:
        _finish(row_scores, length, k, ws_row, cand_row, out_ptr + row.to(tl.int64) * k, False, EXACT_TILE, CAP,
                K_PAD)


@triton.jit(do_not_specialize=["stride_row", "n_cols", "k"])
def _finish_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, ws_ptr, cand_ptr, out_ptr, k,
                   CAP: tl.constexpr, K_PAD: tl.constexpr, VEC: tl.constexpr, EXACT_TILE: tl.constexpr):
    """Step 4 for rows that one scan program collected (when the scan leaves it out to stay lean)."""
    row = tl.program_id(0)
    _finish(_row_scores(scores_ptr, row, stride_row, VEC), _row_length(lengths_ptr, row, n_cols), k,
            ws_ptr + row.to(tl.int64) * WS_COLS, cand_ptr + row.to(tl.int64) * (2 * CAP),
            out_ptr + row.to(tl.int64) * k, True, EXACT_TILE, CAP, K_PAD)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def _group_size(n_cols: int, k: int) -> int:
    """Largest power of two <= 256 that leaves a full-length row at least 8k groups."""
    g = 1
    while g < _MAX_GROUP and n_cols // (2 * g) >= _GROUPS_PER_K * k:
        g *= 2
    return g


def _topk_triton(scores: torch.Tensor, lengths: torch.Tensor, k: int, tile: int = _TILE, warps: int | None = None,
                 programs_per_sm: int = _PROGRAMS_PER_SM, finish_in_scan: bool = _FINISH_IN_SCAN) -> torch.Tensor:
    """The Triton path; the keyword arguments are tuning knobs (the benchmark sweeps them).

    finish_in_scan: with one program per row, select in the scan program itself (one launch) rather
    than in a separate finishing launch (which keeps the scan program smaller)."""
    rows, n_cols = scores.shape
    device = scores.device
    out = torch.empty((rows, k), dtype=torch.int32, device=device)
    if rows == 0:
        return out
    if n_cols == 0:
        return out.fill_(-1)
    k_pad = triton.next_power_of_2(k)
    cap = max(4 * k_pad, 256)
    group = _group_size(n_cols, k)
    tiles = triton.cdiv(n_cols, tile)
    splits = max(1, min(tiles, triton.cdiv(programs_per_sm * num_sms(device), rows)))
    tiles_per_split = triton.cdiv(tiles, splits)
    n_splits = triton.cdiv(tiles, tiles_per_split)
    gm_stride = triton.cdiv(triton.cdiv(n_cols, group), 16) * 16
    stride = scores.stride(0)
    vec = scores.data_ptr() % 16 == 0 and stride % 4 == 0
    lengths = lengths.to(device=device, dtype=torch.int32)
    ws = torch.zeros((rows, _WS_COLS), dtype=torch.int32, device=device)
    gm = torch.empty((rows, gm_stride), dtype=torch.int32, device=device)
    cand = torch.empty((rows, 2 * cap), dtype=torch.int32, device=device)
    args = (scores, stride, lengths, n_cols, gm, gm_stride, ws, cand, out, k, tiles_per_split, n_splits)
    if warps is None:
        warps = 8 if cap <= 2048 else 16
    finish = finish_in_scan or n_splits > 1
    meta = dict(G=group, TILE=tile, GM_BLOCK=_GM_BLOCK, GATHER=_GATHER, CAP=cap, K_PAD=k_pad, VEC=vec,
                EXACT_TILE=_EXACT_TILE, FINISH=finish, num_warps=warps)
    _scan_kernel[(rows, n_splits)](*args, **meta)
    if n_splits > 1:
        _collect_kernel[(rows, n_splits)](*args, **meta)
    elif not finish:
        _finish_kernel[(rows,)](scores, stride, lengths, n_cols, ws, cand, out, k, CAP=cap, K_PAD=k_pad, VEC=vec,
                                EXACT_TILE=_EXACT_TILE, num_warps=warps)
    return out


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int, impl: str = "auto") -> torch.Tensor:
    """int32 [rows, k]: the k largest of scores[row, :lengths[row]] in the canonical order, -1 padded.

    scores: fp32 [rows, cols], last dim contiguous; lengths: integer [rows] (clamped to [0, cols]);
    1 <= k <= 2048. impl: "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1), "torch", or "auto".
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D fp32 tensor, got {tuple(scores.shape)} {scores.dtype}")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError("scores must be contiguous along its last dim (any row stride is fine)")
    if lengths.shape != (scores.shape[0],):
        raise ValueError(f"lengths must have shape ({scores.shape[0]},), got {tuple(lengths.shape)}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if scores.shape[1] >= 2**31 - 1:
        raise ValueError("rows longer than 2^31 - 2 entries are not supported")
    if impl == "auto":
        impl = "triton" if scores.is_cuda else "torch"
    if impl == "torch":
        return topk_indices_reference(scores, lengths, k)
    if impl == "triton":
        return _topk_triton(scores, lengths, k)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
