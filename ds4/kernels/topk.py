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

How the Triton path stays exact and fast (five launches over the whole batch, no host sync):
  1. group maxima: every row is cut into groups of G entries; each group's maximum order key is
     written to a workspace and counted in a 256-bin histogram of its top byte (many CTAs per row).
  2. a second histogram, of the next byte, over the groups in the threshold bin. Together they give
     tau, a 16-bit-precise lower bound with at least min(k, groups) group maxima >= tau. Every group
     maximum >= tau is itself an entry >= tau, so at least k entries are >= tau and the top k are
     all among them.
  3. collection: only groups whose maximum reaches tau are read again; one pass counts the entries
     >= tau per CTA, a second writes them to a per-row buffer of CAP slots at offsets summed from
     the earlier CTAs' counts, so candidates sit in column order. G is chosen so a full-length row
     has >= 8k groups, which leaves about k + a few percent candidates on spread-out data.
  4. one CTA per row: when the candidates fit in CAP, an exact radix select over them in registers
     (and a second one over column numbers when the k-th value has more ties than places); when they
     do not (tie-dominated rows, for instance), the same CTA runs an exact radix select over the whole
     row instead (4 byte passes, then an in-order gather that takes the lowest-column ties). Either
     way the answer is exact: an overflowing buffer only changes which path runs, never the result.
No CTA ever waits on another; workspaces are sized from the shapes alone, so the call is safe to
capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import num_sms

MAX_K = 2048
_INT32_MIN = -(2**31)
_TILE = 4096  # entries per loop step in the streaming kernels
_BINS = 256
_WS_COUNT = 2 * _BINS  # workspace columns: hist1[256], hist2[256], candidate count
_GROUPS_PER_K = 8  # a row wants >= 8k groups so that tau lands close to the k-th value
_MAX_GROUP = 16
_SPLITS_PER_SM = 4  # programs per SM when a batch has few rows

INT_MIN = tl.constexpr(_INT32_MIN)
INT_MAX = tl.constexpr(2**31 - 1)


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
def _tau(ws_row, length, k, G: tl.constexpr):
    """The collection threshold of a row from its two group-maximum histograms."""
    bins = tl.arange(0, 256)
    groups = (length + G - 1) // G
    rank = tl.minimum(k, groups)
    b1, above1 = _threshold_bin(tl.load(ws_row + bins), rank)
    b2, _ = _threshold_bin(tl.load(ws_row + 256 + bins), rank - above1)
    tau = ((b1 << 24) | (b2 << 16)) ^ INT_MIN
    # With k or fewer groups every entry may be needed: only the minimum over all entries is safe.
    return tl.where(groups <= k, INT_MIN, tau)


