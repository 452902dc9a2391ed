"""The compressor's gated pooling: one entry from a window of token projections, a per-channel softmax of their
scores weighting their values.

Windows are rows of flat sources (kv and score [R, width], fp32) named by an index [N, span]. With overlap (CSA)
the window spans two blocks of `ratio` tokens: the first block gives the first half of the channels
(width = 2 * head_dim), the second block the second half. On CUDA one launch reads the rows in place (torch's
path gathers every window into new tensors, splits and joins the halves, then softmax, product and sum).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Chosen settings: channels per program (each program holds span x CHANNEL_BLOCK scores and values).
CHANNEL_BLOCK = 64


def gated_pool_reference(kv: torch.Tensor, score: torch.Tensor, rows: torch.Tensor, overlap: bool) -> torch.Tensor:
    """kv, score [R, width] and window rows [N, span] -> entries [N, head_dim] (width, or width / 2 with overlap)."""
    kv, score = kv[rows], score[rows]
    if overlap:
        d, r = kv.shape[-1] // 2, rows.shape[1] // 2
        kv = torch.cat((kv[:, :r, :d], kv[:, r:, d:]), dim=1)
        score = torch.cat((score[:, :r, :d], score[:, r:, d:]), dim=1)
    return (kv * score.softmax(dim=1)).sum(dim=1)


@triton.jit(do_not_specialize=["span", "head_dim", "kv_stride", "score_stride"])
def _gated_pool_kernel(
    kv_ptr,
    kv_stride,
    score_ptr,
    score_stride,
    rows_ptr,
    out_ptr,
    span,
    head_dim,
    OVERLAP: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SPAN)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row = tl.load(rows_ptr + n * span + j, mask=j < span, other=0)
    col = c[None, :]
    if OVERLAP:
        col += (j >= span // 2).to(tl.int32)[:, None] * head_dim
    ok = (j < span)[:, None] & (c < head_dim)[None, :]
    score = tl.load(score_ptr + row[:, None] * score_stride + col, mask=ok, other=0.0)
    score = tl.where((j < span)[:, None], score, float("-inf"))  # padding rows weigh nothing
    kv = tl.load(kv_ptr + row[:, None] * kv_stride + col, mask=ok, other=0.0)
    e = tl.exp(score - tl.max(score, axis=0)[None, :])
    weight = e / tl.sum(e, axis=0)[None, :]
    tl.store(out_ptr + n * head_dim + c, tl.sum(kv * weight, axis=0), mask=c < head_dim)


def gated_pool_triton(kv: torch.Tensor, score: torch.Tensor, rows: torch.Tensor, overlap: bool) -> torch.Tensor:
    """gated_pool_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    n, span = rows.shape
    width = kv.shape[1]
    head_dim = width // 2 if overlap else width
    if score.shape != kv.shape or kv.stride(1) != 1 or score.stride(1) != 1 or (overlap and span % 2):
        raise ValueError(f"gated_pool: kv {list(kv.shape)}, score {list(score.shape)}, rows {list(rows.shape)}")
    out = torch.empty(n, head_dim, dtype=torch.float32, device=kv.device)
    if n:
        grid = (n, triton.cdiv(head_dim, CHANNEL_BLOCK))
        _gated_pool_kernel[grid](
            kv,
            kv.stride(0),
            score,
            score.stride(0),
            rows.contiguous(),
            out,
            span,
            head_dim,
            OVERLAP=overlap,
            SPAN=triton.next_power_of_2(span),
            BLOCK_C=CHANNEL_BLOCK,
        )
    return out


def gated_pool(kv: torch.Tensor, score: torch.Tensor, rows: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Entries [N, head_dim] (fp32) of the windows `rows` [N, span] of kv and score [R, width]; see the module."""
    if kv.is_cuda:
        return gated_pool_triton(kv, score, rows, overlap)
    return gated_pool_reference(kv, score, rows, overlap)
