"""Rows whose normalised values are known exactly, for the FP8 entry tests of the kernels that finish entries (CPU
and GPU): rows of +-1 have a mean square of exactly 1, so with eps 0 RMSNorm leaves +-weight, and RoPE at position 0
turns nothing; the weight then carries the values the quantisation must get right."""

import torch


def exact_rows(rows: int, head_dim: int, rope_dim: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [rows, head_dim] of +-1, fp32 weight [head_dim]): per block of 64 non-RoPE channels, in turn, zeros (the
    amax floor), an amax of exactly 448 * 2^-3 (no rounding up of the scale), e4m3 subnormals and the ties between
    them (448 and multiples of 2^-10: scale 1, subnormal steps 2^-9), small values, ties between normal e4m3
    values, then random values over twelve decades; random RoPE channels."""
    nope = head_dim - rope_dim
    blocks = [
        torch.zeros(64),
        torch.linspace(-448, 448, 64) * 2.0**-3,
        torch.cat([torch.tensor([448.0]), 2.0**-10 * torch.arange(63)]),
        2.0**-20 * torch.arange(64),
        torch.tensor([0.5 + 1 / 32, 0.5 + 3 / 32] * 32) * 2.0**-8,
    ]
    while len(blocks) < nope // 64:
        blocks.append(torch.randn(64, generator=g) * 10.0 ** (torch.randint(-6, 6, (1,), generator=g).item()))
    weight = torch.cat(blocks[: nope // 64] + [torch.randn(rope_dim, generator=g)])
    x = torch.randint(0, 2, (rows, head_dim), generator=g).float() * 2 - 1
    return x, weight
