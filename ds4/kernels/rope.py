"""Interleaved rotary embedding on the trailing dims of a vector, with optional YaRN frequency interpolation.

DeepSeek-V4 rotates consecutive channel pairs (2i, 2i+1) of the last `rope_dim` channels; the leading
channels are left alone. The inverse rotation (conjugate) undoes it on attention outputs.

On CUDA one launch (torch's path is a dozen elementwise kernels): each program takes a few whole rows (a token's
heads are consecutive rows), copies the leading channels and rotates the pairs with angles computed in fp32
as the reference computes them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Chosen settings: elements of a program's tile (rows x the row length rounded up to a power of two).
ROW_TILE = 4096


def rope_inv_freq(
    rope_dim: int,
    base: float,
    yarn_factor: float | None = None,
    original_max_position: int | None = None,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """Per-pair angular frequency [rope_dim // 2] in fp32; YaRN blends in freq / factor below the slow band."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn_factor is None:
        return freqs
    low, high = _yarn_band(beta_fast, beta_slow, rope_dim, base, original_max_position)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / yarn_factor * (1 - keep) + freqs * keep


def _yarn_band(beta_fast: float, beta_slow: float, dim: int, base: float, max_pos: int) -> tuple[float, float]:
    """Pair indices where the number of rotations over `max_pos` crosses beta_fast and beta_slow."""

    def pair_dim(rotations: float) -> float:
        return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(pair_dim(beta_fast))
    high = math.ceil(pair_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


def apply_rope_reference(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last 2 * len(inv_freq) channels of x [T, ..., D] at positions [T]; returns a new tensor."""
    rope_dim = 2 * inv_freq.numel()
    angles = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    even, odd = rot[..., 0], rot[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated.to(x.dtype)), dim=-1)


@triton.jit
def rotate_pairs(even, odd, angle, SIGN: tl.constexpr):
    """Channel pairs (even, odd) turned by angle (SIGN -1.0: back), in fp32."""
    return turn_pairs(even, odd, tl.cos(angle), SIGN * tl.sin(angle))


@triton.jit
def turn_pairs(even, odd, cos, sin):
    """Channel pairs (even, odd) turned by the angle of cosine cos and sine sin, in fp32."""
    return even * cos - odd * sin, even * sin + odd * cos


@triton.jit
def turn_row_pairs(
    even,
    odd,
    pair,
    positions,
    freq_ptr,
    D,
    SIGN: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Rows of channel pairs (even, odd) fp32 [rows, BLOCK_P] at `positions` [ROWS] (ROWS = rows, or 1: all at one
    position), the pairs numbered `pair` [BLOCK_P] within rows of D channels: the last HALF pairs of a row turned by
    their angles (SIGN -1.0: back), the others as they are. The sines and cosines of the HALF frequencies only,
    tiled over the block (a query head of 512 channels: 32 a row, not 256): the rotated pairs and the block start
    at multiples of HALF."""
    lead = D // 2 - HALF
    is_rope = (pair >= lead) & (pair < D // 2)
    # Pair p >= lead turns by frequency p - lead, i.e. p % HALF.
    angle = positions.to(tl.float32)[:, None] * tl.load(freq_ptr + tl.arange(0, HALF))[None, :]
    tiles: tl.constexpr = (ROWS, BLOCK_P // HALF, HALF)
    cos = tl.reshape(tl.broadcast_to(tl.cos(angle)[:, None, :], tiles), (ROWS, BLOCK_P))
    sin = tl.reshape(tl.broadcast_to(SIGN * tl.sin(angle)[:, None, :], tiles), (ROWS, BLOCK_P))
    turned_even, turned_odd = turn_pairs(even, odd, cos, sin)
    return tl.where(is_rope[None, :], turned_even, even), tl.where(is_rope[None, :], turned_odd, odd)


# D and the strides are the model's (few variants): specialised, so that rows load as wide vectors.
@triton.jit(do_not_specialize=["rows", "heads"])
def _rope_kernel(
    x_ptr,
    x_token_stride,
    x_head_stride,
    pos_ptr,
    freq_ptr,
    y_ptr,
    y_token_stride,
    y_head_stride,
    rows,
    heads,
    D,
    SIGN: tl.constexpr,
    COPY_LEAD: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    r_ok = r < rows
    token, head = r // heads, r % heads
    x_row = x_ptr + (token * x_token_stride + head * x_head_stride)[:, None]
    y_row = y_ptr + (token * y_token_stride + head * y_head_stride)[:, None]
    lead = D - 2 * HALF
    if COPY_LEAD:
        for start in range(0, lead, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)
            ok = r_ok[:, None] & (d < lead)[None, :]
            tl.store(y_row + d[None, :], tl.load(x_row + d[None, :], mask=ok), mask=ok)
    pair = tl.arange(0, HALF)
    angle = tl.load(pos_ptr + token, mask=r_ok, other=0).to(tl.float32)[:, None] * tl.load(freq_ptr + pair)[None, :]
    # The rotated channels in one contiguous load and store, split into pairs in registers.
    channel = lead + tl.arange(0, 2 * HALF)[None, :]
    ok = r_ok[:, None]
    even, odd = tl.split(tl.reshape(tl.load(x_row + channel, mask=ok, other=0.0).to(tl.float32), (ROWS, HALF, 2)))
    even, odd = rotate_pairs(even, odd, angle, SIGN)
    rotated = tl.reshape(tl.join(even, odd), (ROWS, 2 * HALF))
    tl.store(y_row + channel, rotated.to(y_ptr.dtype.element_ty), mask=ok)


def _token_head_strides(x: torch.Tensor) -> tuple[int, int] | None:
    """(token, head) strides of x [T, D] or [T, H, D] with contiguous rows; None for other layouts."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return None
    if x.dim() == 2:
        return x.stride(0), 0
    if x.dim() == 3:
        return x.stride(0), x.stride(1)
    return None


def apply_rope_triton(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """apply_rope_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1); len(inv_freq) must be a
    power of two (32 and 64 in DeepSeek-V4). x [T, D] or [T, H, D] with contiguous rows, read where it is (a row
    slice of a wider buffer too); others through a copy. in_place: x's rotated channels are overwritten (the
    leading ones neither read nor written) and x is returned."""
    half, d, tokens = inv_freq.numel(), x.shape[-1], x.shape[0]
    if half & (half - 1) or 2 * half > d or positions.shape != (tokens,):
        raise ValueError(
            f"apply_rope: {half} frequencies, x {list(x.shape)}, positions {list(positions.shape)} do not fit"
        )
    strides = _token_head_strides(x)
    if strides is None:
        rotated = apply_rope_triton(x.reshape(tokens, -1, d).contiguous(), positions, inv_freq, inverse)
        return x.copy_(rotated.view(x.shape)) if in_place else rotated.view(x.shape)
    heads = x[0].numel() // d if tokens else 1
    y = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_strides = strides if in_place else (heads * d, d if x.dim() == 3 else 0)
    if x.numel():
        block_d = triton.next_power_of_2(d)
        per_program = max(1, ROW_TILE // block_d)
        rows = tokens * heads
        _rope_kernel[(triton.cdiv(rows, per_program),)](
            x,
            *strides,
            positions,
            inv_freq.to(device=x.device, dtype=torch.float32).contiguous(),
            y,
            *y_strides,
            rows,
            heads,
            d,
            SIGN=-1.0 if inverse else 1.0,
            COPY_LEAD=not in_place,
            HALF=half,
            ROWS=per_program,
            BLOCK_D=block_d,
        )
    return y


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Rotate the last 2 * len(inv_freq) channels of x [T, ..., D] at positions [T]; returns a new tensor, or x
    itself rotated with in_place (for a fresh x nothing else reads: the leading channels stay where they are)."""
    half = inv_freq.numel()
    if x.is_cuda and half & (half - 1) == 0:
        return apply_rope_triton(x, positions, inv_freq, inverse, in_place)
    y = apply_rope_reference(x, positions, inv_freq, inverse)
    return x.copy_(y) if in_place else y
