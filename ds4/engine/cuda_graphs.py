"""CUDA graphs of the model's decode steps (one token per request, or k + 1 verifying k drafts), padded to a few shapes.

A decode step is launch-bound: replaying a captured graph replaces thousands of kernel launches with
one. Graphs are captured for sizes 1, 2, 4, 8, then multiples of 16; a step of R requests replays the
smallest size >= R, the extra rows being padding (position 0, no pages) that writes only to a reserved
scratch slot and the cache's scratch page, so they never touch a real request's cache.

A captured graph also fixes the block-table width, and the model's decode path does work in proportion
to it (every compressed entry the table could hold), not to the context. So graphs are captured per
(batch size, page bucket), buckets growing 4x up to the pages of max_model_len: a step replays the
narrowest table that holds its longest page table, at most 4x as wide as that page table.

With speculative decoding (k drafts) graphs are captured for k + 1 tokens per request as well, and for every
shape a second graph: the MTP layer over the step's rows and its drafting steps (MTPDrafter.run), reading the
main graph's output streams and two inputs the host fills once it has verified the drafts: the token after each
row and each request's last kept row. A step whose chunks all have at most k + 1 tokens replays the graphs of
the fewest tokens per request that hold its longest chunk (1, else k + 1): a request with fewer drafts (it does
not speculate, or max_tokens, max_model_len, the budget or its pages leave less room) is padded with tokens past
its own, which the cache's k spare rows take as they take rejected drafts (ds4.model.cache); their rows are
neither sampled nor kept. A speculative decode step is then two replays plus sampling and verification.

The batches are marked decode_only, and the model's forward must be capturable for them: no host syncs
and no Python decisions on the batch's values. A model says so with `cuda_graph_safe = True`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4.engine.speculative import MTPDrafter
from ds4.model.batch import ForwardBatch


def graph_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


def page_buckets(max_pages: int) -> list[int]:
    """Block-table widths graphs are captured for: 1, 4, 16, ... below max_pages, then max_pages."""
    buckets = [1]
    while buckets[-1] * 4 < max_pages:
        buckets.append(buckets[-1] * 4)
    return buckets + [max_pages] if max_pages > 1 else buckets


@dataclass(frozen=True, order=True)
class GraphKey:
    """The shape a graph was captured for."""

    tokens_per_request: int
    size: int  # requests, padding included
    pages: int  # block-table width


class DecodeInputs:
    """The static input buffers of padded decode batches: a step's requests first, then padding requests."""

    def __init__(
        self,
        max_batch_size: int,
        max_pages: int,
        padding_slot: int,
        device: torch.device,
        max_tokens_per_request: int = 1,
    ):
        n, self.padding_slot = max_batch_size, padding_slot
        t = n * max_tokens_per_request
        self.input_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.positions = torch.zeros(t, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), padding_slot, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_pages), -1, dtype=torch.int32, device=device)
        self.requests = torch.arange(n, device=device)
        self.query_start_loc = {
            m: torch.arange(0, (n + 1) * m, m, dtype=torch.int32, device=device)
            for m in range(1, max_tokens_per_request + 1)
        }
        # The MTP graph's inputs: the token after each row, each request's last kept row.
        self.next_ids = torch.zeros(t, dtype=torch.long, device=device)
        self.last_rows = torch.zeros(n, dtype=torch.long, device=device)
        # Past these tokens, requests and block-table columns every row is padding (a step's copies cost ~5-10 us
        # of host time each on the H200, so padding is rewritten only where an earlier step wrote a request).
        self._tokens = self._requests = self._width = 0

    def load(self, batch: ForwardBatch) -> None:
        """Copy a decode batch into the first rows; every row after them is padding (`view(key)`: the padded
        batch of a graph's shape)."""
        r, t, width = batch.num_requests, batch.num_tokens, batch.block_tables.shape[1]
        self.input_ids[:t] = batch.input_ids
        self.positions[:t] = batch.positions
        self.context_lens[:r] = batch.context_lens
        self.slots[:r] = batch.slots
        self.block_tables[:r, :width] = batch.block_tables
        if self._width > width:
            self.block_tables[:r, width : self._width] = -1
        if self._tokens > t:
            self.input_ids[t : self._tokens] = 0
            self.positions[t : self._tokens] = 0
        if self._requests > r:
            self.context_lens[r : self._requests] = 0
            self.slots[r : self._requests] = self.padding_slot
            self.block_tables[r : self._requests] = -1
        self._tokens, self._requests, self._width = t, r, width

    def load_draft(self, next_ids: torch.Tensor, last_rows: torch.Tensor, key: GraphKey) -> None:
        """The MTP step's inputs for the first len(last_rows) requests (padding requests draft from their first row)."""
        r, t = last_rows.shape[0], next_ids.shape[0]
        self.next_ids[:t] = next_ids
        self.next_ids[t : key.size * key.tokens_per_request] = 0
        self.last_rows[:r] = last_rows
        self.last_rows[r : key.size] = self.requests[r : key.size] * key.tokens_per_request

    def view(self, key: GraphKey) -> ForwardBatch:
        """The first key.size requests, with block tables key.pages wide."""
        t = key.size * key.tokens_per_request
        return ForwardBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[:t],
            query_start_loc=self.query_start_loc[key.tokens_per_request][: key.size + 1],
            context_lens=self.context_lens[: key.size],
            slots=self.slots[: key.size],
            block_tables=self.block_tables[: key.size, : key.pages],
            decode_only=True,
            tokens_per_request=key.tokens_per_request,
        )


