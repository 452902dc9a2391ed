"""Writes into per-slot rings: row `at` of each ring [slots, rows, width] takes row `last` of the step's values.

The window ring and a compressor's kv and score rings take the step's tokens this way (ds4.model.batch.LayerStep
.ring_writes names the rows). The reference is an index and an index_put per ring; on CUDA one launch writes
every ring of a call (a compressor's two), reading the rows in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early

# Chosen settings: elements (8-byte words where the rows allow) of a row a program copies.
ROW_BLOCK = 1024

Ring = tuple[torch.Tensor, torch.Tensor]  # (ring [slots, rows, width], values [tokens, width])


def write_rings_reference(rings: list[Ring], last: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> None:
    """ring[at[0][i], at[1][i]] = values[last[i]] for each (ring, values) of rings."""
    for ring, values in rings:
        ring[at] = values[last].to(ring.dtype)


# width is the model's (a few variants): specialised, so that rows copy as wide vectors.
@triton.jit(do_not_specialize=["ring_rows"])
def _write_rings_kernel(
    ring_ptr,
    values_ptr,
    second_ring_ptr,
    second_values_ptr,
    values_stride,
    last_ptr,
    slot_ptr,
    row_ptr,
    ring_rows,
    width,
    TWO: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    dependent_launch_start(PDL)  # PDL: launched early
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < width
    source = tl.load(last_ptr + i).to(tl.int64) * values_stride + c
    target = (tl.load(slot_ptr + i).to(tl.int64) * ring_rows + tl.load(row_ptr + i)) * width + c
    tl.store(ring_ptr + target, tl.load(values_ptr + source, mask=ok), mask=ok)
    if TWO:
        tl.store(second_ring_ptr + target, tl.load(second_values_ptr + source, mask=ok), mask=ok)


def write_rings_triton(rings: list[Ring], last: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> None:
    """write_rings_reference in one launch for one or two rings of one shape and dtype (CUDA, or the CPU under
    TRITON_INTERPRET=1)."""
    ring, values = rings[0]
    shape, dtype = ring.shape, ring.dtype
    if len(rings) > 2 or any(
        r.shape != shape or r.dtype != dtype or v.dtype != dtype or v.shape[1:] != shape[2:] or not r.is_contiguous()
        for r, v in rings
    ):
        raise ValueError(f"write_rings: one or two contiguous rings of one shape and dtype, got {len(rings)}")
    if last.numel():
        # Values may be row slices of a wider buffer (StackedLinears' outputs), of one row stride.
        strides = {v.stride(0) for _, v in rings}
        if len(strides) > 1 or any(v.stride(-1) != 1 for _, v in rings):
            rings = [(r, v.contiguous()) for r, v in rings]
        tensors = [t for ring_values in rings for t in ring_values]
        # A copy moves bytes: rows of whole 8-byte words go as int64, 8 bytes at a time (an FP8 entry row of 584
        # bytes: 73 words, not 584 single bytes).
        if all(
            t.element_size() < 8
            and t.data_ptr() % 8 == 0
            and all(n * t.element_size() % 8 == 0 for n in (t.shape[-1], *t.stride()[:-1]))
            for t in tensors
        ):
            tensors = [t.view(torch.int64) for t in tensors]
        ring, values, second_ring, second_values = tensors[:2] + tensors[-2:]
        width = ring.shape[2]
        block = min(ROW_BLOCK, triton.next_power_of_2(width))
        pdl = launches_dependents_early(ring.device)
        _write_rings_kernel[(last.numel(), triton.cdiv(width, block))](
            ring,
            values,
            second_ring,
            second_values,
            values.stride(0),
            last,
            at[0],
            at[1],
            shape[1],
            width,
            TWO=len(rings) == 2,
            BLOCK=block,
            PDL=pdl,
            launch_pdl=pdl,
        )


def write_rings(rings: list[Ring], last: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Rows at = (slots, rows) of each ring take rows `last` of its values (see the module)."""
    if rings[0][0].is_cuda:
        write_rings_triton(rings, last, at)
    else:
        write_rings_reference(rings, last, at)
