"""One model step over a flat batch of tokens from several requests (prefill chunks, decode and draft tokens alike)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ds4.model.cache import LayerCache


@dataclass(frozen=True)
class BoundarySnapshot:
    """Keep the state of request `request` at page end `position` (inside its chunk) as snapshot `snapshot`."""

    request: int
    position: int
    snapshot: int


@dataclass
class ForwardBatch:
    """Tokens of R requests laid end to end; request r owns tokens query_start_loc[r]:query_start_loc[r + 1].

    A request's tokens are consecutive positions starting at its context length (the tokens its caches
    already hold). `slots` index the fixed per-request state (sliding window, compressor state) and
    `block_tables` the pages of the paged pools (page_size tokens per page, -1 = unused).

    `decode_only` promises `tokens_per_request` tokens per request (query_start_loc = 0, n, 2n, ..., Rn): one
    for a plain decode step, k + 1 for a step verifying k drafts. The model then runs without host syncs,
    every shape fixed by the tensors' shapes (block_tables' width sets how many compressed entries a token
    may see), so the step can be captured in a CUDA graph. Other steps read the layout back once
    (`StepLayout`) and take their sizes from it, with no further sync. Every step trusts the batch: the pages
    up to each request's end must be in its block table (`validate(page_size)` checks; an entry on a -1 page is
    neither read nor written). Padding rows (position 0, a scratch slot, block-table rows of -1) write only to
    the scratch slot and the pools' scratch page.

    `snapshots` (not with decode_only; host side) name page ends strictly inside a request's tokens whose
    boundary state the model writes to the cache's snapshot store as it passes them (prefix caching).

    `derived` holds tensors computed from the batch alone (which rows a compressor pools, where its entries go,
    each token's request) by the first layer that needs them, for the layers after it: a decode step of Flash
    would otherwise launch the same index arithmetic in each of its 61 compressors. A forward clears it first.
    """

    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long, absolute position of each token
    query_start_loc: torch.Tensor  # [R + 1] int, cumulative token counts
    context_lens: torch.Tensor  # [R] int, tokens cached before this step
    slots: torch.Tensor  # [R] int
    block_tables: torch.Tensor  # [R, max_pages] int
    decode_only: bool = False
    tokens_per_request: int = 1  # with decode_only
    snapshots: tuple[BoundarySnapshot, ...] = ()
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_requests(self) -> int:
        return self.context_lens.shape[0]

    def shared(self, key, make: Callable[[], object]):
        """make() the first time this forward asks for key, its value after that (see `derived`)."""
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def snapshot_fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(request, position, snapshot) of `snapshots`, long tensors on the batch's device: uploaded once a
        forward, from pinned memory (no host sync)."""

        def upload():
            fields = [(s.request, s.position, s.snapshot) for s in self.snapshots]
            host = torch.tensor(fields, dtype=torch.long).reshape(-1, 3).T.contiguous()
            if self.positions.is_cuda:
                host = host.pin_memory()
            return tuple(host.to(self.positions.device, non_blocking=True))

        return self.shared("snapshot fields", upload)

    def token_requests(self) -> torch.Tensor:
        """[T] the request index of each token."""
        counts = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
        requests = torch.arange(self.num_requests, device=counts.device)
        return torch.repeat_interleave(requests, counts, output_size=self.num_tokens)  # no host sync

    def validate(self, page_size: int | None = None) -> None:
        """Check the layout invariants and, given page_size, that every token's page is assigned.

        Costs host syncs; for tests and debugging."""
        t, r = self.num_tokens, self.num_requests
        if self.positions.shape != (t,) or self.query_start_loc.shape != (r + 1,):
            raise ValueError(
                f"ForwardBatch: positions {tuple(self.positions.shape)} / query_start_loc "
                f"{tuple(self.query_start_loc.shape)} do not fit {t} tokens of {r} requests"
            )
        if int(self.query_start_loc[0]) != 0 or int(self.query_start_loc[-1]) != t:
            raise ValueError("ForwardBatch: query_start_loc must start at 0 and end at the token count")
        if self.slots.shape != (r,) or self.block_tables.dim() != 2 or self.block_tables.shape[0] != r:
            raise ValueError("ForwardBatch: slots / block_tables must have one row per request")
        req = self.token_requests()
        offset = torch.arange(t, device=req.device) - self.query_start_loc.long()[req]
        if not torch.equal(self.positions.long(), self.context_lens.long()[req] + offset):
            raise ValueError("ForwardBatch: each request's positions must run context_len, context_len + 1, ...")
        n = self.tokens_per_request
        if self.decode_only and not torch.equal(self.query_start_loc.long().cpu(), torch.arange(r + 1) * n):
            raise ValueError(f"ForwardBatch: decode_only needs exactly {n} token(s) per request")
        if page_size is not None and t:
            # Every page up to each request's end: its tokens' and its compressed entries' (the model trusts them).
            loc = self.query_start_loc.long()
            ends = self.context_lens.long() + loc[1:] - loc[:-1]
            pages = (ends + page_size - 1) // page_size
            if bool((pages > self.block_tables.shape[1]).any()):
                raise ValueError("ForwardBatch: a request's pages do not fit its block table")
            needed = torch.arange(self.block_tables.shape[1], device=ends.device) < pages[:, None]
            if bool((needed & (self.block_tables < 0)).any()):
                raise ValueError("ForwardBatch: a token's page is missing from its request's block table")


@dataclass
class StepLayout:
    """Host-side view of a ForwardBatch (one sync to build, the step's only one): each token's request, each
    request's tokens and context length. The layers take every size they need from it."""

    token_requests: torch.Tensor  # [T] request index of each token (device)
    starts: list[int]
    counts: list[int]
    context_lens: list[int]

    @classmethod
    def of(cls, batch: ForwardBatch) -> StepLayout:
        r = batch.num_requests
        host = torch.cat((batch.query_start_loc.long(), batch.context_lens.long())).tolist()
        loc = host[: r + 1]
        return cls(
            token_requests=batch.token_requests(),
            starts=loc[:-1],
            counts=[b - a for a, b in zip(loc[:-1], loc[1:])],
            context_lens=host[r + 1 :],
        )

    def token_slice(self, r: int) -> slice:
        return slice(self.starts[r], self.starts[r] + self.counts[r])

    def finished_windows(self, ratio: int) -> int:
        """How many windows of `ratio` tokens the step's tokens complete (window w ends at position w*ratio+ratio-1)."""
        return sum((c + n) // ratio - c // ratio for c, n in zip(self.context_lens, self.counts))

    def most_entries(self, ratio: int) -> int:
        """The most compressed entries of `ratio` any request has after the step."""
        return max((c + n) // ratio for c, n in zip(self.context_lens, self.counts)) if self.counts else 0


@dataclass
class LayerStep:
    """One layer's share of a step: the batch, its host-side layout, the layer's cache and RoPE frequencies.

    `layout` None marks a decode_only batch (token t is request t // tokens_per_request): nothing may then be
    read back to the host, so the parts that differ (how many compressed entries to gather, which tokens
    complete a compressor window) take their sizes from the tensors' shapes instead of the layout.
    """

    batch: ForwardBatch
    layout: StepLayout | None
    cache: LayerCache
    inv_freq: torch.Tensor

    @property
    def decode_only(self) -> bool:
        return self.layout is None

    @property
    def longest(self) -> int:
        """The most tokens any request brings to this step."""
        return self.batch.tokens_per_request if self.layout is None else max(self.layout.counts, default=0)

    @cached_property
    def token_indices(self) -> torch.Tensor:
        """[T] 0, 1, .., T - 1."""
        return self.batch.shared(
            "token indices", lambda: torch.arange(self.batch.num_tokens, device=self.batch.positions.device)
        )

    @cached_property
    def token_requests(self) -> torch.Tensor:
        """[T] the request index of each token."""
        if self.layout is None:
            n = self.batch.tokens_per_request
            return self.batch.shared("token requests", lambda: self.token_indices // n if n > 1 else self.token_indices)
        return self.layout.token_requests

    @cached_property
    def token_slots(self) -> torch.Tensor:
        """[T] the slot of each token's request (a plain decode step's: the batch's slots, one token a request)."""
        if self.decode_only and self.batch.tokens_per_request == 1:
            return self.batch.slots
        return self.batch.shared("token slots", lambda: self.batch.slots[self.token_requests])

    @cached_property
    def request_ends(self) -> torch.Tensor:
        """[R] long: each request's position after this step (context length + its tokens)."""

        def ends() -> torch.Tensor:
            loc = self.batch.query_start_loc.long()
            return self.batch.context_lens.long() + loc[1:] - loc[:-1]

        return self.batch.shared("request ends", ends)

    def ring_writes(self, rows: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """For a per-slot ring of `rows` rows (token p in row p % rows): the token whose value each token writes
        and where (slot, row). Each writes the value of its request's last token on that row, so writes to one
        row agree and their order is moot."""

        def writes():
            pos, last = self.batch.positions, self.token_indices
            if not self.decode_only:  # decode_only: fewer tokens a request than ring rows, each its own last
                last = last + rows * ((self.request_ends[self.token_requests] - 1 - pos) // rows)
            return last, (self.token_slots, pos % rows)

        return self.batch.shared(("ring writes", rows), writes)
