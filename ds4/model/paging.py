"""Where compressed entries of a request live in a paged pool (one page = page_size tokens = page_size // ratio entries)."""

from __future__ import annotations

import torch


def entry_rows(block_table: torch.Tensor, entries: torch.Tensor, entries_per_page: int) -> torch.Tensor:
    """Rows of the flattened pool [pages * entries_per_page, dim] for a request's entry indices (any shape)."""
    pages = block_table.long()[entries // entries_per_page]
    if bool((pages < 0).any()):
        raise ValueError("block table: a compressed entry falls on an unassigned page (-1)")
    return pages * entries_per_page + entries % entries_per_page
