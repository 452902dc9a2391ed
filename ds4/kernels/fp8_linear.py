"""FP8 block-scaled linear, as the official reference's act_quant + fp8_gemm: y = act_quant(x) @ dequant(w).T.

Weight: float8_e4m3fn [N, K] and one power-of-two fp32 scale per 128 x 128 block, [ceil(N/128), ceil(K/128)].
Activations (act_quant): per row and 128-column group, amax = max |x| floored at 1e-4, scale =
2^ceil(log2(amax * fp32(1/448))), values clamp(x / scale, -448, 448) rounded to e4m3 (nearest, ties to even).
A product of two e4m3 values is exact in fp32, so the spec is: dequantise both operands, matmul in fp32.

Grouped projections (the attention's wo_a): x [M, G*K] holds G groups of K columns and the weight [G*R, K]
R output rows per group; outputs of group g read only inputs of group g. The reference multiplies wo_a in
bf16 without act_quant; `quantize_x=False` is that: x (unrounded) times the dequantised weight.

On CUDA, whole 128 x 128 blocks run cuBLAS (torch._scaled_mm, 1x128 activation blocks x 128x128 weight blocks)
after a Triton act_quant, rows padded to a multiple of 16; other shapes run a Triton split-K kernel that
quantises its activations on the fly, reads each weight byte once, and sums its K-splits in a fixed order
(`ds4 bench linear` times both at every M). Without act_quant, large M dequantises the weight per call and
multiplies in bf16, as the reference does; small M runs the split-K kernel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4.kernels._device import interpreting, num_sms
from ds4.kernels.fp8_kv import pow2_ceil

QUANT_BLOCK = 128  # activation groups and weight blocks are 128 wide along K (and weight blocks 128 tall)
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4

# ---- chosen settings (the sweep lives in `ds4 bench linear`) ----
CUBLAS_MIN_M = 0  # above this many rows cuBLAS (blockwise FP8) beats the split-K kernel (H200: at every M)
CUBLAS_MIN_M_DEQUANTIZED = 128  # without act_quant, dequantising the weight per call pays off above this
CUBLAS_ROWS = 16  # rows padded to a multiple of this for cuBLAS
GEMV_BLOCK_N = 128  # output rows a program reads
GEMV_WAVES = 4  # split K until the grid fills this many programs per SM (bandwidth needs several in flight)
GEMV_MIN_K_BLOCKS = 2  # K blocks of 128 a split keeps at least
GEMV_MAX_STAGES = 4
SMEM_RESERVE = 8 << 10  # shared memory left to the compiler's own scratch (barriers, the epilogue)
ACT_QUANT_ROWS = 32  # rows an act_quant program quantises


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
    q = tl.clamp(x / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _mma(a, b, DOT_F32: tl.constexpr):
    """a @ b in fp32: bf16 operands (exact for e4m3 and bf16 values), or full fp32 ones when DOT_F32."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit(do_not_specialize=["M", "M_OUT", "K"])
