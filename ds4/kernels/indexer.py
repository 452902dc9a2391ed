"""Lightning-indexer logits over the paged fp8 indexer key cache, and the top-k that feeds on them.

    score[r, s] = sum_h w[r, h] * relu(q[r, h] . k[s]) * k_scale[s]     for s < key_end[r], else -inf

q is fp8 e4m3 [R, 64, 128] (an optional positive per-(row, head) scale folds into w, since
relu(c x) = c relu(x) for c > 0); w [R, 64] fp32 already carries the softmax scale; keys are fp8
e4m3 with one fp32 scale per entry (likewise applied after the relu).

Rows are grouped by request: request b owns rows [b * n, (b + 1) * n) with n = rows_per_request
(a prefill chunk is one request with n = its tokens and causal ends key_end = (t + 1) // 4; a decode
step has n = 1, or 1 + the MTP draft rows, each with its own key_end). Keys are read through the
request's block table, so neither prefill nor decode copies the cache. Two kernels: prefill puts a key
tile in the MMA's M dimension and loops over query rows (heads in N); decode holds a request's few rows
on chip (their heads side by side in N) and streams the request's keys past them. Where the device has no e4m3
(sm_80 to sm_88) both read q and the keys as bytes and decode them to fp16 (exactly; `_operand`) for the product.

Paged indexer key cache layout (`new_indexer_cache`): uint8 [num_pages, E * 132], E entries per page
(64 unless the cache is made with another count; the model uses page_size // ratio); a page holds the E
entries' 128-byte e4m3 vectors first (entry j at byte 128 j), then their E fp32 scales (at byte 128 E + 4 j):
132 bytes per entry. Keeping the vectors contiguous lets a key tile load as one [keys, 128] block of
16-byte vectors, and the scales as one contiguous read. Logical key s of a request lives in page
block_table[b, s // E], slot s % E.

`indexer_topk` returns the top-k key indices per row without materialising the [rows x keys] score
matrix of a long prefill chunk: it scores at most `max_scratch_bytes` worth of rows at a time into
one reused buffer and selects from each slice with ds4.kernels.topk.

Around the scoring, one launch each on the Triton path (torch's path is dozens of small kernels, which a
decode step pays in launches): `index_queries` turns the fp8 mode's queries after RoPE into what the logits
take (Hadamard rotation, MXFP4, per-head e4m3 with its scale folded into the head weights);
`write_indexer_keys` quantises keys into their pages; `entry_rows` maps the picked entries to pool rows
through the block tables. Each is exact against its torch reference: the same fp32 operations in the same
order, roundings and power-of-two scales taken from the bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, has_fp8, interpreting, launches_dependents_early
from ds4.kernels.fp4_act import FP4_BLOCK, ceil_log2, pow2, rotate_fp4, rotate_fp4_reference, round_to
from ds4.kernels.fp8_kv import e4m3_bytes, pow2_ceil
from ds4.kernels.rope import apply_rope, apply_rope_reference, turn_row_pairs
from ds4.kernels.topk import topk_indices

PAGE = 64  # entries per page unless the cache is made with another count
HEAD_DIM = 128
ENTRY_BYTES = HEAD_DIM + 4
FP8_MAX = 448.0

# ----------------------------------------------------------------------------------------------
# cache layout helpers (torch)
# ----------------------------------------------------------------------------------------------


def new_indexer_cache(
    num_pages: int,
    device: torch.device | str = "cpu",
    entries_per_page: int = PAGE,
) -> torch.Tensor:
    """An empty paged indexer key cache: uint8 [num_pages, entries_per_page * ENTRY_BYTES]."""
    return torch.zeros((num_pages, entries_per_page * ENTRY_BYTES), dtype=torch.uint8, device=device)


def page_entries(cache: torch.Tensor) -> int:
    """Entries a page of the cache holds (its row of bytes over ENTRY_BYTES); rejects what is not a cache."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] % ENTRY_BYTES or not cache.is_contiguous():
        raise ValueError(
            f"indexer cache must be contiguous uint8 [pages, entries * {ENTRY_BYTES}], got "
            f"{cache.dtype} {tuple(cache.shape)}"
        )
    return cache.shape[1] // ENTRY_BYTES


def cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 vectors [pages, E, 128], fp32 scales [pages, E]) viewing the cache's bytes, E entries a page."""
    per_page = page_entries(cache)
    vectors = cache[:, : per_page * HEAD_DIM].view(torch.float8_e4m3fn).view(-1, per_page, HEAD_DIM)
    scales = cache[:, per_page * HEAD_DIM :].view(torch.float32)
    return vectors, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector e4m3 quantisation over the last dim: (fp8 values, fp32 scales with x ~ values * scale).

    The scales are powers of two, so a vector that is already coarser than e4m3 (the fp8 KV mode's
    MXFP4-rounded indexer keys and queries, whose block scales are powers of two too) comes back exactly.
    """
    xf = x.float()
    amax = xf.abs().amax(-1).clamp_min(2.0**-120)
    scale = pow2_ceil(amax / FP8_MAX)
    values = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale


def write_indexer_keys_reference(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """Quantises keys [N, 128] and stores them at flat slots [N] (slot = page * E + offset, E entries a page)."""
    vectors, scales = cache_views(cache)
    values, scale = quantize_rows(keys)
    per_page = vectors.shape[1]
    page, offset = slots.to(torch.int64) // per_page, slots.to(torch.int64) % per_page
    vectors[page, offset] = values
    scales[page, offset] = scale


# ----------------------------------------------------------------------------------------------
# torch reference (the spec, and the CPU path)
# ----------------------------------------------------------------------------------------------


def _fold_scale(weights: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    w = weights.float()
    return w if q_scale is None else w * q_scale.float().expand_as(w)


def indexer_logits_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    key_end: torch.Tensor,
    rows_per_request: int,
    max_keys: int,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [R, max_keys]: the logits computed plainly from dequantised q and gathered keys."""
    vectors, scales = cache_views(cache)
    rows = q.shape[0]
    w = _fold_scale(weights, q_scale)
    out = torch.full((rows, max_keys), float("-inf"), dtype=torch.float32, device=q.device)
    positions = torch.arange(max_keys, device=q.device)
    for b in range(rows // rows_per_request):
        pages = block_table[b, : triton.cdiv(max_keys, vectors.shape[1])].long().clamp(0, vectors.shape[0] - 1)
        k = vectors[pages].float().reshape(-1, HEAD_DIM)[:max_keys]
        k_scale = scales[pages].reshape(-1)[:max_keys]
        r = slice(b * rows_per_request, (b + 1) * rows_per_request)
        dots = torch.einsum("rhd,sd->rhs", q[r].float(), k).relu()
        logits = torch.einsum("rh,rhs->rs", w[r], dots) * k_scale
        visible = positions[None, :] < key_end[r].long()[:, None]
        out[r] = torch.where(visible, logits, out[r])
    return out


def index_queries_reference(
    q: torch.Tensor, weights: torch.Tensor, weight_scale: float, rope: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 mode's indexer queries as the logits kernels take them: q [T, H, 128] (after RoPE, or turned here
    when `rope` gives (positions [T], inv_freq)) rotated, MXFP4-rounded and quantised per head (e4m3 [T, H, 128]);
    the head weights [T, H] (rounded to q's dtype, as weights_proj's output is) times weight_scale and the heads'
    scales (fp32), which indexer_logits applies after the relu."""
    if rope is not None:
        q = apply_rope_reference(q, *rope)
    values, scale = quantize_rows(rotate_fp4_reference(q))
    return values, weights.to(q.dtype).float() * weight_scale * scale


def entry_rows_reference(
    picked: torch.Tensor, key_end: torch.Tensor, block_tables: torch.Tensor, token_requests: torch.Tensor, per_page: int
) -> torch.Tensor:
    """int64 [T, k]: the pool rows (page * per_page + offset) of the entries picked [T, k] of each token, read
    through its request's block table row; -1 for a -1 pick, one at or past the token's key_end [T], or one
    outside the table or on an unassigned (-1) page."""
    tables = block_tables[token_requests].long()
    width = tables.shape[1]
    entries = picked.long()
    column = entries.clamp_min(0) // per_page
    pages = torch.gather(tables, 1, column.clamp(max=max(width - 1, 0))) if width else torch.full_like(entries, -1)
    kept = (entries >= 0) & (entries < key_end.long()[:, None]) & (column < width) & (pages >= 0)
    return torch.where(kept, pages * per_page + entries % per_page, -1)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


# Where the device has no e4m3 (sm_80 to sm_88) the operands are their bytes, decoded as fp16 at 2^-8 of their
# values (`_operand`); a product of two then carries 2^-16, which the scores undo.
_BITS_UNDO = tl.constexpr(65536.0)


@triton.jit
def _operand(x, FP8_CVT: tl.constexpr, DOT_F32: tl.constexpr):
    """e4m3 values as a product's operand: as they are (fp8); from their bytes where the device has no e4m3
    (FP8_CVT False): the magnitude's seven bits at fp16's bits 7-13 and the sign at 15 read as 2^-8 times the
    value, subnormals too (exact, as fp16 holds every e4m3 value); fp32 under the interpreter (DOT_F32)."""
    if not FP8_CVT:
        bits = x.to(tl.int32)
        x = (((bits & 0x7F) << 7) | ((bits & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
    if DOT_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _key_tile(
    vec_ptr,
    scale_ptr,
    table_row,
    keys,
    key_in,
    key_live,
    PAGE_: tl.constexpr,
    D: tl.constexpr,
    FP8_CVT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """The e4m3 vectors [keys, D] (as `_operand`) and fp32 scales of `keys`, read through the request's block
    table row (pages of PAGE_ entries: vectors first, then scales); keys not live read as zero."""
    page = tl.load(table_row + keys // PAGE_, mask=key_in, other=0).to(tl.int64)
    slot = keys % PAGE_
    k = tl.load(
        vec_ptr + (page * (PAGE_ * (D + 4)) + slot * D)[:, None] + tl.arange(0, D)[None, :],
        mask=key_live[:, None],
        other=0.0,
    )
    k_scale = tl.load(scale_ptr + page * (PAGE_ * (D + 4) // 4) + PAGE_ * D // 4 + slot, mask=key_live, other=0.0)
    if not FP8_CVT:
        k_scale *= _BITS_UNDO
    return _operand(k, FP8_CVT, DOT_F32), k_scale


@triton.jit(
    do_not_specialize=[
        "q_row16",
        "q_head16",
        "w_row4",
        "stride_bt",
        "rows_per_request",
        "query_blocks",
        "key_tiles",
        "n_heads",
        "max_keys",
        "stride_out",
    ]
)
def _indexer_logits_kernel(
    q_ptr,
    q_row16,
    q_head16,
    w_ptr,
    w_row4,
    vec_ptr,
    scale_ptr,
    bt_ptr,
    stride_bt,
    key_end_ptr,
    rows_per_request,
    query_blocks,
    key_tiles,
    n_heads,
    max_keys,
    out_ptr,
    stride_out,
    H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PAGE_: tl.constexpr,
    D: tl.constexpr,
    FP8_CVT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # One program: BLOCK_S keys of one request (the MMA's M) against up to BLOCK_Q of its query rows, one row
    # at a time with the row's heads as the MMA's N. The key tile is read once and reused for every row, and
    # the head sum of a row stays inside each thread's accumulator slice (plus a few lane shuffles).
    # Key tiles vary fastest, so the programs running together share one block of q rows (hot in L2).
    # q and w strides come in 16-byte units so that their loads are 16 bytes wide (and pipelined).
    tile = tl.program_id(0) % key_tiles
    block = tl.program_id(0) // key_tiles
    request = block // query_blocks
    first = (block % query_blocks) * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, rows_per_request)
    row0 = request.to(tl.int64) * rows_per_request
    key_start = tile * BLOCK_S
    keys = key_start + tl.arange(0, BLOCK_S)
    key_in = keys < max_keys
    out_row = out_ptr + row0 * stride_out + keys

    # Rows that see a key of this tile lie in [lo, hi) (a suffix of the block for causal ends); the others
    # are all -inf here and get no dot product.
    local = first + tl.arange(0, BLOCK_Q)
    ends = tl.load(key_end_ptr + row0 + local, mask=local < last, other=0)
    sees = (local < last) & (ends > key_start)
    lo = tl.min(tl.where(sees, local, last), axis=0)
    hi = tl.maximum(tl.max(tl.where(sees, local + 1, 0), axis=0), lo)
    for i in range(first, lo):
        tl.store(out_row + i * stride_out, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=key_in)
    for i in range(hi, last):
        tl.store(out_row + i * stride_out, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=key_in)

    # the table covers max_keys, so its read need not wait for the rows' ends
    key_live = key_in & (keys < tl.max(ends, axis=0))
    k, k_scale = _key_tile(
        vec_ptr, scale_ptr, bt_ptr + request.to(tl.int64) * stride_bt, keys, key_in, key_live, PAGE_, D, FP8_CVT,
        DOT_F32,
    )  # fmt: skip
    dims = tl.arange(0, D)
    heads = tl.arange(0, H)
    head_live = heads < n_heads
    for i in range(lo, hi):
        row = row0 + i
        q = tl.load(
            q_ptr + row * q_row16 * 16 + (heads * q_head16 * 16)[:, None] + dims[None, :],
            mask=head_live[:, None],
            other=0.0,
        )
        w = tl.load(w_ptr + row * w_row4 * 4 + heads, mask=head_live, other=0.0)
        end = tl.load(key_end_ptr + row)
        dots = tl.dot(k, tl.trans(_operand(q, FP8_CVT, DOT_F32)))  # [BLOCK_S, H]: exact products, fp32 sums
        logits = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * k_scale
        tl.store(out_row + i * stride_out, tl.where(keys < end, logits, float("-inf")), mask=key_in)


@triton.jit(
    do_not_specialize=[
        "q_row16",
        "q_head16",
        "w_row4",
        "stride_bt",
        "rows_per_request",
        "tiles_per_program",
        "chunks",
        "n_heads",
        "max_keys",
        "stride_out",
    ]
)
def _indexer_decode_kernel(
    q_ptr,
    q_row16,
    q_head16,
    w_ptr,
    w_row4,
    vec_ptr,
    scale_ptr,
    bt_ptr,
    stride_bt,
    key_end_ptr,
    rows_per_request,
    tiles_per_program,
    chunks,
    n_heads,
    max_keys,
    out_ptr,
    stride_out,
    H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PAGE_: tl.constexpr,
    D: tl.constexpr,
    FP8_CVT: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program: all rows of one request (1, or 1 + MTP drafts; their heads side by side are the MMA's
    # N = BLOCK_Q * H) held on chip while `tiles_per_program` key tiles stream past them in a pipelined loop.
    # A decode step has few rows and many keys, so reading the keys is the whole cost. PDL: launched early.
    dependent_launch_start(PDL)
    request = tl.program_id(0) // chunks
    chunk = tl.program_id(0) % chunks
    row0 = request.to(tl.int64) * rows_per_request
    r = tl.arange(0, BLOCK_Q)
    ends = tl.load(key_end_ptr + row0 + r, mask=r < rows_per_request, other=0)
    end_max = tl.minimum(tl.max(ends, axis=0), max_keys)
    cols = tl.arange(0, BLOCK_Q * H)
    head = cols % H
    which = cols // H
    live = (head < n_heads) & (which < rows_per_request)
    dims = tl.arange(0, D)
    q = tl.load(
        q_ptr + ((row0 + which) * q_row16 * 16 + head * q_head16 * 16)[:, None] + dims[None, :],
        mask=live[:, None],
        other=0.0,
    )
    w = tl.load(w_ptr + (row0 + which) * w_row4 * 4 + head, mask=live, other=0.0)
    qt = tl.trans(_operand(q, FP8_CVT, DOT_F32))
    first = chunk * tiles_per_program
    stop = tl.minimum(first + tiles_per_program, tl.cdiv(max_keys, BLOCK_S))
    busy = tl.maximum(tl.minimum(stop, tl.cdiv(end_max, BLOCK_S)), first)  # tiles past every row's end: -inf
    out_rows = out_ptr + (row0 + r)[None, :] * stride_out
    row_in = r[None, :] < rows_per_request
    for t in range(first, busy):
        keys = t * BLOCK_S + tl.arange(0, BLOCK_S)
        k, k_scale = _key_tile(
            vec_ptr,
            scale_ptr,
            bt_ptr + request.to(tl.int64) * stride_bt,
            keys,
            keys < max_keys,
            keys < end_max,
            PAGE_,
            D,
            FP8_CVT,
            DOT_F32,
        )
        dots = tl.dot(k, qt)  # [BLOCK_S, BLOCK_Q * H]
        sums = tl.sum(tl.reshape(tl.maximum(dots, 0.0) * w[None, :], [BLOCK_S, BLOCK_Q, H]), axis=2)
        logits = tl.where(keys[:, None] < ends[None, :], sums * k_scale[:, None], float("-inf"))
        tl.store(out_rows + keys[:, None], logits, mask=(keys[:, None] < max_keys) & row_in)
    for t in range(busy, stop):
        keys = t * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(
            out_rows + keys[:, None],
            tl.full([BLOCK_S, BLOCK_Q], float("-inf"), tl.float32),
            mask=(keys[:, None] < max_keys) & row_in,
        )


@triton.jit
def quantize_e4m3(x):
    """quantize_rows of the rows of an fp32 [ROWS, D] tile: (e4m3 bytes int32 [ROWS, D], fp32 scales [ROWS])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 7.52316384526264e-37)  # 2^-120
    e = ceil_log2(tl.math.div_rn(amax, 448.0))
    # x / 2^e as a product by 2^-e, the same single rounding (IEEE division compiles to a Newton sequence and a
    # slow-path call an element); 2^-e is past fp32's range for e < -126 (e >= -128 here), so there x takes
    # 2^64 first, exactly.
    low = e < -126
    v = x * pow2(tl.where(low, 64, -e))[:, None] * pow2(tl.where(low, -e - 64, 0))[:, None]
    return e4m3_bytes(tl.minimum(tl.maximum(v, -448.0), 448.0)), pow2(e)


