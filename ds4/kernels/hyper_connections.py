"""Manifold-constrained hyper-connection (mHC) weights: pre / post gates and the Sinkhorn-projected mixing matrix."""

from __future__ import annotations

import torch


def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2 + hc) * hc] (fp32) -> pre [..., hc], post [..., hc], comb [..., hc, hc].

    comb[j, k] weighs input stream j into output stream k; it is made (nearly) doubly stochastic by
    a row softmax followed by alternating column / row normalisation (columns first and last).
    """
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb
