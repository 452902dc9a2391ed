"""Multi-query attention of each token over its own gathered key set, with a per-head sink.

Keys come from one or more flat pools ([N, D], K = V: one shared KV head); each token lists the rows
it attends to per pool (-1 = no key). The sink adds exp(sink[h]) to the softmax denominator only.
"""

from __future__ import annotations

import torch

# The torch reference gathers keys for a piece of tokens at a time, at most this many bytes of fp32 keys.
_PIECE_BYTES = 1 << 28


def sparse_attention(
    q: torch.Tensor,
    key_sets: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], key_sets [(kv [N_i, D], indices [T, K_i] int, -1 = none)], sink [H] -> [T, H, D] in q's dtype."""
    for kv, idx in key_sets:
        if kv.dim() != 2 or kv.shape[1] != q.shape[2] or idx.shape[0] != q.shape[0]:
            raise ValueError(
                f"sparse_attention: kv {tuple(kv.shape)} / indices {tuple(idx.shape)} do not fit q {tuple(q.shape)}"
            )
    out = torch.empty_like(q)
    keys_per_token = sum(idx.shape[1] for _, idx in key_sets)
    piece = max(1, _PIECE_BYTES // max(1, keys_per_token * q.shape[2] * 4))
    for start in range(0, q.shape[0], piece):
        rows = slice(start, start + piece)
        out[rows] = _attend(q[rows], [(kv, idx[rows]) for kv, idx in key_sets], sink, scale)
    return out


def _attend(q: torch.Tensor, key_sets: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor, scale: float):
    keys = torch.cat([kv[idx.clamp_min(0).long()] for kv, idx in key_sets], dim=1).float()  # [t, K, D]
    valid = torch.cat([idx >= 0 for _, idx in key_sets], dim=1)  # [t, K]
    scores = torch.einsum("thd,tkd->thk", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sink_logit)
    weights = torch.exp(scores - peak)
    denom = weights.sum(dim=-1, keepdim=True) + torch.exp(sink_logit - peak)
    return torch.einsum("thk,tkd->thd", weights / denom, keys).to(q.dtype)
