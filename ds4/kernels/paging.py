"""Rows of the paged pools and per-slot rings a step reads and writes.

A compressed entry of a request lives in a paged pool (a page: page_size tokens, page_size // ratio entries): its
row of the flattened pool is page * entries_per_page + offset through the request's block table. A compressor's
window of `span` positions (ratio, or 2 * ratio with overlap) reads each position from the request's ring (slot *
ring + position % ring: positions before the step) or from the step's fresh projections (ring_total + the token's
row in the step), -1 before 0 or past the request's end.

The attention's window keys come from two lists: the request's window ring (positions before the step: slot *
rows + position % rows) and the step's fresh keys.

The torch functions are the spec and the CPU path. A decode step (every request `tokens_per_request` tokens, no
host sync) makes its window keys' rows, each compressor's windows and entry rows, and HCA's visible entries' rows
in one launch each on CUDA (`decode_window_keys`, `decode_windows`, `decode_visible_rows`): the torch path is some
fifteen, forty and ten small launches, the first layers of a step waiting on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early

VISIBLE_BLOCK = 1024  # entries a program of decode_visible_rows takes


def table_entry_rows(block_tables: torch.Tensor, entries: torch.Tensor, entries_per_page: int) -> torch.Tensor:
    """Rows of the flattened pool [pages * entries_per_page, dim] for entries [N, E] of each row's block table
    [N, max_pages]; -1 where the page is unassigned.

    No host sync (usable under CUDA-graph capture): an entry outside the table or on a -1 page gives -1
    instead of an error, and never an index that wraps around to another page.
    """
    width = block_tables.shape[1]
    if width == 0:
        return torch.full_like(entries, -1, dtype=torch.long)
    column = entries.long() // entries_per_page
    pages = torch.gather(block_tables.long(), 1, column.clamp(0, width - 1))
    assigned = (entries >= 0) & (column < width) & (pages >= 0)
    return torch.where(assigned, pages * entries_per_page + entries % entries_per_page, -1)


def visible_entry_rows(
    block_tables: torch.Tensor, visible: torch.Tensor, entries_per_page: int, width: int
) -> torch.Tensor:
    """Rows of each token's first `visible` entries [T] through its own block table row [T, max_pages]:
    [T, width], -1 past them.
    """
    entries = torch.arange(width, device=visible.device).expand(visible.shape[0], -1)
    rows = table_entry_rows(block_tables, entries, entries_per_page)
    return torch.where(entries < visible[:, None], rows, -1)


def window_source_rows(
    requests: torch.Tensor,
    window: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    request_ends: torch.Tensor,
    slots: torch.Tensor,
    ratio: int,
    span: int,
    ring: int,
    ring_total: int,
) -> torch.Tensor:
    """[N, span]: the rows (slot * ring + row of the flat rings, ring_total + token of the fresh ones, -1 empty)
    of window `window` [N] of request `requests` [N] (a window of span > ratio starts span // ratio - 1 windows
    earlier). Positions before the request's context come from its slot's ring, which still holds them: a window
    reaches back at most span - 1 positions."""
    q = ((window - (span // ratio - 1)) * ratio)[:, None] + torch.arange(span, device=window.device)
    # The batch's int32 fields are gathered as they are (q's int64 promotes the sums: no conversion launches).
    ctx = context_lens[requests][:, None]
    start = query_start_loc[requests][:, None]
    end = request_ends[requests][:, None]
    held = slots[requests][:, None] * ring + q % ring
    fresh = ring_total + start + q - ctx
    return torch.where((q >= 0) & (q < end), torch.where(q >= ctx, fresh, held), -1)


def decode_visible_rows_reference(positions, tokens_per_request, block_tables, ratio, per_page, width):
    """visible_entry_rows of a decode step's tokens (token t is request t // tokens_per_request), each seeing the
    (position + 1) // ratio entries its position has completed: [T, width]."""
    requests = torch.arange(positions.shape[0], device=positions.device) // tokens_per_request
    return visible_entry_rows(block_tables[requests], (positions + 1) // ratio, per_page, width)


@triton.jit(do_not_specialize=["n", "ratio", "per_page", "width", "table_width"])
def _decode_visible_rows_kernel(
    pos_ptr, table_ptr, table_stride, out_ptr, n, ratio, per_page, width, table_width, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """decode_visible_rows_reference for one token and BLOCK of its entries a program. PDL: launched early."""
    dependent_launch_start(PDL)
    t = tl.program_id(0)
    entry = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    visible = (tl.load(pos_ptr + t).to(tl.int64) + 1) // ratio
    column = entry // per_page
    listed = (entry < visible) & (column < table_width)
    page = tl.load(table_ptr + (t // n).to(tl.int64) * table_stride + column, mask=listed, other=-1).to(tl.int64)
    rows = tl.where(listed & (page >= 0), page * per_page + entry % per_page, -1)
    tl.store(out_ptr + t.to(tl.int64) * width + entry, rows, mask=entry < width)


def decode_visible_rows(positions, tokens_per_request, block_tables, ratio, per_page, width):
    """decode_visible_rows_reference in one launch on CUDA (decode_visible_rows_triton), the reference elsewhere."""
    args = (positions, tokens_per_request, block_tables, ratio, per_page, width)
    return (decode_visible_rows_triton if positions.is_cuda else decode_visible_rows_reference)(*args)


def decode_visible_rows_triton(positions, tokens_per_request, block_tables, ratio, per_page, width):
    """decode_visible_rows_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    t = positions.shape[0]
    out = torch.empty(t, width, dtype=torch.long, device=positions.device)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if t and width:
        block = min(VISIBLE_BLOCK, triton.next_power_of_2(width))
        pdl = launches_dependents_early(positions.device)
        _decode_visible_rows_kernel[(t, triton.cdiv(width, block))](
            positions, block_tables, block_tables.stride(0), out, tokens_per_request, ratio, per_page, width,
            block_tables.shape[1], BLOCK=block, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


def window_key_rows(positions, requests, context_lens, query_start_loc, slots, window, rows, fresh_width):
    """Each token's last `window` positions as the attention's two key lists: [T, window] rows of the flat window
    rings (slot * rows + position % rows, positions before the step's) and [T, fresh_width] rows of the step's
    fresh keys (the token's request's start + position - context: positions in the step, up to the token's own),
    -1 elsewhere; requests [T] each token's request."""
    dev = positions.device
    pos = positions[:, None]
    ctx = context_lens[requests][:, None]  # int32 fields gathered as they are: the int64 positions promote
    ring_pos = pos - (window - 1) + torch.arange(window, device=dev)
    ring_rows = slots[requests][:, None] * rows + ring_pos % rows
    fresh_pos = pos - (fresh_width - 1) + torch.arange(fresh_width, device=dev)
    fresh_rows = query_start_loc[requests][:, None] + fresh_pos - ctx
    return (
        torch.where((ring_pos >= 0) & (ring_pos < ctx), ring_rows, -1),
        torch.where(fresh_pos >= ctx, fresh_rows, -1),
    )


def decode_window_keys_reference(positions, tokens_per_request, context_lens, query_start_loc, slots, window, rows):
    """window_key_rows of a decode step (token t is request t // tokens_per_request; its fresh keys are its
    request's min(window, tokens_per_request) last)."""
    requests = torch.arange(positions.shape[0], device=positions.device) // tokens_per_request
    fresh = min(window, tokens_per_request)
    return window_key_rows(positions, requests, context_lens, query_start_loc, slots, window, rows, fresh)


@triton.jit(do_not_specialize=["n", "window", "rows", "fresh_width"])
def _decode_window_keys_kernel(
    pos_ptr,
    ctx_ptr,
    loc_ptr,
    slot_ptr,
    held_ptr,
    fresh_ptr,
    n,
    window,
    rows,
    fresh_width,
    WINDOW: tl.constexpr,
    FRESH: tl.constexpr,
    PDL: tl.constexpr,
):
    """decode_window_keys_reference for one token a program (WINDOW, FRESH: window and fresh_width padded to
    powers of two). PDL: launched early."""
    dependent_launch_start(PDL)
    t = tl.program_id(0)
    request = t // n
    position = tl.load(pos_ptr + t).to(tl.int64)
    ctx = tl.load(ctx_ptr + request).to(tl.int64)
    j = tl.arange(0, WINDOW)
    ring_pos = position - (window - 1) + j
    held = tl.load(slot_ptr + request).to(tl.int64) * rows + ring_pos % rows  # ring_pos < 0: masked below
    held = tl.where((ring_pos >= 0) & (ring_pos < ctx), held, -1)
    tl.store(held_ptr + t.to(tl.int64) * window + j, held, mask=j < window)
    f = tl.arange(0, FRESH)
    fresh_pos = position - (fresh_width - 1) + f
    fresh = tl.load(loc_ptr + request).to(tl.int64) + fresh_pos - ctx
    tl.store(fresh_ptr + t.to(tl.int64) * fresh_width + f, tl.where(fresh_pos >= ctx, fresh, -1), mask=f < fresh_width)


def decode_window_keys(positions, tokens_per_request, context_lens, query_start_loc, slots, window, rows):
    """decode_window_keys_reference in one launch on CUDA (decode_window_keys_triton), the reference elsewhere."""
    args = (positions, tokens_per_request, context_lens, query_start_loc, slots, window, rows)
    return (decode_window_keys_triton if positions.is_cuda else decode_window_keys_reference)(*args)


def decode_window_keys_triton(positions, tokens_per_request, context_lens, query_start_loc, slots, window, rows):
    """decode_window_keys_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    t, dev = positions.shape[0], positions.device
    fresh_width = min(window, tokens_per_request)
    held = torch.empty(t, window, dtype=torch.long, device=dev)
    fresh = torch.empty(t, fresh_width, dtype=torch.long, device=dev)
    if t:
        pdl = launches_dependents_early(dev)
        _decode_window_keys_kernel[(t,)](
            positions, context_lens, query_start_loc, slots, held, fresh, tokens_per_request, window, rows,
            fresh_width, WINDOW=triton.next_power_of_2(window), FRESH=triton.next_power_of_2(fresh_width), PDL=pdl,
            num_warps=1, launch_pdl=pdl,
        )  # fmt: skip
    return held, fresh


def decode_windows_reference(
    positions, tokens_per_request, context_lens, query_start_loc, slots, block_tables, ratio, span, ring, ring_total,
    per_page, pages,
):  # fmt: skip
    """A decode step's windows (token t is request t // tokens_per_request; every token pools its window): the
    window index of each token [T], its window_source_rows [T, span], and where its entry goes [T]: its pool row
    when the token completes the window on an assigned page, else the scratch page's first row ((pages - 1) *
    per_page)."""
    requests = torch.arange(positions.shape[0], device=positions.device) // tokens_per_request
    index = positions // ratio
    loc = query_start_loc.long()
    ends = context_lens.long() + loc[1:] - loc[:-1]
    rows = window_source_rows(
        requests, index, context_lens, query_start_loc, ends, slots, ratio, span, ring, ring_total
    )
    target = table_entry_rows(block_tables[requests], index[:, None], per_page)[:, 0]
    completes = positions % ratio == ratio - 1
    return index, rows, torch.where(completes & (target >= 0), target, (pages - 1) * per_page)


@triton.jit(do_not_specialize=["T", "n", "ratio", "span", "ring", "ring_total", "per_page", "pages", "width"])
def _decode_windows_kernel(
    pos_ptr,
    ctx_ptr,
    loc_ptr,
    slot_ptr,
    table_ptr,
    table_stride,
    index_ptr,
    rows_ptr,
    target_ptr,
    T,
    n,
    ratio,
    span,
    ring,
    ring_total,
    per_page,
    pages,
    width,
    SPAN: tl.constexpr,
    PDL: tl.constexpr,
):
    """decode_windows_reference for one token a program (SPAN: span padded to a power of two). PDL: launched
    early."""
    dependent_launch_start(PDL)
    t = tl.program_id(0)
    request = t // n
    position = tl.load(pos_ptr + t).to(tl.int64)
    window = position // ratio
    ctx = tl.load(ctx_ptr + request).to(tl.int64)
    start = tl.load(loc_ptr + request).to(tl.int64)
    end = ctx + tl.load(loc_ptr + request + 1).to(tl.int64) - start
    j = tl.arange(0, SPAN)
    q = (window - (span // ratio - 1)) * ratio + j
    held = tl.load(slot_ptr + request).to(tl.int64) * ring + q % ring  # q < 0 (C remainder) reads nothing below
    fresh = ring_total + start + q - ctx
    rows = tl.where((q >= 0) & (q < end), tl.where(q >= ctx, fresh, held), -1)
    tl.store(rows_ptr + t.to(tl.int64) * span + j, rows, mask=j < span)
    tl.store(index_ptr + t, window)
    column = window // per_page
    listed = column < width
    page = tl.load(table_ptr + request.to(tl.int64) * table_stride + column, mask=listed, other=-1).to(tl.int64)
    completes = (position % ratio == ratio - 1) & listed & (page >= 0)
    tl.store(target_ptr + t, tl.where(completes, page * per_page + window % per_page, (pages - 1) * per_page))


def decode_windows(
    positions, tokens_per_request, context_lens, query_start_loc, slots, block_tables, ratio, span, ring, ring_total,
    per_page, pages,
):  # fmt: skip
    """decode_windows_reference in one launch on CUDA (or the CPU under TRITON_INTERPRET=1 with CPU tensors passed
    to decode_windows_triton); the reference elsewhere."""
    args = (positions, tokens_per_request, context_lens, query_start_loc, slots, block_tables, ratio, span, ring)
    if positions.is_cuda:
        return decode_windows_triton(*args, ring_total, per_page, pages)
    return decode_windows_reference(*args, ring_total, per_page, pages)


def decode_windows_triton(
    positions, tokens_per_request, context_lens, query_start_loc, slots, block_tables, ratio, span, ring, ring_total,
    per_page, pages,
):  # fmt: skip
    """decode_windows_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    t = positions.shape[0]
    dev = positions.device
    index = torch.empty(t, dtype=torch.long, device=dev)
    rows = torch.empty(t, span, dtype=torch.long, device=dev)
    target = torch.empty(t, dtype=torch.long, device=dev)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    if t:
        pdl = launches_dependents_early(dev)
        _decode_windows_kernel[(t,)](
            positions, context_lens, query_start_loc, slots, block_tables, block_tables.stride(0), index, rows,
            target, t, tokens_per_request, ratio, span, ring, ring_total, per_page, pages, block_tables.shape[1],
            SPAN=triton.next_power_of_2(span), PDL=pdl, num_warps=1, launch_pdl=pdl,
        )  # fmt: skip
    return index, rows, target
