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


def routed_experts_dense(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """routed_experts with fixed shapes and no host sync (CUDA-graph capturable): every expert runs on every
    token and a token keeps only its routed experts' outputs, summed in expert order as routed_experts does.

    Cost: n_experts / experts_per_token times the routed FLOPs, and every expert's weights are read each
    step. For the decode batches it serves, weight reads dominate once a batch routes to most experts
    anyway; at real sizes with small batches a fused grouped kernel over the routed experts is the fix.
    """
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in range(w1.shape[0]):
        chosen = indices == expert
        routed = chosen.any(dim=-1, keepdim=True)
        weight = (weights.float() * chosen).sum(dim=-1, keepdim=True)
        hidden = swiglu(F.linear(x, w1[expert]), F.linear(x, w3[expert]), limit)
        # where, not a multiply by zero: an overflowing activation must not turn into NaN for other tokens' rows.
        hidden = torch.where(routed, hidden * weight, 0.0).to(x.dtype)
        out += F.linear(hidden, w2[expert]).float()
    return out
