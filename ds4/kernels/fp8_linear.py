"""FP8 block-scaled linear, as the official reference's act_quant + fp8_gemm: y = act_quant(x) @ dequant(w).T.

Weight: float8_e4m3fn [N, K] and one power-of-two fp32 scale per 128 x 128 block, [ceil(N/128), ceil(K/128)].
Activations (act_quant): per row and 128-column group, amax = max |x| floored at 1e-4, scale =
2^ceil(log2(amax * fp32(1/448))), values clamp(x / scale, -448, 448) rounded to e4m3 (nearest, ties to even).
A product of two e4m3 values is exact in fp32, so the spec is: dequantise both operands, matmul in fp32.

Grouped projections (the attention's wo_a): x [M, G*K] holds G groups of K columns and the weight [G*R, K]
R output rows per group; outputs of group g read only inputs of group g. The reference multiplies wo_a in
bf16 without act_quant; `quantize_x=False` is that: x (unrounded) times the dequantised weight.

On CUDA, decode-sized calls run one Triton launch bound by the weight's bytes: act_quant fused in, each weight
byte read once, K split across programs until the device is full, the last program of each output tile summing
the splits' fp32 partials in a fixed order and writing the output dtype (deterministic, capturable in CUDA
graphs), by FMA at M = 1 (each warp its own weight rows, read K-contiguously, the lanes' sums meeting once at
the end), by tl.dot at more rows. Larger calls (where TRITON_UP_TO says cuBLAS is faster) run whole 128 x 128
blocks through cuBLAS (torch._scaled_mm, 1x128 activation blocks x 128x128 weight blocks) after a Triton
act_quant, rows padded to a multiple of 16; torch takes that recipe on sm_90 only, so elsewhere both operands are
dequantised (exactly, to bf16) for one bf16 GEMM into fp32. Without act_quant, large M dequantises the weight per
call and multiplies in bf16, as the reference does. `ds4 bench linear` times every path at every M.

An input may come unfinished, finished as the kernel loads it where it can (a launch of its own elsewhere): the
SwiGLU of a gate and an up (the shared expert's w2: the Triton kernels), or the RMSNorm of x's rows (the
attention's wq_b after its q_norm: the M = 1 kernel), rounded to x's dtype as that launch would round it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4.kernels._device import (
    ARRIVAL_COUNTERS,
    arrival_counters,
    cuda_index,
    dependent_launch_start,
    early_prefetch_bytes,
    has_blockwise_fp8_gemm,
    interpreting,
    launches_dependents_early,
    num_sms,
    prefetch_to_l2,
)
from ds4.kernels.fp8_kv import pow2_ceil
from ds4.kernels.norm_rope import rounded
from ds4.kernels.rmsnorm import inverse_rms, rms_norm
from ds4.kernels.swiglu import clamped_swiglu, swiglu, swiglu_to

QUANT_BLOCK = 128  # activation groups and weight blocks are 128 wide along K (and weight blocks 128 tall)
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


@dataclass(frozen=True)
class TileSettings:
    """Tile shape and parallelism of the Triton kernel for one family of M; `linear_plan` fits them to a problem
    and a device."""

    block_n: int  # output rows a program computes (a power of two <= 128: one weight scale block)
    block_k: int  # K columns a loop step reads (a multiple of 128; FMA: of 32 lanes x 16 bytes of x)
    programs_per_sm: int  # split K until the grid holds this many programs per SM (bytes in flight)
    max_stages: int  # pipeline stages at most (fewer where shared memory runs out; FMA: 1 loads into registers)
    num_warps: int  # FMA: each warp owns block_n / num_warps output rows
    prefetch: bool = False  # FMA at 1 stage: the next chunk's weights loaded before this chunk's products


# ---- chosen settings (measured by `ds4 bench linear --sweep`; see BENCHMARKS.md) ----
# (largest M, tl.dot, tiles) of the Triton kernel: a call takes the first row whose M covers its M (else the last;
# more rows run more programs). Without tl.dot the kernel multiplies by FMA over K-contiguous weight rows, one row
# of x a program.
TILE_TABLE = (
    (1, False, TileSettings(block_n=64, block_k=256, programs_per_sm=3, max_stages=1, num_warps=4)),
    (16, True, TileSettings(block_n=32, block_k=256, programs_per_sm=4, max_stages=3, num_warps=4)),
    (64, True, TileSettings(block_n=32, block_k=256, programs_per_sm=4, max_stages=3, num_warps=4)),
)
DOT_MAX_BLOCK_M = 64  # rows of x a tl.dot program takes; more rows run more programs
# (rows, weight bytes): `auto` runs the Triton kernel up to that many rows for weights up to that size, cuBLAS
# elsewhere where it fits (H200, at 4 rows: the kernel 0.017 ms against cuBLAS's 0.019 on 6 MB, 0.018 against 0.015
# on 8 MB, 0.025 against 0.020 on 16 MB; at M = 1 it wins everywhere).
TRITON_UP_TO = ((1, 1 << 62), (16, 6 << 20), (64, 4 << 20))
# Rows the Triton kernel takes at any weight size where torch has no blockwise FP8 GEMM (off sm_90): H200, 32 MB of
# weight at 16 rows, 0.033 ms, where dequantising it alone moves 96 MB (0.023 ms at the copy rate) before its GEMM.
TRITON_WITHOUT_BLOCKWISE_UP_TO = 16
CUBLAS_MIN_M_DEQUANTIZED = 128  # without act_quant, dequantising the weight per call pays off above this
PARTIAL_SHARE = 2  # K splits keep their fp32 partials (written and read) under 1/this of the weight's bytes
# partials in flight while the last program of a tile sums them (read one after another, each was a latency on the
# launch's critical path)
PARTIAL_STAGES = tl.constexpr(3)
CUBLAS_ROWS = 16  # rows padded to a multiple of this for cuBLAS
DEQUANTIZED_PIECE_BYTES = 256 << 20  # fp32 rows at a time where both operands are dequantised (no blockwise recipe)
SMEM_RESERVE = 8 << 10  # shared memory left to the compiler's own scratch (barriers, the epilogue)
ACT_QUANT_ROWS = 8  # rows an act_quant program quantises (H200, 8192 x 4096: 0.094 ms at 32, 0.048 at 8)
DEQUANTIZE_ROWS, DEQUANTIZE_COLS = 32, 512  # a weight dequantisation program's tile


# ---- torch reference: the spec, the CPU path and the test oracle ----


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (float8_e4m3fn [M, K], fp32 power-of-two scales [M, ceil(K/128)]); a last partial group
    quantises over its own columns."""
    m, k = x.shape
    groups = -(-k // QUANT_BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, groups * QUANT_BLOCK - k)).view(m, groups, QUANT_BLOCK)
    amax = padded.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    scale = pow2_ceil(amax * (1 / FP8_MAX))  # an fp32 multiply by fp32(1/448), as the reference's kernel
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k], scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [N, K] with fp32 block scales -> fp32 [N, K]."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(QUANT_BLOCK, 0)[:n].repeat_interleave(QUANT_BLOCK, 1)[:, :k]
    return weight.float() * s


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    groups: int = 1,
    quantize_x: bool = True,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [M, G*K] -> [M, G*R] in out_dtype (default x.dtype): (act_quant) x times the dequantised weight, fp32."""
    m = x.shape[0]
    n, k = weight.shape
    xs = x.float()
    if quantize_x:
        q, s = act_quant(x.reshape(m * groups, k))
        xs = q.float() * s.repeat_interleave(QUANT_BLOCK, 1)[:, :k]
    w = dequantize_weight(weight, scale).view(groups, n // groups, k)
    y = torch.einsum("mgk,grk->mgr", xs.reshape(m, groups, k), w)
    return y.reshape(m, n).to(out_dtype or x.dtype)


# ---- Triton ----


@triton.jit
def _quantize_group(x):
    """fp32 [rows, 128] -> (values rounded to e4m3, fp32 [rows] scales): act_quant of one group."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    bits = (amax * (1.0 / 448.0)).to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    # x / scale is x times 2^-e exactly: one multiply by the inverse's bits instead of a division an element.
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    q = tl.clamp(x * inverse[:, None], -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _scaled_activations(x, w_scale, QUANTIZE_X: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr):
    """fp32 [ROWS, GROUPS * 128] -> (act_quant'ed when QUANTIZE_X) x times its group scale and the weight block
    scale w_scale [GROUPS] of each group: powers of two, so every value stays exact (in bf16 too for bf16 or
    e4m3 inputs) and the product with an e4m3 weight is the spec's product exactly."""
    x = tl.reshape(x, (ROWS * GROUPS, 128))
    scale = tl.reshape(tl.broadcast_to(w_scale[None, :], (ROWS, GROUPS)), (ROWS * GROUPS,))
    if QUANTIZE_X:
        q, x_scale = _quantize_group(x)
        x = q.to(tl.float32) * (x_scale * scale)[:, None]
    else:
        x = x * scale[:, None]
    return tl.reshape(x, (ROWS, GROUPS * 128))


@triton.jit
def _mma(a, b, DOT_F32: tl.constexpr):
    """a @ b in fp32: bf16 operands (exact for e4m3 values times powers of two and for bf16 inputs), or full fp32
    ones when DOT_F32."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


# K stays specialised (its divisibility by 16), so that the column mask keeps the accesses wide.
@triton.jit(do_not_specialize=["M", "M_OUT"])
def _act_quant_kernel(
    x_ptr, x_stride, q_ptr, q_stride, scale_ptr, scale_stride, M, M_OUT, K, ROWS: tl.constexpr, PDL: tl.constexpr
):
    """One program: ROWS rows x one 128-column group; scales are written K-group-major ([K/128, M_OUT]).
    Output rows M..M_OUT-1 (padding) quantise zeros. PDL: launched early."""
    dependent_launch_start(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    out = (rows[:, None] < M_OUT) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=out & (rows[:, None] < M), other=0.0)
    q, scale = _quantize_group(x.to(tl.float32))
    tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], q, mask=out)
    tl.store(scale_ptr + tl.program_id(1) * scale_stride + rows, scale, mask=rows < M_OUT)


@triton.jit
def _write_output(acc, out, part, live, split, splits, part_split_stride, arrival, SPLIT: tl.constexpr):
    """A program's fp32 sums `acc` to the output (pointers `out`, its dtype). SPLIT: each split stores its partial
    (pointers `part`, splits `part_split_stride` apart) and the last program of the tile to arrive (the counter
    `arrival`, which it resets for the next launch) sums the partials in split order (their reads running ahead)
    and writes the output: one launch, the same bits every run, capturable in a CUDA graph."""
    if SPLIT:
        tl.store(part + split * part_split_stride, acc, mask=live)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == splits - 1:
            total = tl.zeros_like(acc)
            for s in tl.range(0, splits, num_stages=PARTIAL_STAGES):
                total += tl.load(part + s * part_split_stride, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(out.dtype.element_ty), mask=live)
            tl.atomic_xchg(arrival, 0)
    else:
        tl.store(out, acc.to(out.dtype.element_ty), mask=live)


@triton.jit
def _swiglu_input(x, up_ptrs, mask, limit, X_DTYPE: tl.constexpr):
    """x is a gate and up_ptrs its up: the linear's input is their clamped SwiGLU, rounded to x's dtype."""
    up = tl.load(up_ptrs, mask=mask, other=0.0).to(tl.float32)
    return rounded(clamped_swiglu(x, up, limit), X_DTYPE)


# K and the input strides stay specialised: their divisibility by 16 lets the K-masked loads be 16 bytes wide.
@triton.jit(
    do_not_specialize=[
        "ws_stride",
        "out_stride",
        "part_split_stride",
        "part_stride",
        "M",
        "rows_per_group",
        "chunks_per_split",
        "splits",
    ]
)
def _fp8_linear_kernel(
    x_ptr,
    x_stride,
    up_ptr,
    up_stride,
    limit,
    w_ptr,
    w_stride,
    ws_ptr,
    ws_stride,
    out_ptr,
    out_stride,
    part_ptr,
    part_split_stride,
    part_stride,
    arrivals_ptr,
    M,
    rows_per_group,
    K,
    chunks_per_split,
    splits,
    QUANTIZE_X: tl.constexpr,
    SWIGLU: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_N output rows of one group x BLOCK_M rows of x x one split of the K chunks (BLOCK_K
    columns each), accumulated by tl.dot in fp32 [BLOCK_N, BLOCK_M] (bf16 operands, or fp32 when DOT_F32). Each
    128-group's weight scale multiplies the activations (exact), or with ROW_SCALES (a tile that crosses 128-row
    scale blocks) the weight. SWIGLU: x is a gate and up_ptr its up (see _swiglu_input). PDL: launched early."""
    dependent_launch_start(PDL)
    GROUPS: tl.constexpr = BLOCK_K // 128
    tile, m_tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_per_group = tl.cdiv(rows_per_group, BLOCK_N)
    group = tile // tiles_per_group
    n_start = group * rows_per_group + (tile % tiles_per_group) * BLOCK_N
    n_local = (tile % tiles_per_group) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n_local < rows_per_group
    n = n_start + tl.arange(0, BLOCK_N)
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_live = m < M
    k_groups = tl.cdiv(K, 128)
    chunk_start = split * chunks_per_split
    chunk_end = tl.minimum(chunk_start + chunks_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for chunk in range(chunk_start, chunk_end):
        k = chunk * BLOCK_K + tl.arange(0, BLOCK_K)
        k_live = k < K
        kg = chunk * GROUPS + tl.arange(0, GROUPS)
        w = tl.load(w_ptr + n[:, None] * w_stride + k[None, :], mask=n_live[:, None] & k_live[None, :], other=0.0)
        x_mask = m_live[:, None] & k_live[None, :]
        x = tl.load(x_ptr + m[:, None] * x_stride + group * K + k[None, :], mask=x_mask, other=0.0).to(tl.float32)
        if SWIGLU:
            x = _swiglu_input(x, up_ptr + m[:, None] * up_stride + k[None, :], x_mask, limit, x_ptr.dtype.element_ty)
        if ROW_SCALES:
            scale_ptrs = ws_ptr + (n // 128)[:, None] * ws_stride + kg[None, :]
            ws = tl.load(scale_ptrs, mask=n_live[:, None] & (kg < k_groups)[None, :], other=0.0)
            w = tl.reshape(tl.reshape(w.to(tl.float32), (BLOCK_N, GROUPS, 128)) * ws[:, :, None], (BLOCK_N, BLOCK_K))
            x = _scaled_activations(x, tl.full((GROUPS,), 1.0, tl.float32), QUANTIZE_X, BLOCK_M, GROUPS)
        else:
            ws = tl.load(ws_ptr + (n_start // 128) * ws_stride + kg, mask=kg < k_groups, other=0.0)
            x = _scaled_activations(x, ws, QUANTIZE_X, BLOCK_M, GROUPS)
        acc += _mma(w, tl.trans(x), DOT_F32)
    live = n_live[:, None] & m_live[None, :]
    part = part_ptr + m[None, :] * part_stride + n[:, None]
    arrival = arrivals_ptr + tile * tl.num_programs(1) + m_tile
    out = out_ptr + m[None, :] * out_stride + n[:, None]
    _write_output(acc, out, part, live, split, splits, part_split_stride, arrival, SPLIT)


@triton.jit(
    do_not_specialize=[
        "ws_stride",
        "out_stride",
        "part_split_stride",
        "part_stride",
        "rows_per_group",
        "chunks_per_split",
        "splits",
        "early_chunks",
    ]
)
def _fp8_gemv_kernel(
    x_ptr,
    x_stride,
    up_ptr,
    up_stride,
    limit,
    w_ptr,
    w_stride,
    ws_ptr,
    ws_stride,
    out_ptr,
    out_stride,
    part_ptr,
    part_split_stride,
    part_stride,
    arrivals_ptr,
    rows_per_group,
    K,
    chunks_per_split,
    splits,
    early_chunks,
    norm_ptr,
    norm_eps,
    QUANTIZE_X: tl.constexpr,
    SWIGLU: tl.constexpr,
    NORM: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WARPS: tl.constexpr,
    RUN: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_N output rows of one group x one row of x x one split of the K chunks, by FMA. Each warp
    owns BLOCK_N / WARPS rows; a lane reads RUN contiguous columns of each (x's width a thread, so that the weight
    and the activations share a layout: no layout change between them) and keeps one fp32 sum a row and run: the
    lanes' sums meet once, after the last chunk, inside the warp. STAGES > 1: the chunks' loads run ahead by async
    copies through shared memory (programs on an SM then load and multiply at once, instead of all waiting, then
    all computing); 1: straight into registers, with PREFETCH the next chunk's weights loaded before this chunk's
    products (two chunks in registers: a warp's loads stay in flight while it multiplies). Rows past the group's
    end read its last row and are stored nowhere, so no weight load is masked by row. Scales and SwiGLU as
    _fp8_linear_kernel. NORM: x's row is RMS-normalised (weight norm_ptr, fp32) and rounded to its dtype as it is
    loaded, as rms_norm would store it; each program sums the whole row's squares first (K values, from L2).
    PDL (launched early, see launches_dependents_early): the weights of this program's first `early_chunks` chunks
    are asked into L2 before it waits for the previous launch to end (x is its output), and the next launch may
    start as soon as every program of this one has."""
    ROWS: tl.constexpr = BLOCK_N // WARPS
    GROUPS: tl.constexpr = BLOCK_K // 128
    RUNS: tl.constexpr = BLOCK_K // RUN
    tile, row, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_per_group = tl.cdiv(rows_per_group, BLOCK_N)
    group = tile // tiles_per_group
    n_local = (tile % tiles_per_group) * BLOCK_N + tl.arange(0, WARPS)[:, None, None] * ROWS
    n_local += tl.arange(0, ROWS)[None, :, None]
    n_live = n_local < rows_per_group
    n = group * rows_per_group + tl.minimum(n_local, rows_per_group - 1)
    w_rows = w_ptr + n.to(tl.int64) * w_stride
    col = tl.arange(0, BLOCK_K)[None, None, :]
    w_col = col // RUN * RUN + col % RUN  # loads of RUN bytes, x's run a thread: the layout Triton gives x
    x_row = x_ptr + row * x_stride + group * K + tl.zeros((WARPS, 1, 1), tl.int32)  # each warp reads x itself
    k_groups = tl.cdiv(K, 128)
    scale_row = (group * rows_per_group + (tile % tiles_per_group) * BLOCK_N) // 128
    chunk_start = split * chunks_per_split
    chunk_end = tl.minimum(chunk_start + chunks_per_split, tl.cdiv(K, BLOCK_K))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        lines = tl.arange(0, BLOCK_K // 128)[None, None, :] * 128  # a 128-byte line of e4m3 weights each
        for chunk in range(chunk_start, tl.minimum(chunk_start + early_chunks, chunk_end)):
            prefetch_to_l2(w_rows + tl.minimum(chunk * BLOCK_K + lines, K - 1))
        tl.extra.cuda.gdc_wait()
    if NORM:  # the row's inverse RMS, a scalar: a value in x's layout would move its tiles through shared memory
        row_start = x_ptr + row * x_stride + group * K
        squares = tl.zeros((BLOCK_K,), tl.float32)
        for start in range(0, K, BLOCK_K):
            at = start + tl.arange(0, BLOCK_K)
            v = tl.load(row_start + at, mask=at < K, other=0.0).to(tl.float32)
            squares += v * v
        inverse = inverse_rms(tl.sum(squares, axis=0), K, norm_eps)
    acc = tl.zeros((WARPS, ROWS, RUNS), dtype=tl.float32)
    if PREFETCH:
        w_next = tl.load(w_rows + chunk_start * BLOCK_K + w_col, mask=chunk_start * BLOCK_K + col < K, other=0.0)
    for chunk in tl.range(chunk_start, chunk_end, num_stages=STAGES):
        k = chunk * BLOCK_K + col
        k_live = k < K
        kg = chunk * GROUPS + tl.arange(0, GROUPS)
        if PREFETCH:
            w = w_next
            ahead = (k + BLOCK_K < K) & (chunk + 1 < chunk_end)
            w_next = tl.load(w_rows + (chunk + 1) * BLOCK_K + w_col, mask=ahead, other=0.0)
        else:
            w = tl.load(w_rows + chunk * BLOCK_K + w_col, mask=k_live, other=0.0)
        x = tl.load(x_row + k, mask=k_live, other=0.0).to(tl.float32)
        if SWIGLU:
            up_row = up_ptr + row * up_stride + tl.zeros((WARPS, 1, 1), tl.int32)
            x = _swiglu_input(x, up_row + k, k_live, limit, x_ptr.dtype.element_ty)
        if NORM:
            norm_weight = tl.load(norm_ptr + tl.zeros((WARPS, 1, 1), tl.int32) + k, mask=k_live, other=0.0)
            x = rounded(x * inverse * norm_weight, x_ptr.dtype.element_ty)
        if ROW_SCALES:
            ws = tl.full((GROUPS,), 1.0, tl.float32)
        else:
            ws = tl.load(ws_ptr + scale_row * ws_stride + kg, mask=kg < k_groups, other=0.0)
        x = tl.reshape(_scaled_activations(tl.reshape(x, (WARPS, BLOCK_K)), ws, QUANTIZE_X, WARPS, GROUPS), x.shape)
        runs = tl.sum(tl.reshape(w.to(tl.float32) * x, (WARPS, ROWS, RUNS, RUN)), axis=3)
        if ROW_SCALES:  # a run lies inside one 128-column group: its row's scale for that group multiplies its sum
            run_group = (chunk * BLOCK_K + tl.arange(0, RUNS) * RUN) // 128
            ws_runs = tl.load(
                ws_ptr + (n // 128) * ws_stride + run_group[None, None, :], mask=run_group < k_groups, other=0.0
            )
            runs *= ws_runs
        acc += runs
    total = tl.sum(acc, axis=2)
    n_out = tl.reshape(group * rows_per_group + n_local, (WARPS, ROWS))
    live = tl.reshape(n_live, (WARPS, ROWS))
    part = part_ptr + row * part_stride + n_out
    arrival = arrivals_ptr + tile * tl.num_programs(1) + row
    out = out_ptr + row * out_stride + n_out
    _write_output(total, out, part, live, split, splits, part_split_stride, arrival, SPLIT)


@dataclass(frozen=True)
class LinearPlan:
    """Launch settings of the Triton kernel for one problem shape."""

    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    splits: int
    chunks_per_split: int
    num_stages: int
    num_warps: int
    prefetch: bool = False


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device` (opt-in maximum; generous for the interpreter)."""
    if device.type != "cuda":
        return 227 << 10
    index = cuda_index(device)
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def linear_plan(
    m: int,
    rows_per_group: int,
    groups: int,
    k: int,
    x_bytes: int,
    sms: int,
    smem: int,
    tiles: TileSettings | None = None,
    use_dot: bool | None = None,
) -> LinearPlan:
    """Tiles from TILE_TABLE's row for this M (`tiles` / `use_dot` override it for the sweep), narrowed to the
    problem and to the device: pipeline stages as many as a program's shared memory (`smem` bytes) holds (with
    tl.dot next to the copies of the MMA's operands, bf16, fp32 for fp32 inputs; the K chunk, then the output tile
    narrows until two stages fit); K split until `programs_per_sm` programs per SM are in flight, the partial sums
    kept to a small share of the weight's bytes."""
    row = next((row for row in TILE_TABLE if m <= row[0]), TILE_TABLE[-1])
    use_dot = row[1] if use_dot is None else use_dot
    t = tiles or row[2]
    block_m = min(DOT_MAX_BLOCK_M, max(16, triton.next_power_of_2(m))) if use_dot else 1
    block_n = min(t.block_n, max(16 if use_dot else t.num_warps, triton.next_power_of_2(rows_per_group)))
    block_k = min(t.block_k, max(QUANT_BLOCK, triton.next_power_of_2(k)))
    while True:
        if use_dot:
            stage = block_k * block_n + block_m * block_k * x_bytes
            operands = max(2, x_bytes) * block_k * (block_n + block_m)  # fp32 inputs: fp32 MMA
        else:  # each warp copies x's chunk
            stage, operands = block_k * block_n + t.num_warps * block_k * x_bytes, 0
        stages = min(t.max_stages, (smem - SMEM_RESERVE - operands) // stage)
        if stages >= min(2, t.max_stages) or block_n <= 16:
            break
        if block_k > QUANT_BLOCK:
            block_k //= 2
        else:
            block_n //= 2
    tile_count = triton.cdiv(rows_per_group, block_n) * groups * triton.cdiv(m, block_m)
    chunks = triton.cdiv(k, block_k)
    partial_cap = max(1, k // (PARTIAL_SHARE * 4 * block_m))  # partial bytes 4*splits*M*N <= weight bytes N*K / share
    splits = max(1, min(triton.cdiv(t.programs_per_sm * sms, tile_count), chunks, partial_cap))
    if tile_count > ARRIVAL_COUNTERS:  # one counter an output tile
        splits = 1
    per_split = triton.cdiv(chunks, splits)
    stages = max(1, stages)
    prefetch = t.prefetch and not use_dot and stages == 1
    return LinearPlan(
        use_dot, block_m, block_n, block_k, triton.cdiv(chunks, per_split), per_split, stages, t.num_warps, prefetch
    )


def fma_weight_run(plan: LinearPlan, x_bytes: int) -> int:
    """Columns a lane of the FMA kernel reads a row (contiguous): as many as Triton gives a thread of x's chunk
    (16 bytes, fewer where the chunk has fewer columns than 16 bytes a lane), so the weight tile gets x's layout
    and the product needs no layout change (which moved the whole tile through shared memory)."""
    return max(1, min(16 // x_bytes, plan.block_k // 32))


def chunks_asked_early(plan: LinearPlan, grid: tuple[int, int, int], budget: int) -> int:
    """K chunks of its weights each program of the M = 1 kernel asks into L2 before the previous launch ends: as many
    as its split has, all programs' together at most `budget` bytes (early_prefetch_bytes)."""
    chunk_bytes = plan.block_n * plan.block_k * grid[0] * grid[1] * grid[2]
    return min(plan.chunks_per_split, budget // chunk_bytes)


def _triton(x, weight, scale, groups, quantize_x, out_dtype, plan: LinearPlan | None, up=None, limit=0.0, norm=None):
    m = x.shape[0]
    n, k = weight.shape
    rows = n // groups
    if plan is None:
        plan = linear_plan(m, rows, groups, k, x.element_size(), num_sms(x.device), shared_memory_per_block(x.device))
    if norm is not None and plan.use_dot:  # only the M = 1 kernel normalises as it loads
        x, norm = rms_norm(x, *norm), None
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    split = plan.splits > 1
    part = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device) if split else out
    row_scales = QUANT_BLOCK % plan.block_n != 0 or (groups > 1 and rows % QUANT_BLOCK != 0)
    grid = (triton.cdiv(rows, plan.block_n) * groups, triton.cdiv(m, plan.block_m), plan.splits)
    args = [
        x,
        x.stride(0),
        up if up is not None else x,
        up.stride(0) if up is not None else 0,
        float(limit),
        weight,
        weight.stride(0),
        scale,
        scale.stride(0),
        out,
        out.stride(0),
        part,
        part.stride(0) if split else 0,
        part.stride(1) if split else 0,
        arrival_counters(x.device) if split else out,
    ]
    common = dict(QUANTIZE_X=quantize_x, SWIGLU=up is not None, ROW_SCALES=row_scales, SPLIT=split)
    launch = dict(num_warps=plan.num_warps, num_stages=plan.num_stages)
    pdl = launches_dependents_early(x.device)
    if plan.use_dot:
        dot_f32 = interpreting() or x.dtype == torch.float32
        _fp8_linear_kernel[grid](
            *args,
            m,
            rows,
            k,
            plan.chunks_per_split,
            plan.splits,
            **common,
            DOT_F32=dot_f32,
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k,
            PDL=pdl,
            launch_pdl=pdl,
            **launch,
        )
    else:
        run = fma_weight_run(plan, x.element_size())
        _fp8_gemv_kernel[grid](
            *args,
            rows,
            k,
            plan.chunks_per_split,
            plan.splits,
            chunks_asked_early(plan, grid, early_prefetch_bytes(x.device)) if pdl else 0,
            norm[0] if norm is not None else x,
            norm[1] if norm is not None else 0.0,
            **common,
            NORM=norm is not None,
            BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k,
            WARPS=plan.num_warps,
            RUN=run,
            STAGES=plan.num_stages,
            PREFETCH=plan.prefetch,
            PDL=pdl,
            launch_pdl=pdl,
            **launch,
        )
    return out


def act_quant_triton(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant on the device: (float8_e4m3fn [rows, K], fp32 scales [rows, K/128] stored K-group-major, the
    layout cuBLAS takes for 1x128 blocks). Rows past x's (up to `rows`, default x's) quantise to zero."""
    m, k = x.shape
    rows = rows or m
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    groups = triton.cdiv(k, QUANT_BLOCK)
    scale_t = torch.empty(groups, rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, ACT_QUANT_ROWS), groups)
    pdl = launches_dependents_early(x.device)
    _act_quant_kernel[grid](
        x, x.stride(0), q, q.stride(0), scale_t, scale_t.stride(0), m, rows, k, ROWS=ACT_QUANT_ROWS, PDL=pdl,
        launch_pdl=pdl,
    )  # fmt: skip
    return q, scale_t.t()


def _cublas_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant of x [M, K] for torch._scaled_mm: cuBLAS refuses some row counts (M = 1 among them), and zero rows
    up to a multiple of CUBLAS_ROWS cost nothing."""
    return act_quant_triton(x, triton.cdiv(x.shape[0], CUBLAS_ROWS) * CUBLAS_ROWS)


def _cublas(x, weight, scale, groups, quantize_x, out_dtype) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    if not quantize_x:
        w = _dequantize_aligned(weight, scale, x.dtype).view(groups, n // groups, k)
        out = torch.empty(m, groups, n // groups, dtype=x.dtype, device=x.device)
        # Batched over groups, written in place as [m, g, r] (cuBLAS takes the strides): no permuting copy after.
        torch.bmm(x.view(m, groups, k).transpose(0, 1), w.transpose(1, 2), out=out.transpose(0, 1))
        return out.view(m, n).to(out_dtype)
    if not has_blockwise_fp8_gemm(x.device):
        # Both operands dequantised (exact in bf16: e4m3 values times powers of two) and a bf16 GEMM into fp32: the
        # same products, summed in fp32, rounded once; in pieces of rows that keep the fp32 temporaries small.
        q, s = act_quant_triton(x)
        w = _dequantize_aligned(weight, scale, torch.bfloat16).t()
        out = torch.empty(m, n, dtype=out_dtype, device=x.device)
        piece = max(1, DEQUANTIZED_PIECE_BYTES // (4 * max(n, k)))
        for r in range(0, m, piece):
            rows = slice(r, r + piece)
            xq = (q[rows].float().view(-1, k // QUANT_BLOCK, QUANT_BLOCK) * s[rows, :, None]).view(-1, k)
            out[rows] = torch.mm(xq.to(torch.bfloat16), w, out_dtype=torch.float32)
        return out
    q, s = _cublas_act_quant(x)
    return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.t(), out_dtype=out_dtype)[:m]


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, s_stride, out_ptr, N, K, ROWS: tl.constexpr, COLS: tl.constexpr):
    """One program: ROWS x COLS weights (whole 128 x 128 blocks of rows, COLS a multiple of 128) times their
    block's scale, in out's dtype."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (rows < N)[:, None] & (cols < K)[None, :]
    at = rows.to(tl.int64)[:, None] * K + cols[None, :]
    scale = tl.load(s_ptr + (rows // 128)[:, None] * s_stride + (cols // 128)[None, :], mask=ok, other=0.0)
    w = tl.load(w_ptr + at, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (w * scale).to(out_ptr.dtype.element_ty), mask=ok)


def _dequantize_aligned(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_weight for whole 128 x 128 blocks (contiguous weight) in one pass, in `dtype` (e4m3 times a power
    of two is exact in bf16)."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    cols = min(DEQUANTIZE_COLS, k)
    grid = (triton.cdiv(n, DEQUANTIZE_ROWS), triton.cdiv(k, cols))
    _dequantize_kernel[grid](weight, scale, scale.stride(0), out, n, k, ROWS=DEQUANTIZE_ROWS, COLS=cols)
    return out


def cublas_fits(m: int, n: int, k: int, groups: int, quantize_x: bool) -> bool:
    """cuBLAS takes whole 128 x 128 weight blocks of one group at any M; without act_quant, above
    CUBLAS_MIN_M_DEQUANTIZED rows, whole blocks run as a bf16 GEMM over the dequantised weight."""
    aligned = (n // groups) % QUANT_BLOCK == 0 and k % QUANT_BLOCK == 0
    if not quantize_x:
        return aligned and m > CUBLAS_MIN_M_DEQUANTIZED
    return aligned and groups == 1


def prefers_triton(m: int, n: int, k: int, groups: int, quantize_x: bool, blockwise: bool = True) -> bool:
    """`auto` on CUDA: the Triton kernel where cuBLAS does not fit or TRITON_UP_TO says it is faster; where the
    device has no blockwise FP8 GEMM (`blockwise` False: cuBLAS then dequantises the weight per call, three times its
    bytes moved), also up to TRITON_WITHOUT_BLOCKWISE_UP_TO rows whatever the weight."""
    if not cublas_fits(m, n, k, groups, quantize_x) or (not blockwise and m <= TRITON_WITHOUT_BLOCKWISE_UP_TO):
        return True
    return any(m <= rows and n * k <= weight_bytes for rows, weight_bytes in TRITON_UP_TO)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [M, K] rows with contiguous columns (a row slice of a wider buffer stays where it is)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    groups: int = 1,
    quantize_x: bool = True,
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
    plan: LinearPlan | None = None,
    swiglu_up: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """x [..., G*K] -> [..., G*R]; weight float8_e4m3fn [G*R, K]; scale fp32 [ceil(G*R/128), ceil(K/128)].

    impl: "auto" (on CUDA the Triton kernel or cuBLAS as `prefers_triton` says; the reference elsewhere),
    "triton" (the Triton kernel at any M; CPU under TRITON_INTERPRET=1), "cublas" or "torch". plan: override
    the Triton kernel's launch plan (tests run the small-shared-memory plan with it). swiglu_up: x is a gate and
    this its up ([..., K] each, one group): the input is swiglu(x, up, swiglu_limit) in x's dtype, computed as the
    Triton kernel loads it (before cuBLAS, a launch of its own). norm: (fp32 weight [K], eps): the input is
    rms_norm(x, weight, eps) in x's dtype (one group), computed as the M = 1 kernel loads it (else rms_norm first).
    """
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
        raise TypeError(f"fp8_linear: weight {weight.dtype} / scale {scale.dtype}; expected float8_e4m3fn / float32")
    if n % groups or x.shape[-1] != groups * k:
        raise ValueError(
            f"fp8_linear: x [..., {x.shape[-1]}] does not match {groups} groups of weight {list(weight.shape)}"
        )
    if tuple(scale.shape) != (-(-n // QUANT_BLOCK), -(-k // QUANT_BLOCK)):
        raise ValueError(f"fp8_linear: scale {list(scale.shape)} does not fit weight {list(weight.shape)}")
    if swiglu_up is not None and (groups != 1 or swiglu_up.shape != x.shape):
        raise ValueError(f"fp8_linear: a SwiGLU input takes one group and up like x, got {list(swiglu_up.shape)}")
    if norm is not None and (groups != 1 or swiglu_up is not None or norm[0].shape != (k,)):
        raise ValueError(f"fp8_linear: a normalised input takes one group, no SwiGLU and a weight of {k}")
    lead = x.shape[:-1]
    x2 = _rows(x)
    up2 = _rows(swiglu_up) if swiglu_up is not None else None
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    if impl == "auto":
        if not x.is_cuda:
            impl = "torch"
        else:
            blockwise = has_blockwise_fp8_gemm(x.device)
            impl = "triton" if prefers_triton(m, n, k, groups, quantize_x, blockwise) else "cublas"
    if up2 is not None and impl == "cublas":  # the SwiGLU first: cuBLAS and the reference take plain rows
        x2, up2 = swiglu_to(x2, up2, swiglu_limit, x.dtype), None
    elif up2 is not None and impl == "torch":
        x2, up2 = swiglu(x2, up2, swiglu_limit).to(x.dtype), None
    if norm is not None and impl != "triton":
        x2, norm = rms_norm(x2, *norm), None
    if impl == "torch":
        y = fp8_linear_reference(x2, weight, scale, groups, quantize_x, out_dtype)
    elif m == 0:
        y = torch.empty(0, n, dtype=out_dtype, device=x.device)
    elif impl == "triton":
        y = _triton(x2, weight, scale, groups, quantize_x, out_dtype, plan, up2, swiglu_limit, norm)
    elif impl == "cublas":
        if not cublas_fits(CUBLAS_MIN_M_DEQUANTIZED + 1, n, k, groups, quantize_x):
            raise ValueError(f"fp8_linear: cuBLAS needs one group of whole 128x128 blocks, got {groups} x {[n, k]}")
        y = _cublas(x2.contiguous(), weight, scale, groups, quantize_x, out_dtype)
    else:
        raise ValueError(f"impl must be 'auto', 'triton', 'cublas' or 'torch', got {impl!r}")
    return y.reshape(*lead, n)
