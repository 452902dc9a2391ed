"""A decode step's window keys, compressor windows and HCA's visible entries (kernels.paging.decode_window_keys,
decode_windows, decode_visible_rows): the references against token-by-token oracles of the positions and pages,
and the one-launch kernels (interpreted) equal to them to the bit."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.paging as paging_module


@pytest.fixture(scope="module")
def paging():
    return interpreted(paging_module, "_decode_windows_kernel")


def decode_batch(requests: int, n: int, page_size: int, ratio: int, g: torch.Generator):
    """A decode_only batch of `requests` requests of n tokens each (context lengths from 0 up, some across a page
    end, one padding request with a -1 block table and the scratch slot), int32 fields as the engine makes them."""
    ctx = torch.randint(0, 3 * page_size, (requests,), generator=g)
    ctx[0], ctx[1] = 0, page_size - 1  # a first token; a step that crosses a page end
    ctx[-1] = 0  # padding
    positions = (ctx[:, None] + torch.arange(n)).flatten()
    pages = 4 * requests + 2
    width = (3 * page_size + n) // page_size + 1
    tables = torch.randperm(pages - 1, generator=g)[: requests * width].view(requests, width).int()
    tables[0, 1:] = -1  # pages past the request's end unassigned
    tables[-1] = -1
    slots = torch.randperm(requests, generator=g).int()
    loc = (torch.arange(requests + 1) * n).int()
    return positions, ctx.int(), loc, slots, tables, pages, page_size // ratio


def oracle(positions, n, ctx, loc, slots, tables, ratio, span, ring, ring_total, per_page, pages):
    """Token by token: each position of the token's window (the span // ratio windows ending with its own) from
    its slot's ring (before the context), the step's fresh rows (from it on, up to the request's end), else -1;
    the entry on the table's page of its window when the token completes it, else the scratch row."""
    t = positions.shape[0]
    rows = torch.full((t, span), -1, dtype=torch.long)
    target = torch.empty(t, dtype=torch.long)
    for i in range(t):
        r, p = i // n, int(positions[i])
        window = p // ratio
        first = (window + 1) * ratio - span
        end = int(ctx[r]) + int(loc[r + 1] - loc[r])
        for j in range(span):
            q = first + j
            if 0 <= q < int(ctx[r]):  # before the step: the slot's ring
                rows[i, j] = int(slots[r]) * ring + q % ring
            elif int(ctx[r]) <= q < end:  # in the step: its fresh rows
                rows[i, j] = ring_total + int(loc[r]) + q - int(ctx[r])
        column = window // per_page
        page = int(tables[r, column]) if column < tables.shape[1] else -1
        done = p % ratio == ratio - 1 and page >= 0
        target[i] = page * per_page + window % per_page if done else (pages - 1) * per_page
    return positions // ratio, rows, target


@pytest.mark.parametrize("ratio, overlap, n", [(4, True, 1), (4, True, 3), (128, False, 1), (128, False, 2)])
def test_decode_windows_reference_and_kernel_match_the_oracle(paging, ratio, overlap, n):
    g = torch.Generator().manual_seed(ratio + n)
    positions, ctx, loc, slots, tables, pages, per_page = decode_batch(5, n, 256, ratio, g)
    span = (2 if overlap else 1) * ratio
    ring, ring_total = span + 8, 5 * (span + 8)
    args = (positions, n, ctx, loc, slots, tables, ratio, span, ring, ring_total, per_page, pages)
    want = oracle(*args)
    reference = paging.decode_windows_reference(*args)
    kernel = paging.decode_windows_triton(*args)
    for got in (reference, kernel):
        for part, expected in zip(got, want):
            assert part.dtype == torch.long and torch.equal(part, expected)
    assert (want[1] >= 0).any() and (want[1] < 0).any() and (want[2] < (pages - 1) * per_page).any()


def window_keys_oracle(positions, n, ctx, loc, slots, window, rows):
    """Token by token: its last `window` positions from its slot's window ring when before the step, and its
    request's last min(window, n) positions from the step's fresh keys when in it; -1 elsewhere."""
    t, fresh_width = positions.shape[0], min(window, n)
    held = torch.full((t, window), -1, dtype=torch.long)
    fresh = torch.full((t, fresh_width), -1, dtype=torch.long)
    for i in range(t):
        r, p = i // n, int(positions[i])
        for j in range(window):
            q = p - window + 1 + j
            if 0 <= q < int(ctx[r]):
                held[i, j] = int(slots[r]) * rows + q % rows
        for f in range(fresh_width):
            q = p - fresh_width + 1 + f
            if q >= int(ctx[r]):
                fresh[i, f] = int(loc[r]) + q - int(ctx[r])
    return held, fresh


@pytest.mark.parametrize("n", [1, 3])
def test_decode_window_keys_reference_and_kernel_match_the_oracle(paging, n):
    g = torch.Generator().manual_seed(n)
    positions, ctx, loc, slots, _, _, _ = decode_batch(5, n, 256, 4, g)
    args = (positions, n, ctx, loc, slots, 128, 136)
    want = window_keys_oracle(*args)
    for got in (paging.decode_window_keys_reference(*args), paging.decode_window_keys_triton(*args)):
        for part, expected in zip(got, want):
            assert part.dtype == torch.long and torch.equal(part, expected)
    assert (want[0] >= 0).any() and (want[0] < 0).any() and (want[1] >= 0).all() == (n == 1)


@pytest.mark.parametrize("n", [1, 2])
def test_decode_visible_rows_reference_and_kernel_match_the_oracle(paging, n):
    """HCA's entries a token sees: its position's completed windows, each through its request's table (-1 past
    them, past the table, or on an unassigned page)."""
    g = torch.Generator().manual_seed(20 + n)
    positions, _, _, _, tables, _, per_page = decode_batch(5, n, 256, 128, g)
    width = tables.shape[1] * per_page + 3  # entries past the table too
    want = torch.full((positions.shape[0], width), -1, dtype=torch.long)
    for i, p in enumerate(positions.tolist()):
        for e in range((p + 1) // 128):
            column = e // per_page
            if column < tables.shape[1] and tables[i // n, column] >= 0:
                want[i, e] = int(tables[i // n, column]) * per_page + e % per_page
    args = (positions, n, tables, 128, per_page, width)
    for got in (paging.decode_visible_rows_reference(*args), paging.decode_visible_rows_triton(*args)):
        assert got.dtype == torch.long and torch.equal(got, want)
    assert (want >= 0).any()


def test_decode_windows_run_the_reference_off_cuda():
    g = torch.Generator().manual_seed(3)
    positions, ctx, loc, slots, tables, pages, per_page = decode_batch(3, 1, 256, 4, g)
    args = (positions, 1, ctx, loc, slots, tables, 4, 8, 16, 48, per_page, pages)
    for got, want in zip(paging_module.decode_windows(*args), paging_module.decode_windows_reference(*args)):
        assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio, overlap, n", [(4, True, 1), (128, False, 2)])
def test_decode_windows_kernel_on_the_gpu_matches_the_reference(ratio, overlap, n):
    """The launch as the GPU runs it (int64 rows, the C remainder of positions before 0 masked) against the
    reference on the same device."""
    g = torch.Generator().manual_seed(7 * ratio + n)
    positions, ctx, loc, slots, tables, pages, per_page = decode_batch(64, n, 256, ratio, g)
    span = (2 if overlap else 1) * ratio
    args = (n, ctx.cuda(), loc.cuda(), slots.cuda(), tables.cuda(), ratio, span, span + 8, 64 * (span + 8))
    got = paging_module.decode_windows(positions.cuda(), *args, per_page, pages)
    want = paging_module.decode_windows_reference(positions.cuda(), *args, per_page, pages)
    for part, expected in zip(got, want):
        assert torch.equal(part, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4])
def test_decode_window_keys_kernel_on_the_gpu_matches_the_reference(n):
    g = torch.Generator().manual_seed(11 + n)
    positions, ctx, loc, slots, _, _, _ = decode_batch(64, n, 256, 4, g)
    args = (positions.cuda(), n, ctx.cuda(), loc.cuda(), slots.cuda(), 128, 136)
    for got, want in zip(paging_module.decode_window_keys(*args), paging_module.decode_window_keys_reference(*args)):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_decode_visible_rows_kernel_on_the_gpu_matches_the_reference():
    g = torch.Generator().manual_seed(31)
    positions, _, _, _, tables, _, per_page = decode_batch(64, 2, 256, 128, g)
    args = (positions.cuda(), 2, tables.cuda(), 128, per_page, 2048 + 5)
    assert torch.equal(paging_module.decode_visible_rows(*args), paging_module.decode_visible_rows_reference(*args))
