"""Which requests run in the next step, and how many tokens each.

One step has a token budget. Running decodes go first (one token each, plus the drafts of speculative
decoding where the budget beyond the other decodes, the pages, max_tokens and max_model_len leave room;
a step never preempts for a draft), then prefill chunks: short
prompts before long ones, at most `max_num_partial_prefills` prompts per step of which at most
`max_long_partial_prefills` long, long ones in chunks of at most `long_prefill_token_threshold`.
So a short request that arrives while a huge prompt prefills starts in the very next step.

Fairness bound (tested): a request whose prompt is short (<= the threshold) and fits in the budget left
after the running decodes, arriving when no other short prompt waits and a slot and pages are free, is
scheduled whole in the first step after it arrives and so gets its first token from that step, however
many long prompts are prefilling.

When pages run out, the newest request is preempted: its pages and slot go back and it restarts from
zero later (or from its longest cached prefix), keeping the tokens it generated. With prefix caching a
request is admitted after its longest cached prefix (ds4.engine.prefix_cache) and prefills only the rest.
The scheduler deals only in tokens, pages and slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ds4.engine.config import EngineConfig
from ds4.engine.page_allocator import PageAllocator
from ds4.engine.sequence import Sequence, SequenceStatus


class RequestRejected(ValueError):
    """A request the engine can never run (e.g. a prompt longer than max_model_len)."""


@dataclass
class ScheduledChunk:
    seq: Sequence
    # Tokens [start, start + num_tokens) of seq run through the model in this step: known tokens, then drafts.
    start: int
    num_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    # A decode scheduled ahead (Scheduler.schedule_ahead): its one token is the one the step in flight samples, not
    # yet in seq; the token's id reaches the device from that step.
    ahead: bool = False

    @property
    def num_known_tokens(self) -> int:
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the known tokens, so the model's rows from there give the next tokens."""
        return self.ahead or self.start + self.num_known_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator, max_model_len: int):
        if allocator.pages_for(max_model_len) > allocator.num_pages:
            raise RequestRejected(
                f"the cache holds {allocator.capacity_tokens} tokens, less than max_model_len={max_model_len}: "
                "give the cache more memory or lower max_model_len"
            )
        if allocator.num_slots < config.max_num_seqs:
            raise ValueError(f"{allocator.num_slots} slots for max_num_seqs={config.max_num_seqs}")
        self.config = config
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        """Queue seq; the engine admits only prompts shorter than max_model_len, which the cache can hold."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove seq wherever it is and give its pages and slot back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        decodes = sorted((s for s in self.running if s.num_uncomputed_tokens == 1), key=lambda s: s.arrival)
        spare = budget - len(decodes)  # drafts take only budget no decode needs
        # Oldest first, so a request short of pages only ever preempts newer ones (or itself, the newest).
        for seq in decodes:
            if seq.status is SequenceStatus.RUNNING:
                drafts = self._drafts(seq, spare)
                if self._make_room(seq, 1, scheduled, out, newer_only=False):
                    self._take(seq, 1 + len(drafts), scheduled, out, drafts)
                    budget -= 1 + len(drafts)
                    spare -= len(drafts)
        self._schedule_prefills(budget, scheduled, out)
        return out

    def schedule_ahead(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk] | None:
        """The step after `chunks`, a step still in flight in which every running request decodes one token,
        scheduled before those tokens are known: each request one token further, its input the token in flight
        (pages grown to hold it). None unless schedule() would give the same once they are known and none of the
        requests finished: no waiting request could take a seat, and every request grows without preempting."""
        if len(chunks) != len(self.running) or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return None
        growing, missing = [], 0
        for c in chunks:
            seq = c.seq
            if seq.status is not SequenceStatus.RUNNING or c.num_tokens != 1 or c.draft_token_ids or not c.samples:
                return None
            pages = self.allocator.pages_for(c.start + 2) - len(seq.page_table)
            if pages > 0:
                growing.append(c)
                missing += pages
        if missing > self.allocator.num_free_pages:
            return None
        for c in growing:
            self.allocator.grow(c.seq.page_table, c.start + 2)
        return [ScheduledChunk(c.seq, c.start + 1, 1, ahead=True) for c in chunks]

    def _drafts(self, seq: Sequence, spare: int) -> list[int]:
        """The drafts seq verifies in this step: as many as the budget, max_tokens, max_model_len and the
        free pages leave room for (the pages without preempting anyone)."""
        if not seq.draft_token_ids:
            return []
        room = min(spare, self.max_model_len - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        drafts = seq.draft_token_ids[: max(room, 0)]
        if drafts and not self.allocator.can_grow(seq.page_table, seq.num_computed_tokens + 1 + len(drafts)):
            return []
        return drafts

    def _schedule_prefills(self, budget: int, scheduled: set[int], out: SchedulerOutput) -> None:
        if not self.waiting and len(scheduled) == len(self.running):
            return  # every running request decodes: no prompt to prefill
        limit = self.config.prefill_chunk_limit
        partial = [s for s in self.running if id(s) not in scheduled and s.num_uncomputed_tokens > 0]
        candidates = sorted(partial + list(self.waiting), key=lambda s: (s.num_uncomputed_tokens > limit, s.arrival))
        num_prefills = num_long = 0
        admitting = True
        for seq in candidates:
            if budget == 0 or num_prefills == self.config.max_num_partial_prefills:
                break
            is_long = seq.num_uncomputed_tokens > limit
            if (is_long and num_long == self.config.max_long_partial_prefills) or seq in out.preempted:
                continue
            if seq.status is SequenceStatus.WAITING:
                if not admitting:
                    continue
                n = self._admit(seq, budget, limit)
                if n == 0:
                    # Later arrivals must not overtake a request that waits for room, or it could starve.
                    admitting = False
                    continue
            else:
                n = min(seq.num_uncomputed_tokens, budget, limit, self._fits(seq))
                if n == 0:
                    if not self._make_room(seq, 1, scheduled, out, newer_only=True):
                        continue
                    n = min(seq.num_uncomputed_tokens, budget, limit, self._fits(seq))
            self._take(seq, n, scheduled, out)
            budget -= n
            num_prefills += 1
            num_long += is_long

    def _fits(self, seq: Sequence) -> int:
        """How many more tokens seq can compute with its pages plus the free ones."""
        pages = len(seq.page_table) + self.allocator.num_free_pages
        return pages * self.allocator.page_size - seq.num_computed_tokens

    def _admit(self, seq: Sequence, budget: int, limit: int) -> int:
        """Give seq a slot and its longest cached prefix; the tokens it computes now (0: no room, it waits)."""
        if len(self.running) >= self.config.max_num_seqs:
            return 0
        cache = self.allocator.prefix_cache
        pages, snapshot = cache.lookup(seq) if cache is not None else ([], None)
        self.allocator.share(seq.page_table, pages)
        cached = len(pages) * self.allocator.page_size
        n = min(seq.num_tokens - cached, budget, limit)
        if not self.allocator.can_grow(seq.page_table, cached + n):
            self.allocator.free_pages(seq.page_table)
            return 0
        self.waiting.remove(seq)
        seq.slot = self.allocator.allocate_slot()
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens, seq.num_cached_pages = cached, len(pages)
        if cache is not None:
            cache.admitted(seq, cached, snapshot)
        self.running.append(seq)
        return n

    def _make_room(self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput, newer_only: bool) -> bool:
        """Preempt the newest unscheduled requests until seq can grow by n tokens; False if seq itself went."""
        while not self.allocator.can_grow(seq.page_table, seq.num_computed_tokens + n):
            victims = [s for s in self.running if id(s) not in scheduled and (s is not seq or not newer_only)]
            if newer_only:
                victims = [s for s in victims if s.arrival > seq.arrival]
            if not victims:
                return False
            victim = max(victims, key=lambda s: s.arrival)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _take(
        self, seq: Sequence, n: int, scheduled: set[int], out: SchedulerOutput, drafts: list[int] | None = None
    ) -> None:
        self.allocator.grow(seq.page_table, seq.num_computed_tokens + n)
        scheduled.add(id(seq))
        out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n, list(drafts or [])))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        # Preempted requests are older than anything still waiting, so they go first.
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free_pages(seq.page_table)
        if seq.slot is not None:
            self.allocator.free_slot(seq.slot)
            seq.slot = None
