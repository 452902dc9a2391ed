"""Prefix caching: full pages kept under a hash chain of their tokens, reused by requests that start the same way.

Page j of a request is keyed by sha256(key of page j - 1, tokens of page j), so a key names a page's tokens
and everything before them. Once a request has computed a page it is registered under its key (a page
whose key is taken already stays private); it stays cached after the request ends, reclaimable: pages
that no running request holds are evicted least recently released first (a request releases its tail
first) when the allocator runs out of free pages.

DeepSeek-V4 needs more than the pages to resume at a page end e: the sliding window's raw entries and
CSA's overlap rows, which live in the request's slot (ds4.model.cache, boundary snapshots). Each step, for
every page end its chunks pass whose page has no snapshot yet, a snapshot id is taken (the least recently
used snapshot is dropped when none is free) and the state is kept: written by the model for page ends
inside a chunk, copied from the slot for a chunk that ends there. A snapshot belongs to its page and
goes with it. A decode step launched ahead of its token (async decode) cannot key the page it ends: its snapshot
is taken unkeyed and keyed when the request commits the page (or goes back if the page has one by then).

A new request resumes after the longest run of cached pages whose last page has a snapshot, at most
num_tokens - 1 tokens (the last token always runs, to give logits). Requests that want prompt logprobs
skip the lookup: they need the logits of every prompt token, so they compute the whole prompt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ds4.engine.sequence import Sequence
from ds4.model.batch import BoundarySnapshot


@dataclass
class StepSnapshots:
    """The snapshot copies of one step: restores before the forward, saves by the model and after it."""

    # Admitted requests resuming after a cached prefix: slot restore_slots[i] takes restore_snapshots[i], the
    # state at page end restore_ends[i].
    restore_snapshots: list[int] = field(default_factory=list)
    restore_slots: list[int] = field(default_factory=list)
    restore_ends: list[int] = field(default_factory=list)
    # Page ends inside a chunk (request = the chunk's index), kept by the model as it passes them.
    inner: list[BoundarySnapshot] = field(default_factory=list)
    # Chunks ending on a page end: slot save_slots[i] is kept as save_snapshots[i] (at page end save_ends[i])
    # after the forward.
    save_slots: list[int] = field(default_factory=list)
    save_snapshots: list[int] = field(default_factory=list)
    save_ends: list[int] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # tokens of requests looked up at admission
    hit_tokens: int = 0  # of those, tokens not computed thanks to the cache
    evicted_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache:
    def __init__(self, page_size: int, num_snapshots: int):
        if num_snapshots < 1:
            raise ValueError(f"prefix caching needs at least one boundary snapshot, got {num_snapshots}")
        self.page_size, self.num_snapshots = page_size, num_snapshots
        self.stats = PrefixCacheStats()
        self._page_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._reclaimable: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self._snapshot_of: dict[int, int] = {}  # page -> snapshot of the state at its end
        self._snapshot_lru: OrderedDict[int, int] = OrderedDict()  # snapshot -> page, least recently used first
        self._free_snapshots: deque[int] = deque(range(num_snapshots))
        self._pending: dict[bytes, int] = {}  # key -> snapshot taken this step, attached once the page is cached
        # (request, page end, snapshot) taken by a step launched ahead, whose page key hashes the token in flight:
        # keyed when the request commits that page.
        self._unkeyed: list[tuple[Sequence, int, int]] = []
        self._restores = StepSnapshots()

    @property
    def num_cached_pages(self) -> int:
        return len(self._key_of)

    @property
    def num_reclaimable_pages(self) -> int:
        return len(self._reclaimable)

    @property
    def num_kept_snapshots(self) -> int:
        return len(self._snapshot_lru)

    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def keys(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """The chain keys of seq's full pages, at least its first num_pages (memoised on seq: its tokens never
        change)."""
        keys, size = seq.page_keys, self.page_size
        while len(keys) < num_pages:
            j = len(keys)
            tokens = array("q", seq.token_ids(j * size, (j + 1) * size)).tobytes()
            keys.append(hashlib.sha256((keys[-1] if keys else b"") + tokens).digest())
        return keys

    def lookup(self, seq: Sequence) -> tuple[list[int], int | None]:
        """(cached pages seq may start from, the snapshot at their end); ([], None) on a miss."""
        if seq.prompt_logprobs is not None:
            return [], None
        pages: list[int] = []
        num_pages = (seq.num_tokens - 1) // self.page_size
        for key in self.keys(seq, num_pages)[:num_pages]:
            if key not in self._page_of:
                break
            pages.append(self._page_of[key])
        while pages and pages[-1] not in self._snapshot_of:
            pages.pop()
        if not pages:
            return [], None
        snapshot = self._snapshot_of[pages[-1]]
        self._snapshot_lru.move_to_end(snapshot)
        return pages, snapshot

    def admitted(self, seq: Sequence, cached_tokens: int, snapshot: int | None) -> None:
        """seq got a slot and starts after cached_tokens tokens: its slot takes the snapshot before the next forward."""
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += cached_tokens
        if snapshot is not None:
            self._restores.restore_snapshots.append(snapshot)
            self._restores.restore_slots.append(seq.slot)
            self._restores.restore_ends.append(cached_tokens)

    def claim(self, page: int) -> None:
        """A request takes a reclaimable page (a hit): it is no longer evictable."""
        self._reclaimable.pop(page, None)

    def release(self, page: int) -> bool:
        """The last request holding page let it go: keep it as reclaimable if cached (True), else False."""
        if page not in self._key_of:
            return False
        self._reclaimable[page] = None
        return True

    def evict(self) -> int:
        """Forget the least recently released reclaimable page and hand it out as free."""
        page, _ = self._reclaimable.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        snapshot = self._snapshot_of.pop(page, None)
        if snapshot is not None:
            del self._snapshot_lru[snapshot]
            self._free_snapshots.append(snapshot)
        self.stats.evicted_pages += 1
        return page

    def plan_step(self, chunks) -> StepSnapshots:
        """The snapshots of a scheduled step: queued restores, and every page end the chunks pass whose page
        has no snapshot yet."""
        plan, self._restores = self._restores, StepSnapshots()
        for i, chunk in enumerate(chunks):
            # Page ends among the known tokens only: drafts may be rejected.
            seq, end = chunk.seq, chunk.start + chunk.num_known_tokens
            if chunk.ahead:  # one token, not known yet: the key of a page it ends waits for the commit
                snapshot = self._take_snapshot() if end % self.page_size == 0 else None
                if snapshot is not None:
                    self._unkeyed.append((seq, end, snapshot))
                    plan.save_slots.append(seq.slot)
                    plan.save_snapshots.append(snapshot)
                    plan.save_ends.append(end)
                continue
            first_page = chunk.start // self.page_size + 1
            keys = self.keys(seq, end // self.page_size)
            for page_end in range(first_page * self.page_size, end + 1, self.page_size):
                key = keys[page_end // self.page_size - 1]
                page = self._page_of.get(key)
                if key in self._pending or (page is not None and page in self._snapshot_of):
                    continue
                snapshot = self._take_snapshot()
                if snapshot is None:
                    continue
                self._pending[key] = snapshot
                if page_end == end:
                    plan.save_slots.append(seq.slot)
                    plan.save_snapshots.append(snapshot)
                    plan.save_ends.append(page_end)
                else:
                    plan.inner.append(BoundarySnapshot(i, page_end, snapshot))
        return plan

    def commit(self, seq: Sequence) -> None:
        """Register the pages seq has now computed in full, with the snapshots taken at their ends."""
        if self._unkeyed:
            self._key_snapshots(seq)
        num_full = seq.num_computed_tokens // self.page_size
        if num_full <= seq.num_cached_pages:  # no page completed since the last commit: most decode steps
            return
        keys = self.keys(seq, num_full)
        for j in range(seq.num_cached_pages, num_full):
            key = keys[j]
            page = self._page_of.get(key)
            if page is None:
                page = seq.page_table[j]
                self._page_of[key], self._key_of[page] = page, key
            snapshot = self._pending.pop(key, None)
            if snapshot is not None:
                if page in self._snapshot_of:
                    self._free_snapshots.append(snapshot)
                else:
                    self._snapshot_of[page] = snapshot
                    self._snapshot_lru[snapshot] = page
        seq.num_cached_pages = num_full

    def end_step(self) -> None:
        """Snapshots taken for pages that were not computed after all (a failed step, a request that ended before
        a step launched ahead of its last token) go back; a step launched ahead keeps its own until it commits."""
        self._free_snapshots.extend(self._pending.values())
        self._pending.clear()
        ended = [entry for entry in self._unkeyed if entry[0].is_finished]
        for entry in ended:
            self._unkeyed.remove(entry)
            self._free_snapshots.append(entry[2])

    def _key_snapshots(self, seq: Sequence) -> None:
        """The snapshots a step launched ahead took at page ends seq has now computed, pending under their keys
        (or back, when the page has a snapshot already)."""
        done = [entry for entry in self._unkeyed if entry[0] is seq and entry[1] <= seq.num_computed_tokens]
        for entry in done:
            self._unkeyed.remove(entry)
            _, end, snapshot = entry
            key = self.keys(seq, end // self.page_size)[end // self.page_size - 1]
            page = self._page_of.get(key)
            if key in self._pending or (page is not None and page in self._snapshot_of):
                self._free_snapshots.append(snapshot)
            else:
                self._pending[key] = snapshot

    def _take_snapshot(self) -> int | None:
        """A free snapshot id, else the least recently used one's; None if every one is taken this step."""
        if not self._free_snapshots:
            if not self._snapshot_lru:
                return None
            snapshot, page = self._snapshot_lru.popitem(last=False)
            del self._snapshot_of[page]
            return snapshot
        return self._free_snapshots.popleft()