def _act_quant_kernel(x_ptr, x_stride, q_ptr, q_stride, scale_ptr, scale_stride, M, M_OUT, K, ROWS: tl.constexpr):
    """One program: ROWS rows x one 128-column group; scales are written K-group-major ([K/128, M_OUT]).
    Output rows M..M_OUT-1 (padding) quantise zeros."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    out = (rows[:, None] < M_OUT) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=out & (rows[:, None] < M), other=0.0)
    q, scale = _quantize_group(x.to(tl.float32))
    tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :], q, mask=out)
    tl.store(scale_ptr + tl.program_id(1) * scale_stride + rows, scale, mask=rows < M_OUT)


@triton.jit(do_not_specialize=["M", "rows_per_group", "k_per_group", "k_blocks_per_split"])
def _gemv_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    w_stride,
    ws_ptr,
    ws_stride,
    part_ptr,
    part_split_stride,
    part_stride,
    M,
    rows_per_group,
    k_per_group,
    k_blocks_per_split,
    QUANTIZE_X: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One program: BLOCK_N output rows of one group, all M rows of x, one split of the K blocks; fp32 partial
    sums to part[split]. Operands go to the MMA as bf16, exact for e4m3 values and bf16 inputs; DOT_F32 (fp32
    inputs, or the interpreter, whose bf16 dot is wrong) multiplies in full fp32."""
    n_tile, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_local = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_live = n_local < rows_per_group
    n = group * rows_per_group + n_local
    m = tl.arange(0, BLOCK_M)
    m_live = m < M
    k_blocks = tl.cdiv(k_per_group, 128)
    kb_start = split * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, k_blocks)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_start, kb_end):
        k = kb * 128 + tl.arange(0, 128)
        k_live = k < k_per_group
        x = tl.load(
            x_ptr + m[:, None] * x_stride + group * k_per_group + k[None, :],
            mask=m_live[:, None] & k_live[None, :],
            other=0.0,
        )
        w = tl.load(w_ptr + n[None, :] * w_stride + k[:, None], mask=n_live[None, :] & k_live[:, None], other=0.0)
        w_scale = tl.load(ws_ptr + (n // 128) * ws_stride + kb, mask=n_live, other=0.0)
        if QUANTIZE_X:
            q, x_scale = _quantize_group(x.to(tl.float32))
            acc += _mma(q, w, DOT_F32) * (x_scale[:, None] * w_scale[None, :])
        else:
            acc += _mma(x, w, DOT_F32) * w_scale[None, :]
    out = part_ptr + split * part_split_stride + m[:, None] * part_stride + n[None, :]
    tl.store(out, acc, mask=m_live[:, None] & n_live[None, :])


@dataclass(frozen=True)
class GemvPlan:
    """Launch settings of the split-K kernel for one problem shape."""

    block_m: int
    block_n: int
    splits: int
    k_blocks_per_split: int
    num_stages: int
    num_warps: int


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on `device` (opt-in maximum; generous for the interpreter)."""
    if device.type != "cuda":
        return 227 << 10
    index = device.index if device.index is not None else torch.cuda.current_device()
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def gemv_plan(m: int, rows_per_group: int, groups: int, k: int, x_bytes: int, sms: int, smem: int) -> GemvPlan:
    """Tiles from the device: pipeline stages as many as a program's shared memory (`smem` bytes) holds next to
    the bf16 copies of its operands that the MMA reads (the output tile narrows until two stages fit), and K
    split until GEMV_WAVES programs per SM are in flight."""
    block_m = max(16, triton.next_power_of_2(m))
    block_n = min(GEMV_BLOCK_N, max(16, triton.next_power_of_2(rows_per_group)))
    while True:
        stage = QUANT_BLOCK * block_n + block_m * QUANT_BLOCK * x_bytes
        operands = 2 * QUANT_BLOCK * (block_n + block_m)
        stages = min(GEMV_MAX_STAGES, (smem - SMEM_RESERVE - operands) // stage)
        if stages >= 2 or block_n <= 32:
            break
        block_n //= 2
    tiles = triton.cdiv(rows_per_group, block_n) * groups
    k_blocks = triton.cdiv(k, QUANT_BLOCK)
    splits = max(1, min(triton.cdiv(GEMV_WAVES * sms, tiles), k_blocks // GEMV_MIN_K_BLOCKS))
    per_split = triton.cdiv(k_blocks, splits)
    splits = triton.cdiv(k_blocks, per_split)
    return GemvPlan(block_m, block_n, splits, per_split, max(1, stages), 4)


def _gemv(x, weight, scale, groups, quantize_x, out_dtype, plan: GemvPlan | None) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    rows = n // groups
    if plan is None:
        plan = gemv_plan(m, rows, groups, k, x.element_size(), num_sms(x.device), shared_memory_per_block(x.device))
    part = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, plan.block_n), plan.splits, groups)
    _gemv_kernel[grid](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        scale,
        scale.stride(0),
        part,
        part.stride(0),
        part.stride(1),
        m,
        rows,
        k,
        plan.k_blocks_per_split,
        QUANTIZE_X=quantize_x,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        DOT_F32=interpreting() or x.dtype == torch.float32,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return (part[0] if plan.splits == 1 else part.sum(0)).to(out_dtype)


def act_quant_triton(x: torch.Tensor, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant on the device: (float8_e4m3fn [rows, K], fp32 scales [rows, K/128] stored K-group-major, the
    layout cuBLAS takes for 1x128 blocks). Rows past x's (up to `rows`, default x's) quantise to zero."""
    m, k = x.shape
    rows = rows or m
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    groups = triton.cdiv(k, QUANT_BLOCK)
    scale_t = torch.empty(groups, rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, ACT_QUANT_ROWS), groups)
    _act_quant_kernel[grid](x, x.stride(0), q, q.stride(0), scale_t, scale_t.stride(0), m, rows, k, ROWS=ACT_QUANT_ROWS)
    return q, scale_t.t()


def _cublas(x, weight, scale, groups, quantize_x, out_dtype) -> torch.Tensor:
    m = x.shape[0]
    n, k = weight.shape
    if not quantize_x:
        w = _dequantize_aligned(weight, scale, x.dtype).view(groups, n // groups, k)
        return torch.einsum("mgk,grk->mgr", x.view(m, groups, k), w).reshape(m, n).to(out_dtype)
    # cuBLAS refuses some row counts (M = 1 among them); zero rows up to a multiple of CUBLAS_ROWS cost nothing.
    q, s = act_quant_triton(x, triton.cdiv(m, CUBLAS_ROWS) * CUBLAS_ROWS)
    return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale.t(), out_dtype=out_dtype)[:m]


def _dequantize_aligned(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_weight for whole 128 x 128 blocks in two elementwise passes (e4m3 times a power of two is exact
    in bf16)."""
    n, k = weight.shape
    blocks = weight.to(dtype).view(n // QUANT_BLOCK, QUANT_BLOCK, k // QUANT_BLOCK, QUANT_BLOCK)
    return (blocks * scale.to(dtype)[:, None, :, None]).view(n, k)


def cublas_fits(m: int, n: int, k: int, groups: int, quantize_x: bool) -> bool:
    """cuBLAS takes whole 128 x 128 weight blocks of one group at any M; without act_quant, above
    CUBLAS_MIN_M_DEQUANTIZED rows, whole blocks run as a bf16 GEMM over the dequantised weight."""
    aligned = (n // groups) % QUANT_BLOCK == 0 and k % QUANT_BLOCK == 0
    if not quantize_x:
        return aligned and m > CUBLAS_MIN_M_DEQUANTIZED
    return aligned and groups == 1 and m > CUBLAS_MIN_M


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    groups: int = 1,
    quantize_x: bool = True,
    out_dtype: torch.dtype | None = None,
    impl: str = "auto",
    plan: GemvPlan | None = None,
) -> torch.Tensor:
    """x [..., G*K] -> [..., G*R]; weight float8_e4m3fn [G*R, K]; scale fp32 [ceil(G*R/128), ceil(K/128)].

    impl: "auto" (cuBLAS or the split-K kernel on CUDA by M, the reference elsewhere), "triton" (the split-K
    kernel at any M; CPU under TRITON_INTERPRET=1), "cublas" or "torch". plan: override the split-K kernel's
    launch plan (tests run the small-shared-memory plan with it).
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
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out_dtype = out_dtype or x.dtype
    if impl == "auto":
        if not x.is_cuda:
            impl = "torch"
        else:
            impl = "cublas" if cublas_fits(x2.shape[0], n, k, groups, quantize_x) else "triton"
    if impl == "torch":
        y = fp8_linear_reference(x2, weight, scale, groups, quantize_x, out_dtype)
    elif x2.shape[0] == 0:
        y = torch.empty(0, n, dtype=out_dtype, device=x.device)
    elif impl == "triton":
        y = _gemv(x2.contiguous(), weight, scale, groups, quantize_x, out_dtype, plan)
    elif impl == "cublas":
        if not cublas_fits(max(CUBLAS_MIN_M, CUBLAS_MIN_M_DEQUANTIZED) + 1, n, k, groups, quantize_x):
            raise ValueError(f"fp8_linear: cuBLAS needs one group of whole 128x128 blocks, got {groups} x {[n, k]}")
        y = _cublas(x2.contiguous(), weight, scale, groups, quantize_x, out_dtype)
    else:
        raise ValueError(f"impl must be 'auto', 'triton', 'cublas' or 'torch', got {impl!r}")
    return y.reshape(*lead, n)
