"""MXFP4 activation simulation for the lightning indexer: Hadamard rotation, then e2m1 with ue8m0 block scales.

The official reference rotates the indexer's queries and compressed keys with a normalised Walsh-Hadamard
transform and rounds them through e2m1 (block 32); quantise then dequantise gives the same numbers.

The rotation is the constant-geometry butterfly (log2 n rounds of: halves a, b -> interleaved a + b, a - b,
in fp32), the same transform as the Sylvester matrix; the torch reference and the kernel take the same adds
in the same order, so they agree to the bit (a matrix product would leave the order to the BLAS).

`rotate_fp4` is both in one pass (the indexer's `finish` for its compressed keys): on CUDA one Triton launch
(torch's path is some sixty kernels). Its math lives in the @triton.jit helpers below, which the indexer's
query kernel (ds4.kernels.indexer) shares.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early
from ds4.kernels.fp8_kv import pow2_ceil

E2M1_MAX = 6.0
FP4_BLOCK = 32
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Chosen settings: elements of a rotate_fp4 program's tile (rows x the row length). The code is straight-line,
# a program's time about its elements a thread: 4 a thread of the 4 warps, one 8-byte load in the gathers' layout.
ROTATE_TILE = 512


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform over the last dim (a power of two), in fp32; returns x's dtype."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {n}")
    y = x.float()
    for _ in range(n.bit_length() - 1):
        a, b = y[..., : n // 2], y[..., n // 2 :]
        y = torch.stack((a + b, a - b), dim=-1).flatten(-2)
    return (y * n**-0.5).to(x.dtype)


@functools.cache
def _e2m1_grid(device: torch.device) -> torch.Tensor:
    # Made once per device, on the first (eager) call: a host-to-device copy cannot be captured in a CUDA graph.
    return torch.tensor(_E2M1_GRID, device=device)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the even code), for |x| <= 6."""
    grid = _e2m1_grid(x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = x.abs()
    below = torch.bucketize(mag, mids, right=False)
    above = torch.bucketize(mag, mids, right=True)
    code = torch.where((below != above) & (below % 2 == 1), above, below)
    return grid[code] * torch.sign(x)


def fp4_quant_dequant(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Round x's last dim through e2m1 in blocks of `block` channels with power-of-two scales."""
    if x.shape[-1] % block:
        raise ValueError(f"fp4 quantisation needs a channel count divisible by {block}, got {x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126)
    scale = pow2_ceil(amax / E2M1_MAX)
    q = round_to_e2m1((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


def rotate_fp4_reference(x: torch.Tensor) -> torch.Tensor:
    """The indexer's rounding of a vector: Hadamard rotation, then MXFP4 (each in x's dtype, as the reference)."""
    return fp4_quant_dequant(hadamard_rotate(x))


# ----------------------------------------------------------------------------------------------
# Triton: the shared math (exact: bit operations for the power-of-two scales, fp32 adds, IEEE division)
# ----------------------------------------------------------------------------------------------


@triton.jit
def ceil_log2(y):
    """Smallest e with 2^e >= y, for fp32 y > 0 (subnormals too), from the bits."""
    small = y < 1.1754943508222875e-38
    y = tl.where(small, tl.where(small, y, 0.0) * 18446744073709551616.0, y)  # times 2^64 they are normal
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.where(small, e - 64, e)


@triton.jit
def pow2(e):
    """2^e in fp32 for integer e in [-149, 127], built from the bits (exact, subnormals too)."""
    normal = tl.maximum(e, -126)
    return ((normal + 127) << 23).to(tl.float32, bitcast=True) * ((e - normal + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (nearest, ties to even), kept in fp32. bf16 from the bits: Triton's interpreter
    truncates when it casts to bf16, the GPU rounds; this is the GPU's rounding on both."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def hadamard(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """hadamard_rotate of the rows of an fp32 [ROWS, N] tile, in fp32 (the caller rounds to the reference's dtype).

    The reference's rounds with the entries left in place: round i pairs the entries whose indices differ in bit
    LOG_N - 1 - i, the pairs whose a + b and a - b the reference's round i interleaves, so every add is the
    same and the last round leaves each entry where the reference puts it. Each entry takes its partner by a
    gather along the row, which compiles to warp shuffles (a row lies in one warp); the reference's reordering
    of the halves would move the whole tile through shared memory every round."""
    col = tl.arange(0, N)[None, :] + tl.zeros([ROWS, N], tl.int32)
    for i in tl.static_range(LOG_N):
        partner = tl.gather(x, col ^ (N >> (i + 1)), 1)
        x = tl.where((col & (N >> (i + 1))) != 0, partner - x, x + partner)
    return x * (N**-0.5)


@triton.jit
def fp4_round(x, ROWS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """fp4_quant_dequant of the rows of an fp32 [ROWS, N] tile, in fp32 (e2m1 values times powers of two)."""
    blocks = tl.reshape(x, [ROWS, N // BLOCK, BLOCK])
    amax = tl.maximum(tl.max(tl.abs(blocks), axis=2), 6.0 * 1.1754943508222875e-38)
    e = ceil_log2(tl.math.div_rn(amax, 6.0))
    v = tl.abs(tl.minimum(tl.maximum(blocks * pow2(-e)[:, :, None], -6.0), 6.0))
    # nearest e2m1 value, ties to the even code: the midpoints of odd index (0.75, 1.75, 3.5) round up
    q = (
        0.5 * (v > 0.25).to(tl.float32)
        + 0.5 * (v >= 0.75).to(tl.float32)
        + 0.5 * (v > 1.25).to(tl.float32)
        + 0.5 * (v >= 1.75).to(tl.float32)
        + (v > 2.5).to(tl.float32)
        + (v >= 3.5).to(tl.float32)
        + 2.0 * (v > 5.0).to(tl.float32)
    )
    q = q * tl.where(blocks < 0, -1.0, 1.0)  # -0.0 where a negative value rounds to 0, as torch's q * sign
    return tl.reshape(q * pow2(e)[:, :, None], [ROWS, N])


@triton.jit
def rotate_fp4(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, BLOCK: tl.constexpr, dtype: tl.constexpr):
    """rotate_fp4_reference of an fp32 [ROWS, N] tile holding values of `dtype`; fp32 values of `dtype`."""
    x = round_to(hadamard(x, ROWS, N, LOG_N), dtype)
    return round_to(fp4_round(x, ROWS, N, BLOCK), dtype)


@triton.jit(do_not_specialize=["x_row4", "y_row4", "rows"])
def _rotate_fp4_kernel(
    x_ptr,
    x_row4,
    y_ptr,
    y_row4,
    rows,
    N: tl.constexpr,
    LOG_N: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_launch_start(PDL)  # PDL: launched early
    # Strides in 4-element units: rows load and store 4 elements at a time, the layout of the rotation's
    # gathers (wider loads would be converted to it through shared memory, and back for the stores).
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    ok = (r < rows)[:, None]
    d = tl.arange(0, N)[None, :]
    x = tl.load(x_ptr + r[:, None] * (x_row4 * 4) + d, mask=ok, other=0.0).to(tl.float32)
    y = rotate_fp4(x, ROWS, N, LOG_N, BLOCK, y_ptr.dtype.element_ty)
    tl.store(y_ptr + r[:, None] * (y_row4 * 4) + d, y.to(y_ptr.dtype.element_ty), mask=ok)


def rotate_fp4_triton(x: torch.Tensor) -> torch.Tensor:
    """rotate_fp4_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    n = x.shape[-1]
    if n & (n - 1) or n % FP4_BLOCK:
        raise ValueError(f"rotate_fp4: the last dim must be a power of two and a multiple of {FP4_BLOCK}, got {n}")
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1 or rows.stride(0) % 4:  # the kernel takes strides in 4-element units
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        per_program = max(1, ROTATE_TILE // n)
        pdl = launches_dependents_early(x.device)
        _rotate_fp4_kernel[(triton.cdiv(rows.shape[0], per_program),)](
            rows,
            rows.stride(0) // 4,
            y,
            y.stride(0) // 4,
            rows.shape[0],
            N=n,
            LOG_N=n.bit_length() - 1,
            BLOCK=FP4_BLOCK,
            ROWS=per_program,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return y.view(x.shape)


def rotate_fp4_rows(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Hadamard rotation then MXFP4 over x's last dim; impl "triton" (CUDA, or CPU interpreted), "torch" or "auto"."""
    if impl == "auto":
        impl = "triton" if x.is_cuda else "torch"
    if impl == "torch":
        return rotate_fp4_reference(x)
    if impl != "triton":
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    return rotate_fp4_triton(x)
