"""FP8 KV-cache simulation: e4m3 with one power-of-two (ue8m0) scale per block of channels.

Quantise then dequantise, as the official reference does on attention KV (its non-RoPE channels) and
on compressed entries, so a dequantised store holds exactly what an fp8 store would give back.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
KV_QUANT_BLOCK = 64
_AMAX_FLOOR = 1e-4


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0, fp32): the ue8m0 scale rounding."""
    mantissa, exponent = torch.frexp(x)
    # frexp gives x = m * 2^e with m in [0.5, 1); an exact power of two has m == 0.5.
    return torch.ldexp(torch.ones_like(x), torch.where(mantissa == 0.5, exponent - 1, exponent))


def fp8_quant_dequant(x: torch.Tensor, block: int = KV_QUANT_BLOCK) -> torch.Tensor:
    """Round x's last dim through e4m3 in blocks of `block` channels; returns x's dtype."""
    if x.shape[-1] % block:
        raise ValueError(f"fp8 KV quantisation needs a channel count divisible by {block}, got {x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, block))
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(_AMAX_FLOOR)
    scale = pow2_ceil(amax / E4M3_MAX)
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)