@triton.jit(do_not_specialize=["stride_row", "n_cols", "stride_gm", "chunk"])
def _group_max_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, gm_ptr, stride_gm, ws_ptr, chunk,
                      G: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    start = tl.program_id(1) * chunk
    end = tl.minimum(start + chunk, length)
    row_scores = scores_ptr + row.to(tl.int64) * stride_row
    row_gm = gm_ptr + row.to(tl.int64) * stride_gm
    groups = tl.arange(0, TILE // G)
    hist = tl.zeros([256], dtype=tl.int32)
    for off in range(start, end, TILE):
        cols = off + groups[:, None] * G + tl.arange(0, G)[None, :]
        inside = cols < length
        key = tl.where(inside, _order_key(tl.load(row_scores + cols, mask=inside, other=0.0)), INT_MIN)
        gmax = tl.max(key, axis=1)
        group = off // G + groups
        real = group * G < length
        tl.store(row_gm + group, gmax, mask=real)
        hist += tl.histogram(_byte(gmax, 24), 256, mask=real)
    bins = tl.arange(0, 256)
    tl.atomic_add(ws_ptr + row * 513 + bins, hist, mask=hist > 0)


@triton.jit(do_not_specialize=["n_cols", "stride_gm", "chunk", "k"])
def _group_hist_kernel(lengths_ptr, n_cols, gm_ptr, stride_gm, ws_ptr, chunk, k,
                       G: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    ws_row = ws_ptr + row * 513
    b1, _ = _threshold_bin(tl.load(ws_row + tl.arange(0, 256)), tl.minimum(k, (length + G - 1) // G))
    start = tl.program_id(1) * chunk
    end = tl.minimum(start + chunk, length)
    row_gm = gm_ptr + row.to(tl.int64) * stride_gm
    groups = tl.arange(0, TILE // G)
    hist = tl.zeros([256], dtype=tl.int32)
    for off in range(start, end, TILE):
        group = off // G + groups
        real = group * G < length
        gmax = tl.load(row_gm + group, mask=real, other=INT_MIN)
        hist += tl.histogram(_byte(gmax, 16), 256, mask=real & (_byte(gmax, 24) == b1))
    bins = tl.arange(0, 256)
    tl.atomic_add(ws_row + 256 + bins, hist, mask=hist > 0)


@triton.jit
def _hot_tile(row_scores, row_gm, off, length, tau, G: tl.constexpr, TILE: tl.constexpr):
    """Keys and columns of one tile, and which entries are >= tau (groups below tau are not read)."""
    groups = tl.arange(0, TILE // G)
    group = off // G + groups
    hot = tl.load(row_gm + group, mask=group * G < length, other=INT_MIN) >= tau
    cols = off + groups[:, None] * G + tl.arange(0, G)[None, :]
    inside = hot[:, None] & (cols < length)
    key = _order_key(tl.load(row_scores + cols, mask=inside, other=0.0))
    take = inside & (key >= tau)
    return tl.reshape(key, [TILE]), tl.reshape(cols, [TILE]), tl.reshape(take, [TILE]).to(tl.int32), hot


@triton.jit(do_not_specialize=["stride_row", "n_cols", "stride_gm", "chunk", "k", "n_splits"])
def _count_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, gm_ptr, stride_gm, ws_ptr, counts_ptr, chunk, k,
                  n_splits, G: tl.constexpr, TILE: tl.constexpr):
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    tau = _tau(ws_ptr + row * 513, length, k, G)
    start = tl.program_id(1) * chunk
    end = tl.minimum(start + chunk, length)
    row_scores = scores_ptr + row.to(tl.int64) * stride_row
    row_gm = gm_ptr + row.to(tl.int64) * stride_gm
    found = 0
    for off in range(start, end, TILE):
        _, _, take, hot = _hot_tile(row_scores, row_gm, off, length, tau, G, TILE)
        found += tl.sum(take, axis=0)
    tl.store(counts_ptr + row * n_splits + tl.program_id(1), found)
    tl.atomic_add(ws_ptr + row * 513 + 512, found)


@triton.jit(do_not_specialize=["stride_row", "n_cols", "stride_gm", "chunk", "k", "n_splits"])
def _write_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, gm_ptr, stride_gm, ws_ptr, counts_ptr, cand_ptr, chunk,
                  k, n_splits, G: tl.constexpr, TILE: tl.constexpr, CAP: tl.constexpr, SPLITS: tl.constexpr):
    """Appends the entries >= tau to the row's candidates in column order (offsets from earlier splits' counts)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    if tl.load(ws_ptr + row * 513 + 512) <= CAP:
        length = _row_length(lengths_ptr, row, n_cols)
        tau = _tau(ws_ptr + row * 513, length, k, G)
        earlier = tl.arange(0, SPLITS)
        written = tl.sum(tl.load(counts_ptr + row * n_splits + earlier, mask=earlier < split, other=0), axis=0)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        row_scores = scores_ptr + row.to(tl.int64) * stride_row
        row_gm = gm_ptr + row.to(tl.int64) * stride_gm
        cand_keys = cand_ptr + row.to(tl.int64) * (2 * CAP)
        for off in range(start, end, TILE):
            key, cols, take, hot = _hot_tile(row_scores, row_gm, off, length, tau, G, TILE)
            if tl.max(hot.to(tl.int32), axis=0) > 0:
                slot = written + tl.cumsum(take, axis=0) - 1
                tl.store(cand_keys + slot, key, mask=take != 0)
                tl.store(cand_keys + CAP + slot, cols, mask=take != 0)
                written += tl.sum(take, axis=0)


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
def _select_candidates(keys, cols, live, rank, out_row, k, WIDTH: tl.constexpr):
    """Writes the top `rank` of the live candidates (held in column order) to out_row, then -1 up to k."""
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
    pad = tl.arange(0, WIDTH)
    tl.store(out_row + pad, tl.full([WIDTH], -1, tl.int32), mask=(pad >= rank) & (pad < k))


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


@triton.jit(do_not_specialize=["stride_row", "n_cols", "stride_out", "k"])
def _finish_kernel(scores_ptr, stride_row, lengths_ptr, n_cols, ws_ptr, cand_ptr, out_ptr, stride_out, k,
                   TILE: tl.constexpr, CAP: tl.constexpr, K_PAD: tl.constexpr):
    row = tl.program_id(0)
    length = _row_length(lengths_ptr, row, n_cols)
    rank = tl.minimum(k, length)
    found = tl.load(ws_ptr + row * 513 + 512)
    out_row = out_ptr + row.to(tl.int64) * stride_out
    if found <= CAP:
        slots = tl.arange(0, CAP)
        live = slots < found
        cand_keys = cand_ptr + row.to(tl.int64) * (2 * CAP)
        keys = tl.load(cand_keys + slots, mask=live, other=INT_MIN)
        cols = tl.load(cand_keys + CAP + slots, mask=live, other=0)
        _select_candidates(keys, cols, live, rank, out_row, k, CAP)
    else:
        row_scores = scores_ptr + row.to(tl.int64) * stride_row
        _exact_row(row_scores, length, rank, out_row, k, TILE, K_PAD)


# ----------------------------------------------------------------------------------------------
# entry point
# ----------------------------------------------------------------------------------------------


def _group_size(n_cols: int, k: int) -> int:
    """Largest power of two <= 16 that leaves a full-length row at least 8k groups."""
    g = 1
    while g < _MAX_GROUP and n_cols // (2 * g) >= _GROUPS_PER_K * k:
        g *= 2
    return g


def _topk_triton(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
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
    splits = max(1, min(triton.cdiv(n_cols, _TILE), triton.cdiv(_SPLITS_PER_SM * num_sms(device), rows)))
    chunk = triton.cdiv(triton.cdiv(n_cols, splits), _TILE) * _TILE
    n_splits = triton.cdiv(n_cols, chunk)
    grid = (rows, n_splits)
    n_groups = triton.cdiv(n_cols, group)
    lengths = lengths.to(device=device, dtype=torch.int32)
    ws = torch.zeros((rows, _WS_COUNT + 1), dtype=torch.int32, device=device)
    gm = torch.empty((rows, n_groups), dtype=torch.int32, device=device)
    cand = torch.empty((rows, 2 * cap), dtype=torch.int32, device=device)
    counts = torch.empty((rows, n_splits), dtype=torch.int32, device=device)
    stride = scores.stride(0)
    _group_max_kernel[grid](scores, stride, lengths, n_cols, gm, n_groups, ws, chunk,
                            G=group, TILE=_TILE, num_warps=8)
    _group_hist_kernel[grid](lengths, n_cols, gm, n_groups, ws, chunk, k, G=group, TILE=_TILE, num_warps=8)
    _count_kernel[grid](scores, stride, lengths, n_cols, gm, n_groups, ws, counts, chunk, k, n_splits,
                        G=group, TILE=_TILE, num_warps=8)
    _write_kernel[grid](scores, stride, lengths, n_cols, gm, n_groups, ws, counts, cand, chunk, k, n_splits,
                        G=group, TILE=_TILE, CAP=cap, SPLITS=triton.next_power_of_2(_SPLITS_PER_SM * num_sms(device)), num_warps=8)
    _finish_kernel[(rows,)](scores, stride, lengths, n_cols, ws, cand, out, k, k,
                            TILE=_TILE, CAP=cap, K_PAD=k_pad, num_warps=8)
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
