"""A bias-free linear layer whose weight is filled by load_weights (dequantised to a floating dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class Norm(nn.Module):
    """Holds an RMSNorm weight (fp32, as the reference computes norms)."""

    def __init__(self, dim: int, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device), requires_grad=False)


def fp32_param(*shape: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device), requires_grad=False)
