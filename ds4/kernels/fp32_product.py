"""x W^T in fp32 from half-precision operands, on tensor cores where they exist.

The product of two bf16 (or fp16) values is exact in fp32, so on CUDA a half-precision GEMM that accumulates into
an fp32 output is x.float() @ W.float().T summed in another order, reading the weight as stored (an fp32 GEMM
runs on FMA units: ~15x slower at prefill). The model's head, the compressor's projections and the router hold
their weights in the compute dtype for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)


def fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K] times weight [M, K] transposed, in fp32 [N, M]."""
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in _HALF and x.dim() == 2:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())
