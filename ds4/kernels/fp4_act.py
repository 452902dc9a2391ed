"""MXFP4 activation simulation for the lightning indexer: Hadamard rotation, then e2m1 with ue8m0 block scales.

The official reference rotates the indexer's queries and compressed keys with a normalised Walsh-Hadamard
transform and rounds them through e2m1 (block 32); quantise then dequantise gives the same numbers.
"""

from __future__ import annotations

import functools

import torch

from ds4.kernels.fp8_kv import pow2_ceil

E2M1_MAX = 6.0
FP4_BLOCK = 32
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform over the last dim (a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float32, device=x.device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (x.float() @ h * n**-0.5).to(x.dtype)


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
