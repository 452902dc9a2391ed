"""Each row's first index of its largest value, as torch.argmax(dim=-1) gives it (a NaN counts as the largest).

Greedy decoding and every MTP draft take one over the vocabulary (Flash: 129280 logits a row). torch's argmax
reduces a row in one block (H200, batch 1: 28 us); the two-pass form in torch ops this replaces launched eight
kernels a step (an H100's eager profile at batch 1, 4 Flash layers: 27 us together, 16.4 of them its two max
reductions). Here two launches: programs of PART columns each keep their part's (value, first index), then a
program per row reduces the parts, in index order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PART = 2048  # columns a first-pass program reduces
PARTS_BLOCK = 64  # parts the second pass reduces a step
_NO_INDEX = 2**31 - 1


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """[rows, cols] -> int64 [rows]: the spec, and the CPU path."""
    return logits.argmax(dim=-1)


@triton.jit
def _best(values, index, NO_INDEX: tl.constexpr):
    """(largest value, its first index) of a block of (value, index) pairs, as argmax ranks them: a NaN above any
    number (the first NaN's index), equal values to the smallest index. Pairs of index NO_INDEX hold nothing."""
    nan = values != values
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    top = tl.max(tl.where(nan, float("-inf"), values), 0)
    first_nan = tl.min(tl.where(nan, index, NO_INDEX), 0)
    first_top = tl.min(tl.where(values == top, index, NO_INDEX), 0)
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first_top)


@triton.jit(do_not_specialize=["cols", "parts"])
def _part_kernel(x_ptr, stride_x, value_ptr, index_ptr, cols, parts, PART: tl.constexpr, NO_INDEX: tl.constexpr):
    """Program (row, p): the best pair of the row's columns p * PART.. into value / index [row, p]."""
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    columns = part * PART + tl.arange(0, PART)
    inside = columns < cols
    values = tl.load(x_ptr + row * stride_x + columns, mask=inside, other=float("-inf")).to(tl.float32)
    value, index = _best(values, tl.where(inside, columns, NO_INDEX), NO_INDEX)
    tl.store(value_ptr + row * parts + part, value)
    tl.store(index_ptr + row * parts + part, index)


@triton.jit(do_not_specialize=["parts"])
def _row_kernel(value_ptr, index_ptr, out_ptr, parts, BLOCK: tl.constexpr, NO_INDEX: tl.constexpr):
    """Program row: the best of the row's parts, BLOCK at a time; a later block's pair wins only if larger (or the
    first NaN): its indices come after the running pair's."""
    row = tl.program_id(0).to(tl.int64)
    best = tl.full([], float("-inf"), tl.float32)
    first = tl.full([], NO_INDEX, tl.int32)
    for start in range(0, parts, BLOCK):
        p = start + tl.arange(0, BLOCK)
        inside = p < parts
        values = tl.load(value_ptr + row * parts + p, mask=inside, other=float("-inf"))
        value, index = _best(values, tl.load(index_ptr + row * parts + p, mask=inside, other=NO_INDEX), NO_INDEX)
        later_wins = (best == best) & ((value != value) | (value > best) | (first == NO_INDEX))
        best = tl.where(later_wins, value, best)
        first = tl.where(later_wins, index, first)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax_triton(logits: torch.Tensor) -> torch.Tensor:
    """argmax_reference in two launches (CUDA, or the CPU under TRITON_INTERPRET=1); logits [rows, cols], rows
    contiguous."""
    rows, cols = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if cols == 0:
        raise ValueError("argmax of rows without columns")
    parts = triton.cdiv(cols, PART)
    values = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    _part_kernel[(rows, parts)](logits, logits.stride(0), values, indices, cols, parts, PART=PART, NO_INDEX=_NO_INDEX)
    _row_kernel[(rows,)](values, indices, out, parts, BLOCK=PARTS_BLOCK, NO_INDEX=_NO_INDEX)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, cols] -> int64 [rows], each row's first index of its largest value (NaN the largest)."""
    if logits.is_cuda:
        return argmax_triton(logits)
    return argmax_reference(logits)
