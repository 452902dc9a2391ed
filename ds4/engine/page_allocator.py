"""Cache pages and per-request slots: who holds what, and what is free.

A request owns one slot (its sliding window and compressor state) while it runs, and one page per
`page_size` tokens of context (its compressed and indexer entries). A page may be held by several
requests at once (a shared prefix, see ds4.engine.prefix_cache): it counts its holders and is free again
when none is left, or, if the prefix cache keeps it, reclaimable: counted as free, handed out after the
free pages by evicting it from the cache. The allocator only counts: the tensors live in the model's
cache, addressed by the ids handed out here.
"""

from __future__ import annotations

from collections import deque

from ds4.engine.prefix_cache import PrefixCache


class PageAllocator:
    def __init__(self, num_pages: int, num_slots: int, page_size: int, prefix_cache: PrefixCache | None = None):
        if num_pages < 1 or num_slots < 1 or page_size < 1:
            raise ValueError(
                f"need at least one page, one slot and page_size >= 1, got {num_pages=}, {num_slots=}, {page_size=}"
            )
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self._free_pages: deque[int] = deque(range(num_pages))
        self._free_slots: deque[int] = deque(range(num_slots))
        self._holders = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages a request can get now: free ones plus cached ones no request holds."""
        reclaimable = self.prefix_cache.num_reclaimable_pages if self.prefix_cache is not None else 0
        return len(self._free_pages) + reclaimable

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
        missing = self.pages_for(num_tokens) - len(page_table)
        return missing <= 0 or missing <= self.num_free_pages

    def grow(self, page_table: list[int], num_tokens: int) -> None:
        """Append pages to `page_table` until it holds `num_tokens` tokens."""
        missing = self.pages_for(num_tokens) - len(page_table)
        if missing <= 0:
            return
        if missing > self.num_free_pages:
            raise RuntimeError(f"{missing} pages needed, {self.num_free_pages} free (check can_grow first)")
        for _ in range(missing):
            page = self._free_pages.popleft() if self._free_pages else self.prefix_cache.evict()
            self._holders[page] = 1
            page_table.append(page)

    def share(self, page_table: list[int], pages: list[int]) -> None:
        """Append pages other requests may hold too (cached pages of a shared prefix) to an empty page table."""
        for page in pages:
            if self._holders[page] == 0:
                self.prefix_cache.claim(page)
            self._holders[page] += 1
            page_table.append(page)

    def free_pages(self, page_table: list[int]) -> None:
        """Let go of every page of page_table, the tail first (so the cache evicts a prefix's tail first)."""
        for page in reversed(page_table):
            self._holders[page] -= 1
            if self._holders[page] == 0 and (self.prefix_cache is None or not self.prefix_cache.release(page)):
                self._free_pages.append(page)
        page_table.clear()
