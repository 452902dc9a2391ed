"""Where compressed entries of a request live in a paged pool (a page: page_size tokens, page_size // ratio entries)."""

from __future__ import annotations

import torch


def entry_rows(block_table: torch.Tensor, entries: torch.Tensor, entries_per_page: int) -> torch.Tensor:
    """Rows of the flattened pool [pages * entries_per_page, dim] for a request's entry indices (any shape)."""
    pages = block_table.long()[entries // entries_per_page]
    if bool((pages < 0).any()):
        raise ValueError("block table: a compressed entry falls on an unassigned page (-1)")
    return pages * entries_per_page + entries % entries_per_page


def table_entry_rows(block_tables: torch.Tensor, entries: torch.Tensor, entries_per_page: int) -> torch.Tensor:
    """Rows of the flattened pool for entries [R, N] of each request [R, max_pages]; -1 where the page is unassigned.

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


def visible_entry_rows(block_tables: torch.Tensor, positions: torch.Tensor, ratio: int, entries_per_page: int):
    """Decode (token r of request r): rows of every entry i < (position + 1) // ratio,
    [R, max_pages * entries_per_page].

    The width is fixed by the table, not by the longest context, so the shape never depends on the data.
    """
    width = block_tables.shape[1] * entries_per_page
    entries = torch.arange(width, device=positions.device).expand(positions.shape[0], -1)
    rows = table_entry_rows(block_tables, entries, entries_per_page)
    return torch.where(entries < ((positions + 1) // ratio)[:, None], rows, -1)
