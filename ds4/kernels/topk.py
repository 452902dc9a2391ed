"""Exact top-k indices of fp32 score rows (the lightning indexer's selection): the spec.

`topk_indices(scores, lengths, k)` returns, for every row, the int32 indices of the k largest among
the row's first `lengths[row]` entries, padded with -1 when the row is shorter than k.

Order (shared by the torch reference below and the Triton kernels of ds4/kernels/topk_triton.py):
  * values compare as numbers; -0.0 and +0.0 are equal; NaN ranks above +inf and all NaNs are equal
    (torch.topk also treats NaN as the largest value);
  * equal values are taken lowest index first, so the chosen set never depends on timing;
  * each row lists its chosen indices in ascending order, then the -1s (a fixed order, so
    consumers that sum over the selection get the same bits every run).
`lengths` are clamped to [0, scores.shape[1]]; rows may have any stride (the last dim is contiguous).
"""

from __future__ import annotations

import torch

from ds4.kernels import topk_triton

MAX_K = 2048


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys whose signed order is the top-k order of fp32 values (see the module docstring)."""
    bits = x.float().contiguous().view(torch.int32)
    keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = torch.where(x == 0, torch.zeros_like(keys), keys)
    return torch.where(torch.isnan(x), torch.full_like(keys, 2**31 - 1), keys)


def topk_indices_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Plain torch: a stable descending sort of the order keys, first k kept and put in column order."""
    rows, cols = scores.shape
    lengths = lengths.to(device=scores.device, dtype=torch.int64).clamp(0, cols)
    positions = torch.arange(cols, device=scores.device)
    valid = positions[None, :] < lengths[:, None]
    keys = order_keys(scores).to(torch.int64)
    keys = torch.where(valid, keys, torch.full_like(keys, -(2**40)))
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]
    kept = order.shape[1]
    rank = torch.arange(kept, device=scores.device)
    order = torch.where(rank[None, :] < lengths[:, None], order, torch.full_like(order, cols + 1))
    order = order.sort(dim=1).values  # chosen columns ascending, the unused places last
    out = torch.full((rows, k), -1, dtype=torch.int32, device=scores.device)
    out[:, :kept] = torch.where(order > cols, torch.full_like(order, -1), order).to(torch.int32)
    return out


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int, impl: str = "auto") -> torch.Tensor:
    """int32 [rows, k]: the k largest of scores[row, :lengths[row]] in the canonical order, -1 padded.

    scores: fp32 [rows, cols], last dim contiguous; lengths: integer [rows] (clamped to [0, cols]);
    1 <= k <= 2048. impl: "triton" (CUDA, or CPU tensors under TRITON_INTERPRET=1), "torch", or "auto".
    """
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D fp32 tensor, got {tuple(scores.shape)} {scores.dtype}")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError("scores must be contiguous along its last dim (any row stride is fine)")
    if lengths.shape != (scores.shape[0],):
        raise ValueError(f"lengths must have shape ({scores.shape[0]},), got {tuple(lengths.shape)}")
    if not 1 <= k <= MAX_K:
        raise ValueError(f"k must be in [1, {MAX_K}], got {k}")
    if scores.shape[1] >= 2**31 - 1:
        raise ValueError("rows longer than 2^31 - 2 entries are not supported")
    if impl == "auto":
        impl = "triton" if scores.is_cuda else "torch"
    if impl == "torch":
        return topk_indices_reference(scores, lengths, k)
    if impl == "triton":
        return topk_triton.topk_indices_triton(scores, lengths, k)
    raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
