"""Routed experts of a MoE layer: clamped SwiGLU per expert, outputs weighted and summed per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (no clamping when limit <= 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [T, D], weights/indices [T, k], w1/w3 [E, I, D], w2 [E, D, I] -> fp32 [T, D].

    The routing weight scales the activation before the down projection, as the reference does.
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w1.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start : start + count]
        start += count
        token, slot = picks // indices.shape[1], picks % indices.shape[1]
        xe = x[token]
        hidden = swiglu(F.linear(xe, w1[expert]), F.linear(xe, w3[expert]), limit)
        hidden = (hidden * weights[token, slot, None].float()).to(x.dtype)
        out.index_add_(0, token, F.linear(hidden, w2[expert]).float())
    return out
