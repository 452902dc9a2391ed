"""Interleaved rotary embedding on the trailing dims of a vector, with optional YaRN frequency interpolation.

DeepSeek-V4 rotates consecutive channel pairs (2i, 2i+1) of the last `rope_dim` channels; the leading
channels are left alone. The inverse rotation (conjugate) undoes it on attention outputs.
"""

from __future__ import annotations

import math

import torch


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


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
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