@triton.jit(do_not_specialize=["rows", "heads", "q_token4", "q_head4", "w_stride", "values_row4"])
def _index_queries_kernel(
    q_ptr,
    q_token4,
    q_head4,
    pos_ptr,
    freq_ptr,
    w_ptr,
    w_stride,
    weight_scale,
    values_ptr,
    values_row4,
    scaled_w_ptr,
    rows,
    heads,
    D: tl.constexpr,
    LOG_D: tl.constexpr,
    BLOCK: tl.constexpr,
    ROPE: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_launch_start(PDL)  # PDL: launched early
    # ROWS (token, head) rows of D channels a program. Strides come in 4-element units: rows then load and
    # store 4 elements at a time, the layout of the rotation's gathers (16-byte accesses would move the tile
    # through shared memory to that layout and back). ROPE: the rows' last HALF channel pairs are turned at their
    # token's position first (apply_rope, rounded to q's dtype).
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ok = r < rows
    d = tl.arange(0, D)[None, :]
    at = q_ptr + ((r // heads) * q_token4 * 4 + (r % heads) * q_head4 * 4)[:, None] + d
    x = tl.load(at, mask=ok[:, None], other=0.0).to(tl.float32)
    if ROPE:
        even, odd = tl.split(tl.reshape(x, (ROWS, D // 2, 2)))
        position = tl.load(pos_ptr + r // heads, mask=ok, other=0)
        even, odd = turn_row_pairs(even, odd, tl.arange(0, D // 2), position, freq_ptr, D, 1.0, HALF, ROWS, D // 2)
        x = round_to(tl.reshape(tl.join(even, odd), (ROWS, D)), q_ptr.dtype.element_ty)
    values, scale = quantize_e4m3(rotate_fp4(x, ROWS, D, LOG_D, BLOCK, q_ptr.dtype.element_ty))
    tl.store(values_ptr + r[:, None] * (values_row4 * 4) + d, values.to(tl.uint8), mask=ok[:, None])
    w = round_to(
        tl.load(w_ptr + (r // heads) * w_stride + r % heads, mask=ok, other=0.0).to(tl.float32), q_ptr.dtype.element_ty
    )
    tl.store(scaled_w_ptr + r, w * weight_scale * scale, mask=ok)


@triton.jit(do_not_specialize=["n", "keys_row4", "per_page"])
def _write_keys_kernel(
    keys_ptr, keys_row4, slots_ptr, bytes_ptr, words_ptr, n, per_page, D: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    dependent_launch_start(PDL)  # PDL: launched early
    # ROWS keys a program: quantised, then their vectors and scales stored where their slots' pages keep them.
    # The keys' row stride comes in 4-element units: 4 elements a load, the layout of the 4-byte vector stores.
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ok = r < n
    d = tl.arange(0, D)[None, :]
    x = tl.load(keys_ptr + r[:, None] * (keys_row4 * 4) + d, mask=ok[:, None], other=0.0).to(tl.float32)
    values, scale = quantize_e4m3(x)
    slot = tl.load(slots_ptr + r, mask=ok, other=0).to(tl.int64)
    page, offset = slot // per_page, slot % per_page
    tl.store(bytes_ptr + (page * per_page * (D + 4) + offset * D)[:, None] + d, values.to(tl.uint8), mask=ok[:, None])
    tl.store(words_ptr + page * per_page * (D + 4) // 4 + per_page * D // 4 + offset, scale, mask=ok)


@triton.jit(do_not_specialize=["k", "picked_stride", "table_stride", "width", "per_page"])
def _entry_rows_kernel(
    picked_ptr,
    picked_stride,
    end_ptr,
    table_ptr,
    table_stride,
    requests_ptr,
    out_ptr,
    k,
    width,
    per_page,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    # One token's picks (BLOCK_K of them) a program. PDL: launched early.
    dependent_launch_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = c < k
    entry = tl.load(picked_ptr + t * picked_stride + c, mask=inside, other=-1).to(tl.int64)
    column = tl.maximum(entry, 0) // per_page
    listed = inside & (entry >= 0) & (column < width)
    table_row = table_ptr + tl.load(requests_ptr + t).to(tl.int64) * table_stride
    page = tl.load(table_row + column, mask=listed, other=-1).to(tl.int64)
    kept = listed & (entry < tl.load(end_ptr + t)) & (page >= 0)
    tl.store(out_ptr + t * k + c, tl.where(kept, page * per_page + entry % per_page, -1), mask=inside)


# Launch shapes (measured on the H200, see BENCHMARKS.md). Prefill: keys per program, query rows per
# program, warps, pipeline stages. Decode (a request's rows held on chip while its keys stream past): keys
# per tile, tiles per program, warps, stages; it takes requests whose rows' heads fit one MMA N of 256.
_PREFILL_TILE = (256, 64, 4, 3)
_DECODE_TILE = (128, 16, 4, 3)
_DECODE_MAX_N = 256
# fp32 scores a thread may hold of a tile's [keys, heads] product (more warps where a tile has more); half that where
# the operands are decoded from bytes (no e4m3: both wait in registers as fp16). Offline (ptxas), the decode tile of
# a request of 4 rows (N = 256) over 4 warps spilled 248 bytes a thread on sm_90, 720 on sm_120, 1328 on sm_80 from
# bytes; over 8, none (16 on sm_80). The prefill tile from bytes (sm_80): 88 bytes over 4 warps, none over 8.
_SCORE_REGISTERS = 128
# The query, key-write and picked-rows kernels: elements of a program's tile, picks a program. A query or key
# program's code is straight-line, its time about its elements a thread (~115 instructions each in the query
# kernel on sm_90): 512 is 4 a thread of the 4 warps, one 8-byte load of bf16 in the layout of the rotation's
# gathers and the byte stores (4096 took a batch-1 step's 64 query rows in 2 programs of 3800 instructions).
_ROW_TILE = 512
_PICKS_BLOCK = 1024


def _padded_heads(n_heads: int) -> int:
    return max(16, triton.next_power_of_2(n_heads))


def _streams(rows_per_request: int, n_heads: int) -> bool:
    """Whether a request of this many rows takes the decode kernel."""
    return triton.next_power_of_2(rows_per_request) * _padded_heads(n_heads) <= _DECODE_MAX_N


def _check_inputs(q, weights, cache, block_table, key_end, rows_per_request, max_keys):
    rows = q.shape[0]
    if q.dtype != torch.float8_e4m3fn or q.dim() != 3 or q.shape[2] != HEAD_DIM or q.stride(2) != 1:
        raise ValueError(
            f"q must be e4m3 [rows, heads, {HEAD_DIM}] with a contiguous last dim, got {q.dtype} {tuple(q.shape)}"
        )
    if weights.shape != q.shape[:2] or weights.dtype != torch.float32 or weights.stride(1) != 1:
        raise ValueError(f"weights must be fp32 {tuple(q.shape[:2])} with a contiguous last dim")
    if rows_per_request < 1 or rows % rows_per_request:
        raise ValueError(f"{rows} rows do not split into requests of {rows_per_request}")
    if block_table.dim() != 2 or block_table.shape[0] < rows // rows_per_request or block_table.stride(1) != 1:
        raise ValueError("block_table must be int32 [requests, pages] with a contiguous last dim")
    if block_table.shape[1] * page_entries(cache) < max_keys:
        raise ValueError(
            f"block_table covers {block_table.shape[1] * page_entries(cache)} keys, fewer than max_keys={max_keys}"
        )
    if key_end.shape != (rows,):
        raise ValueError(f"key_end must have shape ({rows},)")


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    key_end: torch.Tensor,
    rows_per_request: int,
    max_keys: int,
    q_scale: torch.Tensor | None = None,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 [R, max_keys] logits (-inf past each row's key_end); see the module docstring for the layout.

    q: e4m3 [R, H, 128]; weights: fp32 [R, H]; q_scale: optional positive fp32 [R, H] (or broadcastable);
    cache: paged indexer cache; block_table: int32 [R / rows_per_request, pages]; key_end: int [R].
    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch", or "auto".
    """
    _check_inputs(q, weights, cache, block_table, key_end, rows_per_request, max_keys)
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "torch":
        return indexer_logits_reference(q, weights, cache, block_table, key_end, rows_per_request, max_keys, q_scale)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    rows = q.shape[0]
    if out is None:
        out = torch.empty((rows, max_keys), dtype=torch.float32, device=q.device)
    if rows == 0 or max_keys == 0:
        return out
    w = _fold_scale(weights, q_scale).contiguous()
    if _streams(rows_per_request, q.shape[1]):
        _launch_decode(q, w, cache, block_table, key_end, rows_per_request, max_keys, out, _DECODE_TILE)
    else:
        _launch(q, w, cache, block_table, key_end, rows_per_request, max_keys, out, _PREFILL_TILE)
    return out


def _wide_operands(q, w):
    """q (as the kernels read it, `_operand_dtype`) and w with strides in whole 16-byte units, which the kernels take
    (so their loads are 16 bytes wide)."""
    if q.stride(0) % 16 or q.stride(1) % 16:
        q = q.contiguous()
    if w.stride(0) % 4:
        w = torch.nn.functional.pad(w, (0, -q.shape[1] % 4))
    return q.view(_operand_dtype(q.device)), w


def _warps(warps: int, keys: int, n: int, device: torch.device) -> int:
    """The tile's warps, more (up to 8) where its [keys, n] fp32 product would take more than _SCORE_REGISTERS a
    thread (half that where the operands come from bytes)."""
    budget = _SCORE_REGISTERS if has_fp8(device) else _SCORE_REGISTERS // 2
    return min(8, max(warps, keys * n // (32 * budget)))


def _operand_dtype(device: torch.device) -> torch.dtype:
    """How the kernels read e4m3 operands: as e4m3, or as bytes where the device has no e4m3 (`_operand`)."""
    return torch.float8_e4m3fn if has_fp8(device) else torch.uint8


def _launch(q, w, cache, block_table, key_end, rows_per_request, max_keys, out, tile):
    """Runs the prefill kernel with tile = (keys, query rows, warps, stages) a program; returns the compiled kernel."""
    rows, n_heads, _ = q.shape
    q, w = _wide_operands(q, w)
    block_s, block_q, warps, stages = tile
    warps = _warps(warps, block_s, _padded_heads(n_heads), q.device)
    block_q = min(block_q, triton.next_power_of_2(rows_per_request))
    query_blocks = triton.cdiv(rows_per_request, block_q)
    key_tiles = triton.cdiv(max_keys, block_s)
    table = block_table.to(torch.int32)
    grid = (rows // rows_per_request * query_blocks * key_tiles,)
    return _indexer_logits_kernel[grid](
        q,
        q.stride(0) // 16,
        q.stride(1) // 16,
        w,
        w.stride(0) // 4,
        cache.view(_operand_dtype(q.device)),
        cache.view(torch.float32),
        table,
        table.stride(0),
        key_end.to(torch.int32),
        rows_per_request,
        query_blocks,
        key_tiles,
        n_heads,
        max_keys,
        out,
        out.stride(0),
        H=_padded_heads(n_heads),
        BLOCK_Q=block_q,
        BLOCK_S=block_s,
        PAGE_=page_entries(cache),
        D=HEAD_DIM,
        FP8_CVT=has_fp8(q.device),
        DOT_F32=interpreting(),
        num_warps=warps,
        num_stages=stages,
    )


def _launch_decode(q, w, cache, block_table, key_end, rows_per_request, max_keys, out, tile):
    """Runs the decode kernel with tile = (keys per tile, tiles per program, warps, stages)."""
    rows, n_heads, _ = q.shape
    q, w = _wide_operands(q, w)
    block_s, per_program, warps, stages = tile
    warps = _warps(warps, block_s, triton.next_power_of_2(rows_per_request) * _padded_heads(n_heads), q.device)
    chunks = triton.cdiv(triton.cdiv(max_keys, block_s), per_program)
    table = block_table.to(torch.int32)
    pdl = launches_dependents_early(q.device)
    return _indexer_decode_kernel[(rows // rows_per_request * chunks,)](
        q,
        q.stride(0) // 16,
        q.stride(1) // 16,
        w,
        w.stride(0) // 4,
        cache.view(_operand_dtype(q.device)),
        cache.view(torch.float32),
        table,
        table.stride(0),
        key_end.to(torch.int32),
        rows_per_request,
        per_program,
        chunks,
        n_heads,
        max_keys,
        out,
        out.stride(0),
        H=_padded_heads(n_heads),
        BLOCK_Q=triton.next_power_of_2(rows_per_request),
        BLOCK_S=block_s,
        PAGE_=page_entries(cache),
        D=HEAD_DIM,
        FP8_CVT=has_fp8(q.device),
        DOT_F32=interpreting(),
        PDL=pdl,
        num_warps=warps,
        num_stages=stages,
        launch_pdl=pdl,
    )


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    key_end: torch.Tensor,
    rows_per_request: int,
    max_keys: int,
    k: int,
    q_scale: torch.Tensor | None = None,
    impl: str = "auto",
    max_scratch_bytes: int = 1 << 30,
) -> torch.Tensor:
    """int32 [R, k]: top-k key indices per row (ds4.kernels.topk order, -1 padded) with bounded scratch.

    Rows are scored in slices of whole requests (or of rows, for a single request) so that the
    fp32 score scratch never exceeds max_scratch_bytes.
    """
    _check_inputs(q, weights, cache, block_table, key_end, rows_per_request, max_keys)
    rows = q.shape[0]
    if rows == 0:
        return torch.empty((0, k), dtype=torch.int32, device=q.device)
    slice_rows = max(1, max_scratch_bytes // (4 * max(max_keys, 1)))
    requests = rows // rows_per_request
    if requests > 1:
        per_slice = max(1, slice_rows // rows_per_request)
        slice_rows = per_slice * rows_per_request
    else:
        slice_rows = min(slice_rows, rows)
    scratch = torch.empty((min(slice_rows, rows), max_keys), dtype=torch.float32, device=q.device)
    scale = None if q_scale is None else q_scale.float().expand(q.shape[:2])
    picks = []
    for start in range(0, rows, slice_rows):
        stop = min(start + slice_rows, rows)
        if requests > 1:
            table = block_table[start // rows_per_request : stop // rows_per_request]
            per_request = rows_per_request
        else:
            table = block_table
            per_request = stop - start
        logits = indexer_logits(
            q[start:stop],
            weights[start:stop],
            cache,
            table,
            key_end[start:stop],
            per_request,
            max_keys,
            None if scale is None else scale[start:stop],
            impl=impl,
            out=scratch[: stop - start],
        )
        picks.append(topk_indices(logits, key_end[start:stop], k, impl=impl))
    return picks[0] if len(picks) == 1 else torch.cat(picks)


# ----------------------------------------------------------------------------------------------
# the queries and keys on their way in, the picked entries on their way out
# ----------------------------------------------------------------------------------------------


def _choose(impl: str, x: torch.Tensor) -> str:
    if impl == "auto":
        return "triton" if x.is_cuda else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return impl


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x's rows with a contiguous last dim and a row stride of whole 4-element units, which the kernels take
    (rows then load 4 elements at a time, in the layout their byte stores use: no conversion between)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 and rows.stride(0) % 4 == 0 else rows.contiguous()


def _tiles_rope(half: int) -> bool:
    """Whether the query kernel turns RoPE's `half` pairs itself (see turn_row_pairs): a power of two whose rotated
    pairs start at a multiple of it."""
    return half & (half - 1) == 0 and (HEAD_DIM // 2 - half) % half == 0


def index_queries(
    q: torch.Tensor,
    weights: torch.Tensor,
    weight_scale: float,
    impl: str = "auto",
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """index_queries_reference (q [T, H, 128], weights [T, H]) in one launch on the Triton path; q's heads are read
    where they lie (a row slice of a stacked projection too). rope: (positions [T], inv_freq): q is turned first."""
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or weights.shape != q.shape[:2] or weights.stride(1) != 1:
        raise ValueError(
            f"index_queries: q must be [tokens, heads, {HEAD_DIM}] and weights [tokens, heads], got "
            f"{tuple(q.shape)} and {tuple(weights.shape)}"
        )
    if _choose(impl, q) == "torch":
        return index_queries_reference(q, weights, weight_scale, rope)
    if q.stride(2) != 1 or q.stride(0) % 4 or q.stride(1) % 4:
        q = q.contiguous()
    values = torch.empty(q.shape, dtype=torch.uint8, device=q.device)
    scaled = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    rows = q.shape[0] * q.shape[1]
    if rope is not None and not _tiles_rope(rope[1].numel()):  # angles the kernel cannot tile: RoPE first
        q, rope = apply_rope(q, *rope), None
    if rope is None:
        positions, inv_freq, half = weights, weights, 1  # placeholders, never read
    else:
        positions, inv_freq = rope
        half = inv_freq.numel()
        inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    if rows:
        per_program = _ROW_TILE // HEAD_DIM
        pdl = launches_dependents_early(q.device)
        _index_queries_kernel[(triton.cdiv(rows, per_program),)](
            q,
            q.stride(0) // 4,
            q.stride(1) // 4,
            positions,
            inv_freq,
            weights,
            weights.stride(0),
            weight_scale,
            values,
            HEAD_DIM // 4,
            scaled,
            rows,
            q.shape[1],
            D=HEAD_DIM,
            LOG_D=HEAD_DIM.bit_length() - 1,
            BLOCK=FP4_BLOCK,
            ROPE=rope is not None,
            HALF=half,
            ROWS=per_program,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return values.view(torch.float8_e4m3fn), scaled


def write_indexer_keys(cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, impl: str = "auto") -> None:
    """write_indexer_keys_reference (keys [N, 128] to flat slots [N]) in one launch on the Triton path."""
    per_page = page_entries(cache)
    if keys.dim() != 2 or keys.shape[1] != HEAD_DIM or slots.shape != keys.shape[:1]:
        raise ValueError(f"keys must be [N, {HEAD_DIM}] with slots [N], got {tuple(keys.shape)}, {tuple(slots.shape)}")
    if _choose(impl, keys) == "torch":
        return write_indexer_keys_reference(cache, slots, keys)
    rows = _rows_of(keys)
    if rows.shape[0]:
        per_program = _ROW_TILE // HEAD_DIM
        pdl = launches_dependents_early(keys.device)
        _write_keys_kernel[(triton.cdiv(rows.shape[0], per_program),)](
            rows,
            rows.stride(0) // 4,
            slots,
            cache,
            cache.view(torch.float32),
            rows.shape[0],
            per_page,
            D=HEAD_DIM,
            ROWS=per_program,
            PDL=pdl,
            launch_pdl=pdl,
        )


def entry_rows(
    picked: torch.Tensor,
    key_end: torch.Tensor,
    block_tables: torch.Tensor,
    token_requests: torch.Tensor,
    per_page: int,
    impl: str = "auto",
) -> torch.Tensor:
    """entry_rows_reference (picked [T, k], key_end [T], block_tables [R, pages], token_requests [T]) in one
    launch on the Triton path."""
    if _choose(impl, picked) == "torch":
        return entry_rows_reference(picked, key_end, block_tables, token_requests, per_page)
    tokens, k = picked.shape
    out = torch.empty((tokens, k), dtype=torch.long, device=picked.device)
    if tokens and k:
        if picked.stride(1) != 1 or block_tables.stride(1) != 1:
            raise ValueError("entry_rows: picked and block_tables need a contiguous last dim")
        block = min(_PICKS_BLOCK, triton.next_power_of_2(k))
        pdl = launches_dependents_early(picked.device)
        _entry_rows_kernel[(tokens, triton.cdiv(k, block))](
            picked,
            picked.stride(0),
            key_end,
            block_tables,
            block_tables.stride(0),
            token_requests,
            out,
            k,
            block_tables.shape[1],
            per_page,
            BLOCK_K=block,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return out
