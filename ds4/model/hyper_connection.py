"""mHC residual streams: collapse hc_mult streams into a sub-layer input, expand its output back, mix the streams."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ds4.kernels.hyper_connections import hc_split_sinkhorn


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Projection of the RMS-normalised flattened streams [T, hc * D] -> [T, fn rows] (fp32)."""
    flat = streams.flatten(1).float()
    return F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hc_pre(streams: torch.Tensor, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """streams [T, hc, D] -> (sub-layer input [T, D], post [T, hc], comb [T, hc, hc])."""
    pre, post, comb = hc_split_sinkhorn(_mixes(streams, fn, norm_eps), scale, base, hc, iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1)
    return collapsed.to(streams.dtype), post, comb


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream k = post[k] * out + sum_j comb[j, k] * streams[j]."""
    mixed = torch.einsum("tjk,tjd->tkd", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_head(streams: torch.Tensor, fn, scale, base, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams [T, hc, D] -> [T, D] with sigmoid weights."""
    pre = torch.sigmoid(_mixes(streams, fn, norm_eps) * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
