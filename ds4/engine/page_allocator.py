"""Free lists of cache pages and per-request slots.

A request owns one slot (its sliding window and compressor state) while it runs, and one page per
`page_size` tokens of context (its compressed and indexer entries). The allocator only counts: the
tensors live in the model's cache, addressed by the ids handed out here.
"""

from __future__ import annotations

from collections import deque


class PageAllocator:
    def __init__(self, num_pages: int, num_slots: int, page_size: int):
        if num_pages < 1 or num_slots < 1 or page_size < 1:
            raise ValueError(
                f"need at least one page, one slot and page_size >= 1, got {num_pages=}, {num_slots=}, {page_size=}"
            )
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.page_size = page_size
        self._free_pages: deque[int] = deque(range(num_pages))
        self._free_slots: deque[int] = deque(range(num_slots))

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens of context."""
        return -(-num_tokens // self.page_size)

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free request slot (the scheduler admits at most num_slots requests)")
        return self._free_slots.popleft()

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def can_grow(self, page_table: list[int], num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(page_table) <= len(self._free_pages)

    def grow(self, page_table: list[int], num_tokens: int) -> None:
        """Append pages to `page_table` until it holds `num_tokens` tokens."""
        missing = self.pages_for(num_tokens) - len(page_table)
        if missing > len(self._free_pages):
            raise RuntimeError(f"{missing} pages needed, {len(self._free_pages)} free (check can_grow first)")
        for _ in range(missing):
            page_table.append(self._free_pages.popleft())

    def free_pages(self, page_table: list[int]) -> None:
        self._free_pages.extend(page_table)
        page_table.clear()
