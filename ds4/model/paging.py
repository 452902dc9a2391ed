"""Where compressed entries of a request live in a paged pool (a page: page_size tokens, page_size // ratio entries)."""

from __future__ import annotations

import torch


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