class DecodeGraphs:
    def __init__(
        self,
        model,
        cache,
        max_batch_size: int,
        max_pages: int,
        padding_slot: int,
        device: torch.device,
        drafter: MTPDrafter | None = None,
        capture: bool = True,
    ):
        """drafter: with speculative decoding, also graphs of k + 1 tokens a request and of the MTP step.
        capture False: run the same padded batches eagerly instead (tests on the CPU; a profile of the step)."""
        self.model, self.cache, self.device, self.drafter = model, cache, device, drafter
        self.sizes = graph_sizes(max_batch_size)
        self.page_buckets = page_buckets(max_pages)
        self.tokens_per_request = [1] + ([drafter.k + 1] if drafter is not None else [])
        self.inputs = DecodeInputs(self.sizes[-1], max_pages, padding_slot, device, self.tokens_per_request[-1])
        self.keys = sorted(
            (GraphKey(n, s, p) for n in self.tokens_per_request for s in self.sizes for p in self.page_buckets),
            reverse=True,
        )
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.draft_graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.drafts: dict[GraphKey, torch.Tensor] = {}
        self.eager = not capture
        self._eager_streams: torch.Tensor | None = None  # the last eager run's output (its drafts read it)
        if capture:
            self._capture()

    def key(self, tokens_per_request: list[int], width: int) -> GraphKey | None:
        """The graph for a step whose requests bring these token counts, block tables `width` pages wide (None: too
        large for every graph; the step runs eagerly)."""
        longest = max(tokens_per_request)
        n = next((n for n in self.tokens_per_request if n >= longest), None)
        if n is None or len(tokens_per_request) > self.sizes[-1] or width > self.page_buckets[-1]:
            return None
        size = next(s for s in self.sizes if s >= len(tokens_per_request))
        return GraphKey(n, size, next(p for p in self.page_buckets if p >= width))

    def run(self, batch: ForwardBatch, key: GraphKey) -> torch.Tensor:
        """The streams of a decode batch of key.tokens_per_request tokens a request (the model's forward)."""
        self.inputs.load(batch)
        if self.eager:  # kept apart from the captured graph's output, which later replays still write
            self._eager_streams = self._forward(key)
            return self._eager_streams[: batch.num_tokens]
        self.graphs[key].replay()
        return self.outputs[key][: batch.num_tokens]

    def draft(self, next_ids: torch.Tensor, last_rows: torch.Tensor, key: GraphKey) -> torch.Tensor:
        """[len(last_rows), k] drafts after the step `run` just ran for `key` (MTPDrafter.run on its rows)."""
        self.inputs.load_draft(next_ids, last_rows, key)
        if self.eager:
            return self._draft(key, self._eager_streams)[: last_rows.shape[0]]
        self.draft_graphs[key].replay()
        return self.drafts[key][: last_rows.shape[0]]

    def _forward(self, key: GraphKey) -> torch.Tensor:
        return self.model.forward(self.inputs.view(key), self.cache)

    def _draft(self, key: GraphKey, streams: torch.Tensor) -> torch.Tensor:
        inputs, r = self.inputs, key.size
        next_ids, last_rows = inputs.next_ids[: r * key.tokens_per_request], inputs.last_rows[:r]
        return self.drafter.run(inputs.view(key), streams, next_ids, last_rows, inputs.requests[:r])

    def _capture(self) -> None:
        """Largest first, so the shared memory pool is sized by the largest graph; the buffers hold padding only."""
        pool = None
        for key in self.keys:
            self._forward(key)  # warm-up outside the capture: allocator, autotuning, lazy init
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(key)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
            if self.drafter is not None:
                graph.replay()  # the draft warm-up reads the streams of the (padding) rows
                self._draft(key, self.outputs[key])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.drafts[key] = self._draft(key, self.outputs[key])
                self.draft_graphs[key] = graph
        torch.cuda.synchronize(self.device)
