"""Multi-query attention of each token over its own gathered key set, with a per-head sink.

    out[t, h] = sum_k softmax_k(q[t, h] . key_k * scale  |  sink[h]) key_k

over the keys of token t: one shared KV head (K = V), keys from one or more flat pools, each token listing
the rows it attends to per pool (-1 = no key). The sink adds exp(sink[h]) to the softmax denominator only.
A pool is either rows of head_dim values ([N, D], any float dtype) or the FP8 cache's stored entries (uint8
[N, kv_entry_bytes], see ds4.kernels.fp8_kv; `rope_dim` says how they split), read without a copy.

`sparse_attention_reference` is the spec and the CPU path: it gathers and dequantises every attended key
into fp32. The Triton kernel (CUDA, or the interpreter) runs one program per token and block of query heads:
the heads are the MMA's M dimension, so one key tile read from the cache serves all of them; it walks the
token's key lists tile by tile with an online softmax whose running maximum starts at the sink. A small decode
batch splits each token's tiles over several programs (up to one per SM) and a second launch combines them.
Prefill chunks and decode steps (one or a few tokens a request) are the same launch; no host sync, every length
and stride a runtime argument. With RotaryQueries (the model's call) q is the projection's: each program
normalises and rotates its heads as norm_rope does, and the output's RoPE pairs are turned back before they are
written (by the combining launch when split), so the output [T, H, D] is what the grouped wo_a reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ds4.kernels._device import (
    dependent_launch_start,
    has_fp8,
    interpreting,
    launches_dependents_early,
    mma_is_warpgroup,
    mma_operands_in_registers,
    num_sms,
    shared_memory_per_block,
)
from ds4.kernels.fp8_kv import KV_QUANT_BLOCK, dequantize_kv, e4m3_values, kv_entry_bytes
from ds4.kernels.norm_rope import EntryForm, norm_rope, rounded
from ds4.kernels.rmsnorm import inverse_rms
from ds4.kernels.rope import apply_rope, apply_rope_reference, turn_row_pairs

# The torch reference gathers keys for a piece of tokens at a time, at most this many bytes of fp32 keys.
_PIECE_BYTES = 1 << 28
# Key sets one kernel launch takes (the model passes a window ring, the step's keys, compressed entries).
MAX_KEY_SETS = 3
_LOG2E = 1.4426950408889634
# Registers a thread the fp32 accumulator may take (of 255), the rest for the key tile and the softmax.
_ACC_REGISTERS = 128
_MIN_SPLIT_KEYS = 64
_COMBINE_BLOCK_H = 16
_COMBINE_BLOCK_D = 64
_COMBINE_STAGES = tl.constexpr(3)  # splits' pieces in flight while the combine sums them (decode: many splits)
SMALL_BATCH_SHARE = 16  # batches of at most SMs / this many tokens take 16-head programs (attention_plan)
KEY_STAGES = 2  # key tiles in flight where shared memory holds them (attention_plan)


def _check(q: torch.Tensor, key_sets, rope_dim: int | None) -> bool:
    """Whether the pools are FP8 entries (all of them or none); raises on what does not fit."""
    packed = {kv.dtype == torch.uint8 for kv, _ in key_sets}
    if len(packed) > 1:
        raise ValueError("sparse_attention: key pools mix FP8 entries and plain rows")
    fp8 = packed == {True}
    if fp8 and rope_dim is None:
        raise ValueError("sparse_attention: FP8 entries need rope_dim")
    if len({kv.dtype for kv, _ in key_sets}) > 1:
        raise ValueError("sparse_attention: key pools of different dtypes")
    width = kv_entry_bytes(q.shape[2], rope_dim) if fp8 else q.shape[2]
    for kv, idx in key_sets:
        width_ok = kv.shape[-1] == width
        if kv.dim() != 2 or not width_ok or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
            raise ValueError(
                f"sparse_attention: kv {tuple(kv.shape)} / indices {tuple(idx.shape)} do not fit q {tuple(q.shape)}"
            )
    return fp8


@dataclass(frozen=True)
class RotaryQueries:
    """Queries as the projection gives them: each head normalised and rotated at its token's position as `form`
    says (norm_rope's EntryForm, without a weight or the FP8 form), and the output's RoPE channels rotated back to
    that position (apply_rope, inverse): DeepSeek-V4's two steps around the attention, done in its launch."""

    form: EntryForm
    positions: torch.Tensor  # [T]

    def check(self, q: torch.Tensor) -> None:
        form = self.form
        if form.weight is not None or form.fp8 or form.dtype != q.dtype or self.positions.shape != q.shape[:1]:
            raise ValueError(
                f"sparse_attention: rotary queries need an unweighted {q.dtype} form and {q.shape[0]} positions, got"
                f" weight {form.weight is not None}, fp8 {form.fp8}, {form.dtype}, {list(self.positions.shape)}"
            )


def sparse_attention_reference(
    q: torch.Tensor,
    key_sets: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
    rope_dim: int | None = None,
    rotary: RotaryQueries | None = None,
) -> torch.Tensor:
    """q [T, H, D], key_sets [(kv pool, indices [T, K_i] int, -1 = none)], sink [H] -> [T, H, D] in q's dtype;
    with `rotary` q is finished first and the output rotated back (see RotaryQueries)."""
    fp8 = _check(q, key_sets, rope_dim)
    if rotary is not None:
        rotary.check(q)
        q = rotary.form.reference(q, rotary.positions)
    out = torch.empty_like(q)
    keys_per_token = sum(idx.shape[1] for _, idx in key_sets)
    piece = max(1, _PIECE_BYTES // max(1, keys_per_token * q.shape[2] * 4))
    for start in range(0, q.shape[0], piece):
        rows = slice(start, start + piece)
        sets = [(kv, idx[rows]) for kv, idx in key_sets]
        out[rows] = _attend(q[rows], sets, sink, scale, rope_dim if fp8 else None)
    if rotary is not None:
        out = apply_rope_reference(out, rotary.positions, rotary.form.inv_freq, inverse=True)
    return out


def _gather(kv: torch.Tensor, idx: torch.Tensor, head_dim: int, rope_dim: int | None) -> torch.Tensor:
    rows = kv[idx.clamp_min(0).long()]
    return rows.float() if rope_dim is None else dequantize_kv(rows, head_dim, rope_dim, torch.float32)


def _attend(q, key_sets, sink, scale, rope_dim):
    valid = torch.cat([idx >= 0 for _, idx in key_sets], dim=1)  # [t, K]
    # Rows behind -1 are never attended: zero them, whatever bytes the pool holds there (NaN included).
    keys = torch.cat([_gather(kv, idx, q.shape[2], rope_dim) for kv, idx in key_sets], dim=1)  # [t, K, D]
    keys = keys.masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sink_logit)
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=-1, keepdim=True) + torch.exp(sink_logit - peak)
    return torch.einsum("thk,tkd->thd", weights / denom, keys).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fetch_keys(
    t,
    tile,
    tiles0,
    tiles1,
    pool0,
    stride_p0,
    idx0,
    stride_i0,
    width0,
    pool1,
    stride_p1,
    idx1,
    stride_i1,
    width1,
    pool2,
    stride_p2,
    idx2,
    stride_i2,
    width2,
    D: tl.constexpr,
    DP: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    FP8: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Global tile `tile` of token t's keys (the three lists' tiles counted end to end): the key rows' validity
    (-1 = none) and their raw bytes, viewed as [BLOCK_N, DP / 64, 64] blocks of 64 dims (fp8_kv's scale block,
    KV_QUANT_BLOCK). FP8 entries:
    the e4m3 blocks, their scale exponents [BLOCK_N, DP / 64] and the bf16 RoPE dims [BLOCK_N, 64] (the block at
    NOPE); plain rows: the values (then the last two are placeholders)."""
    if tile < tiles0:
        pool, stride_p, idx, width, first = pool0, stride_p0, idx0 + t * stride_i0, width0, 0
    elif tile < tiles0 + tiles1:
        pool, stride_p, idx, width, first = pool1, stride_p1, idx1 + t * stride_i1, width1, tiles0
    else:
        pool, stride_p, idx, width, first = pool2, stride_p2, idx2 + t * stride_i2, width2, tiles0 + tiles1
    offsets = (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(idx + offsets, mask=offsets < width, other=-1)
    valid = rows >= 0
    base = rows.to(tl.int64) * stride_p
    blocks = tl.arange(0, DP // 64)
    dims = blocks[None, :, None] * 64 + tl.arange(0, 64)[None, None, :]
    # Rows start on ROW_ALIGN bytes (checked by the launcher), which the compiler cannot see through the choice of
    # pool: the hints let it read 8 or 16 bytes at a time.
    at = tl.multiple_of(pool + base[:, None, None] + dims, [1, 1, ROW_ALIGN])
    if FP8:
        in_nope = valid[:, None] & (blocks < NOPE // 64)[None, :]
        values = tl.load(at, mask=in_nope[:, :, None], other=0)
        exponents = tl.load(pool + base[:, None] + (NOPE + 2 * ROPE) + blocks[None, :], mask=in_nope, other=0)
        rope_dims = tl.arange(0, 64)
        at = pool.to(tl.pointer_type(tl.bfloat16)) + (base // 2)[:, None] + NOPE // 2 + rope_dims[None, :]
        rope = tl.load(tl.multiple_of(at, [1, ROW_ALIGN]), mask=valid[:, None] & (rope_dims < ROPE)[None, :], other=0.0)
    else:
        values = tl.load(at, mask=valid[:, None, None] & (dims < D), other=0.0)
        exponents = tl.zeros([1], tl.uint8)
        rope = tl.zeros([1], tl.bfloat16)
    return valid, values, exponents, rope


@triton.jit
def _dequantize(
    values,
    exponents,
    rope,
    DP: tl.constexpr,
    NOPE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_CVT: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Keys [BLOCK_N, DP] in the dot dtype from _fetch_keys's bytes. FP8 entries: e4m3 values times their block's
    2^(byte - 127) (exact in bf16), the RoPE block after them."""
    if FP8:
        if FP8_CVT:
            nope = values.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:  # no e4m3 conversion on this device (sm_80): from the bits
            nope = e4m3_values(values.to(tl.int32))
        scales = (exponents.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        blocks = tl.arange(0, DP // 64)[None, :, None]
        k = tl.where(blocks == NOPE // 64, rope.to(tl.float32)[:, None, :], nope * scales[:, :, None])
    else:
        k = values
    return tl.reshape(k, (BLOCK_N, DP)).to(DOT)


@triton.jit
def _rotated_back(
    out,
    first_pair,
    position,
    freq_ptr,
    D,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Output rows fp32 [ROWS, BLOCK_D] of channels 2 * first_pair on, rounded to DTYPE and their RoPE pairs
    turned back from `position`: apply_rope(inverse) of the rounded output."""
    even, odd = tl.split(tl.reshape(rounded(out, DTYPE), (ROWS, BLOCK_D // 2, 2)))
    pair = first_pair + tl.arange(0, BLOCK_D // 2)
    positions = tl.zeros([1], tl.float32) + position  # one token's rows: their angles once
    even, odd = turn_row_pairs(even, odd, pair, positions, freq_ptr, D, -1.0, HALF, 1, BLOCK_D // 2)
    return tl.reshape(tl.join(even, odd), (ROWS, BLOCK_D))


@triton.jit
def _rope_pairs(row, stride_h, heads, head_in, D, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Pointers to the last 2 * HALF channels (the RoPE pairs) of the heads' rows [BLOCK_H, 2 * HALF] and their mask."""
    at = row + heads[:, None] * stride_h + (D - 2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    return at, head_in[:, None]


@triton.jit
def _turned(pairs, position, freq_ptr, D, SIGN: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """RoPE pairs fp32 [BLOCK_H, 2 * HALF] (a head's last channels) turned by their angles at `position` (SIGN -1.0:
    back), fp32 in the same shape."""
    even, odd = tl.split(tl.reshape(pairs, (BLOCK_H, HALF, 2)))
    pair = D // 2 - HALF + tl.arange(0, HALF)
    positions = tl.zeros([1], tl.float32) + position  # one token's rows: their angles once
    even, odd = turn_row_pairs(even, odd, pair, positions, freq_ptr, D, SIGN, HALF, 1, HALF)
    return tl.reshape(tl.join(even, odd), (BLOCK_H, 2 * HALF))


@triton.jit
def _finished_queries(
    q, q_row, stride_qh, scratch, stride_sh, heads, head_in, position, freq_ptr, D, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, DP: tl.constexpr,
):  # fmt: skip
    """The projection's heads q [BLOCK_H, DP] (0 past D, loaded from q_row) finished as norm_rope's unweighted
    EntryForm: normalised, rounded to q's dtype, the RoPE pairs turned at `position` and rounded again. Written to
    this token's output rows (`scratch`, which the result overwrites) and read back: loaded, q becomes the MMA's
    operand in shared memory, computed Triton keeps it in registers (64 a thread at 64 x 512, which the
    accumulator's 128 then spill into the loop). Only the RoPE pairs are turned, loaded again on their own (turning
    the whole tile and picking those pairs cost a few thousand instructions a thread at 64 x 512)."""
    dtype: tl.constexpr = q_row.dtype.element_ty
    dims = tl.arange(0, DP)
    x = q.to(tl.float32)
    inverse = inverse_rms(tl.sum(x * x, axis=1), D, eps)
    at = scratch + heads[:, None] * stride_sh + dims[None, :]
    tl.store(at, rounded(x * inverse[:, None], dtype).to(dtype), mask=head_in[:, None] & (dims < D - 2 * HALF)[None, :])
    pairs_at, pairs_ok = _rope_pairs(q_row, stride_qh, heads, head_in, D, HALF, BLOCK_H)
    pairs = rounded(tl.load(pairs_at, mask=pairs_ok, other=0.0).to(tl.float32) * inverse[:, None], dtype)
    turned = rounded(_turned(pairs, position, freq_ptr, D, 1.0, HALF, BLOCK_H), dtype)
    scratch_at, _ = _rope_pairs(scratch, stride_sh, heads, head_in, D, HALF, BLOCK_H)
    tl.store(scratch_at, turned.to(dtype), mask=pairs_ok)
    tl.debug_barrier()
    return tl.load(at, mask=head_in[:, None] & (dims < D)[None, :], other=0.0)


@triton.jit
def _turn_back(row, stride_h, heads, head_in, position, freq_ptr, D, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """The RoPE pairs of the output rows this program stored (rounded to their dtype) turned back from `position`
    in place: apply_rope(inverse) of the rounded output, read back after the stores (only those pairs)."""
    tl.debug_barrier()  # every thread's output stores are made before the pairs are read back
    at, ok = _rope_pairs(row, stride_h, heads, head_in, D, HALF, BLOCK_H)
    pairs = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    tl.store(at, _turned(pairs, position, freq_ptr, D, -1.0, HALF, BLOCK_H).to(row.dtype.element_ty), mask=ok)


@triton.jit
def _exchanged(p, alpha, exchange_ptr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """p [BLOCK_H, BLOCK_N] and alpha [BLOCK_H] as they come back from this program's slot of exchange_ptr (the
    probabilities, then the fp32 factors): equal values that Triton sees no data path to from the QK product."""
    slot = (tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
    slot = (slot + tl.program_id(2)) * (BLOCK_H * BLOCK_N * p.dtype.primitive_bitwidth // 8 + BLOCK_H * 4)
    rows = tl.arange(0, BLOCK_H)
    p_at = (exchange_ptr + slot).to(tl.pointer_type(p.dtype)) + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    alpha_at = (exchange_ptr + slot + BLOCK_H * BLOCK_N * p.dtype.primitive_bitwidth // 8).to(
        tl.pointer_type(tl.float32)
    ) + rows
    tl.debug_barrier()  # the previous tile's reads of the slot are done
    tl.store(p_at, p)
    tl.store(alpha_at, alpha)
    tl.debug_barrier()  # every thread's part is stored
    return tl.load(p_at), tl.load(alpha_at)


@triton.jit(
    do_not_specialize=[
        "n_heads",
        "stride_i0",
        "width0",
        "stride_i1",
        "width1",
        "stride_i2",
        "width2",
        "tiles_per_split",
    ]
)
def _sparse_attention_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    out_ptr,
    stride_ot,
    stride_oh,
    part_ptr,
    exchange_ptr,
    sink_ptr,
    pos_ptr,
    freq_ptr,
    eps,
    n_heads,
    scale_log2,
    pool0,
    stride_p0,
    idx0,
    stride_i0,
    width0,
    pool1,
    stride_p1,
    idx1,
    stride_i1,
    width1,
    pool2,
    stride_p2,
    idx2,
    stride_i2,
    width2,
    tiles_per_split,
    D: tl.constexpr,
    DP: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_CVT: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    DOT: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    EXCHANGE: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program: one token, BLOCK_H of its heads (the MMA's M) and one split of its key tiles (the three lists'
    # tiles counted end to end), with an online softmax in the log2 domain whose running max starts at the sink
    # in the first split. STAGES > 1: the key tiles' reads (indices, entries) run that many tiles ahead by async
    # copies through shared memory, so that a tile's loads overlap the previous tiles' products.
    # SPLIT: the running max, denominator and numerator go to part_ptr for _combine_splits, else the output.
    # ROTARY: q is the projection's; its heads are finished here and the output turned back (RotaryQueries).
    # EXCHANGE: each tile's probabilities and rescale factors reach the PV product through this program's slot of
    # exchange_ptr (see AttentionPlan.exchange). PDL: launched early (`dependent_launch_start`).
    dependent_launch_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    head_in = heads < n_heads
    dims = tl.arange(0, DP)  # D padded to a power of two
    live = head_in[:, None] & (dims < D)[None, :]
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=live, other=0.0)
    if ROTARY:
        position = tl.load(pos_ptr + t).to(tl.float32)
        q = _finished_queries(
            q, q_ptr + t * stride_qt, stride_qh, out_ptr + t * stride_ot, stride_oh, heads, head_in, position,
            freq_ptr, D, eps, HALF, BLOCK_H, DP,
        )  # fmt: skip
    q = q.to(DOT)
    sink = tl.load(sink_ptr + heads, mask=head_in, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.where(split == 0, sink, float("-inf"))
    denom = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DP], tl.float32)
    tiles0, tiles1 = tl.cdiv(width0, BLOCK_N), tl.cdiv(width1, BLOCK_N)
    begin = split * tiles_per_split
    end = tl.minimum(begin + tiles_per_split, tiles0 + tiles1 + tl.cdiv(width2, BLOCK_N))
    for tile in tl.range(begin, end, num_stages=STAGES):
        valid, values, exponents, rope = _fetch_keys(
            t, tile, tiles0, tiles1,
            pool0, stride_p0, idx0, stride_i0, width0, pool1, stride_p1, idx1, stride_i1, width1,
            pool2, stride_p2, idx2, stride_i2, width2, D, DP, NOPE, ROPE, FP8, ROW_ALIGN, BLOCK_N,
        )  # fmt: skip
        if tl.max(valid.to(tl.int32), axis=0) > 0:  # a tile of padding (-1) costs no dot product
            k = _dequantize(values, exponents, rope, DP, NOPE, FP8, FP8_CVT, DOT, BLOCK_N)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            p = p.to(DOT)
            if EXCHANGE:
                p, alpha = _exchanged(p, alpha, exchange_ptr, BLOCK_H, BLOCK_N)
            if IEEE:
                pv = tl.dot(p, k, input_precision="ieee")
            else:
                pv = tl.dot(p, k)
            acc = acc * alpha[:, None] + pv
            m = m_new
    if SPLIT:
        # part: [T, splits, n_heads, D + 4] fp32, the numerator then the running max and the denominator, rows
        # padded to 16 bytes so that the numerator is written and read back in 16-byte vectors
        row = ((t * tl.num_programs(2) + split) * n_heads + heads) * (D + 4)
        tl.store(part_ptr + row[:, None] + dims[None, :], acc, mask=live)
        tl.store(part_ptr + row + D, m, mask=head_in)
        tl.store(part_ptr + row + D + 1, denom, mask=head_in)
    else:
        out = acc / denom[:, None]
        tl.store(
            out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=live,
        )
        if ROTARY:
            _turn_back(out_ptr + t * stride_ot, stride_oh, heads, head_in, position, freq_ptr, D, HALF, BLOCK_H)


@triton.jit(do_not_specialize=["n_heads", "splits"])
def _combine_splits(
    part_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    pos_ptr,
    freq_ptr,
    n_heads,
    splits,
    D: tl.constexpr,
    ROTARY: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program: one token's BLOCK_H heads, BLOCK_D of the dims; the splits' softmax pieces rescaled to their
    # common maximum, their reads running ahead of the sums. ROTARY: the output turned back (BLOCK_D a multiple of
    # 2 * HALF, so that the angles tile it). PDL: as _sparse_attention_kernel's.
    dependent_launch_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_in = heads < n_heads
    dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = head_in[:, None] & (dims < D)[None, :]
    peak = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.range(0, splits, num_stages=_COMBINE_STAGES):
        row = ((t * splits + s) * n_heads + heads) * (D + 4)
        peak = tl.maximum(peak, tl.load(part_ptr + row + D, mask=head_in, other=0.0))
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in tl.range(0, splits, num_stages=_COMBINE_STAGES):
        row = ((t * splits + s) * n_heads + heads) * (D + 4)
        weight = tl.exp2(tl.load(part_ptr + row + D, mask=head_in, other=0.0) - peak)
        denom += weight * tl.load(part_ptr + row + D + 1, mask=head_in, other=0.0)
        acc += weight[:, None] * tl.load(part_ptr + row[:, None] + dims[None, :], mask=live, other=0.0)
    out = acc / tl.where(head_in, denom, 1.0)[:, None]
    if ROTARY:
        position = tl.load(pos_ptr + t).to(tl.float32)
        first_pair = tl.program_id(2) * (BLOCK_D // 2)
        out = _rotated_back(out, first_pair, position, freq_ptr, D, HALF, BLOCK_H, BLOCK_D, out_ptr.dtype.element_ty)
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=live,
    )


@dataclass(frozen=True)
class AttentionPlan:
    """Launch settings: query heads per program (the MMA's M), keys per tile, warps, and the key tiles in flight
    (1: read as they are used).

    exchange (attention_plan's choice where a warpgroup issues the MMA; a candidate of `ds4 bench attention
    --sweep`): a tile's probabilities and rescale factors go to the PV product through a slot of memory of the
    program's own. Triton gives a QK product that feeds another product all the warps along M, so with 8 warps and
    64 heads (one warpgroup's M) both warpgroups compute the whole QK tile; with no data path from it to the PV
    product they split its keys instead (offline, sm_90, 64 x 32 over 8 warps: 32 wgmma instructions a tile instead
    of 64, 759 instructions a tile against 1126 at 2 stages and 934 at 1), at the price of two barriers a tile,
    which also keep Triton from reading key tiles ahead (stages is then 1)."""

    block_h: int
    block_n: int
    num_warps: int
    stages: int = 1
    exchange: bool = False


def attention_plan(device: torch.device, heads: int, head_dim: int, tokens: int | None = None) -> AttentionPlan:
    """Settings: up to 64 heads a program (Flash's all, Pro's half), so that one key tile read from the cache
    serves them all; 32 keys a tile (the QK product's N; measured on the H200 at 64 x 512, BENCHMARKS.md: 1.4x
    faster than 16, while 64 spill registers); warps enough that the fp32 accumulator [heads, head_dim] takes at
    most 128 registers a thread (8 warps at 64 x 512: a warpgroup per half of the dims); fewer heads where the
    device's shared memory per block holds neither the query tile and a key tile in bf16 nor the fp32 partial
    result that a split writes through it. A batch of few tokens (at most 1/SMALL_BATCH_SHARE of the SM count)
    takes 16 heads a program: four times the programs, each with a quarter of the query tile and accumulator (H200,
    Flash, 64K context, the sweep at 23c2fb5: batch 1 0.0202 ms against 0.0271 at 64 heads, 0.0248 exchanging;
    batch 8 0.0275 against 0.0296 and 0.0274; batch 16 0.0418 against 0.0347 and 0.0319). Key tiles are
    read KEY_STAGES ahead where the shared memory also holds their rows (async copies, so that the loads overlap
    the products), except in a small batch's programs (H200, Flash, 64K context, at 16 heads: batch 1 0.0231 ms at
    1 stage, 0.0254 at 2; at 64 heads: batch 64 0.0727 at 2, 0.0759 at 1, the 8K prefill 5.46 at 2, 5.77 at 1).
    Where a warpgroup issues the MMA (wgmma) a program of 64 heads over 8 warps exchanges the probabilities through
    memory, 64 keys a tile where the shared memory holds them (H200, Flash, `ds4 bench attention --sweep` at
    23c2fb5: the 8K prefill 3.93 ms against 4.97 at 32 keys and 2 stages without; batch 64 0.0672 against 0.0671).
    Where the MMA takes its operands from registers (sm_80 to sm_89, sm_120) the query tile is one of them: 16 heads
    a program over 8 warps (offline, sm_80 and sm_120 at 512 dims: no spills, where 32 or 64 heads spilled hundreds
    of registers in the key loop)."""
    padded = triton.next_power_of_2(head_dim)
    block_h, block_n = min(64, max(16, triton.next_power_of_2(heads))), 32
    registers_hold_q = mma_operands_in_registers(device)
    small_batch = tokens is not None and tokens * SMALL_BATCH_SHARE <= num_sms(device)
    if registers_hold_q or small_batch:
        block_h = 16
    smem = shared_memory_per_block(device)
    while block_h > 16 and _shared_bytes(block_h, block_n, padded) > smem:
        block_h //= 2
    stages = KEY_STAGES if not small_batch and _shared_bytes(block_h, block_n, padded, KEY_STAGES) <= smem else 1
    warps = 8 if registers_hold_q else min(8, max(4, block_h * padded // (32 * _ACC_REGISTERS)))
    if not small_batch and block_h == 64 and warps == 8 and mma_is_warpgroup(device):
        wide = 2 * block_n
        block_n = wide if _shared_bytes(block_h, wide, padded) <= smem else block_n
        return AttentionPlan(block_h, block_n, warps, 1, exchange=True)
    return AttentionPlan(block_h, block_n, warps, stages)


def _shared_bytes(block_h: int, block_n: int, padded_dim: int, stages: int = 1) -> int:
    """The query and key tiles in bf16 (with stages > 1 beside that many key tiles' rows in flight, bf16 rows at
    most), or a split's fp32 partial result."""
    in_flight = stages * block_n * padded_dim * 2 if stages > 1 else 0
    return max((block_h + block_n) * padded_dim * 2 + in_flight, block_h * padded_dim * 4)


def _smaller(plan: AttentionPlan) -> AttentionPlan | None:
    """The next plan to try when a compiled kernel does not fit the device: no key tiles in flight, fewer keys a
    tile, then fewer heads."""
    if plan.stages > 1:
        return dataclasses.replace(plan, stages=1)
    if plan.block_n > 16:
        return dataclasses.replace(plan, block_n=plan.block_n // 2)
    if plan.block_h > 16:
        return dataclasses.replace(plan, block_h=plan.block_h // 2)
    return None


# The plan that compiled within the device's resources, per (device, heads, head_dim, fp8 pools, q dtype).
_FITTING_PLANS: dict[tuple, AttentionPlan] = {}


def key_splits(programs: int, keys: int, sms: int) -> int:
    """Programs a token's keys are split over: only while the grid would not give every SM a program (a small
    decode batch), up to that, each split at least _MIN_SPLIT_KEYS keys (its partial result costs H x D fp32 to
    write and read back)."""
    if programs >= sms:
        return 1
    return max(1, min(sms // programs, keys // _MIN_SPLIT_KEYS))


def _row_align(fp8: bool) -> int:
    """Bytes every pool row starts on: FP8 entries are whole multiples of 8 bytes (fp8_kv), plain rows 16."""
    return 8 if fp8 else 16


_DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def sparse_attention(
    q: torch.Tensor,
    key_sets: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
    rope_dim: int | None = None,
    impl: str = "auto",
    plan: AttentionPlan | None = None,
    splits: int | None = None,
    rotary: RotaryQueries | None = None,
) -> torch.Tensor:
    """q [T, H, D], key_sets [(kv pool, indices [T, K_i] int, -1 = none)], sink [H] -> [T, H, D] in q's dtype.

    Pools: rows [N, D] or FP8 entries uint8 [N, kv_entry_bytes] (then rope_dim is needed), all of one kind.
    rotary: q is the projection's, finished in the launch, and the output rotated back (see RotaryQueries).
    impl: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the reference), or "auto" (triton on CUDA).
    plan, splits: override the launch settings and the split of each token's keys (tests, benchmarks)."""
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "torch":
        return sparse_attention_reference(q, key_sets, sink, scale, rope_dim, rotary)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    fp8 = _check(q, key_sets, rope_dim)
    if not 1 <= len(key_sets) <= MAX_KEY_SETS:
        raise ValueError(f"sparse_attention: 1 to {MAX_KEY_SETS} key sets, got {len(key_sets)}")
    t, heads, head_dim = q.shape
    if q.stride(2) != 1 or q.dtype not in _DOT_TYPES:
        raise ValueError(f"sparse_attention: q must be [T, H, D] contiguous in D, got {q.dtype} {tuple(q.stride())}")
    if rotary is not None:
        rotary.check(q)
        if not rotary.form.fits_kernel(head_dim):  # angles the kernel cannot tile: the separate launches
            positions, form = rotary.positions, rotary.form
            out = sparse_attention(norm_rope(q, positions, form), key_sets, sink, scale, rope_dim, impl, plan, splits)
            return apply_rope(out, positions, form.inv_freq, inverse=True, in_place=True)
    out = torch.empty((t, heads, head_dim), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    small = t * SMALL_BATCH_SHARE <= num_sms(q.device)
    key = (q.device, heads, head_dim, fp8, q.dtype, rotary is not None, small)
    chosen = plan or _FITTING_PLANS.get(key) or attention_plan(q.device, heads, head_dim, t)
    sets = []
    if fp8 and rope_dim > KV_QUANT_BLOCK:
        raise ValueError(f"sparse_attention: the kernel holds the RoPE dims in one block of 64, got {rope_dim}")
    for kv, idx in key_sets:
        if kv.stride(1) != 1 or idx.stride(1) != 1:
            raise ValueError("sparse_attention: pools and indices must be contiguous in their last dim")
        align = _row_align(fp8)
        if kv.data_ptr() % align or kv.stride(0) * kv.element_size() % align:
            raise ValueError(
                f"sparse_attention: pool rows must start on {align} bytes (the kernel reads {align} at a time)"
            )
        sets += [kv, kv.stride(0), idx, idx.stride(0), idx.shape[1]]
    for _ in range(MAX_KEY_SETS - len(key_sets)):
        sets += sets[:4] + [0]  # an empty list (the first set's tensors, width 0): its loop never runs
    while True:
        try:
            _launch(q, out, sink, scale, sets, key_sets, rope_dim, fp8, chosen, splits, rotary)
            break
        except OutOfResources:
            if plan is not None or _smaller(chosen) is None:
                raise
            chosen = _smaller(chosen)
    _FITTING_PLANS.setdefault(key, chosen)
    return out


def _launch(q, out, sink, scale, sets, key_sets, rope_dim, fp8, plan, splits, rotary) -> None:
    t, heads, head_dim = q.shape
    dot_f32 = interpreting() or q.dtype == torch.float32
    head_blocks = triton.cdiv(heads, plan.block_h)
    tiles = sum(triton.cdiv(idx.shape[1], plan.block_n) for _, idx in key_sets)
    splits = splits or key_splits(t * head_blocks, tiles * plan.block_n, num_sms(q.device))
    per_split = max(1, triton.cdiv(tiles, splits))
    splits = max(1, triton.cdiv(tiles, per_split))
    part = torch.empty(t * splits * heads * (head_dim + 4) if splits > 1 else 0, dtype=torch.float32, device=q.device)
    # a slot a program: a tile's probabilities in the dot dtype and its rescale factors (AttentionPlan.exchange)
    slot = plan.block_h * plan.block_n * (4 if dot_f32 else q.element_size()) + plan.block_h * 4
    programs = t * head_blocks * splits if plan.exchange else 0
    exchange = torch.empty(programs * slot, dtype=torch.uint8, device=q.device)
    if rotary is None:
        positions, freqs, eps, half = sink, sink, 0.0, 1  # placeholders, never read
    else:
        positions, eps, half = rotary.positions, rotary.form.eps, rotary.form.inv_freq.numel()
        freqs = rotary.form.inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    pdl = launches_dependents_early(q.device)
    _sparse_attention_kernel[(t, head_blocks, splits)](
        q,
        q.stride(0),
        q.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        part,
        exchange,
        sink,
        positions,
        freqs,
        eps,
        heads,
        scale * _LOG2E,
        *sets,
        per_split,
        D=head_dim,
        DP=triton.next_power_of_2(head_dim),
        NOPE=head_dim - (rope_dim or 0),
        ROPE=rope_dim or 0,
        FP8=fp8,
        FP8_CVT=has_fp8(q.device),  # else the e4m3 values are decoded from their bits
        ROW_ALIGN=_row_align(fp8),
        DOT=tl.float32 if dot_f32 else _DOT_TYPES[q.dtype],
        IEEE=dot_f32,
        SPLIT=splits > 1,
        ROTARY=rotary is not None,
        HALF=half,
        BLOCK_H=plan.block_h,
        BLOCK_N=plan.block_n,
        STAGES=1 if plan.exchange else plan.stages,
        EXCHANGE=plan.exchange,
        PDL=pdl,
        num_warps=plan.num_warps,
        launch_pdl=pdl,
    )
    if splits > 1:
        # with rotary queries a block holds whole tiles of the angles (see _combine_splits)
        block_d = min(max(_COMBINE_BLOCK_D, 2 * half), triton.next_power_of_2(head_dim))
        grid = (t, triton.cdiv(heads, _COMBINE_BLOCK_H), triton.cdiv(head_dim, block_d))
        _combine_splits[grid](
            part,
            out,
            out.stride(0),
            out.stride(1),
            positions,
            freqs,
            heads,
            splits,
            D=head_dim,
            ROTARY=rotary is not None,
            HALF=half,
            BLOCK_H=_COMBINE_BLOCK_H,
            BLOCK_D=block_d,
            PDL=pdl,
            launch_pdl=pdl,
        )
