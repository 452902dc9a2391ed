"""CUDA graphs of the model's decode steps (one token per request, or k + 1 verifying k drafts), padded to a few shapes.

A decode step is launch-bound: replaying a captured graph replaces thousands of kernel launches with
one. Graphs are captured for sizes 1, 2, 4, 8, then multiples of 16; a step of R requests replays the
smallest size >= R, the extra rows being padding (position 0, no pages) that writes only to a reserved
scratch slot and the cache's scratch page, so they never touch a real request's cache.

Each graph also computes the logits of every row of its padded batch (the model's `compute_logits`: the final
collapse, norm and head, whose launches would otherwise cost the host time every step) into one buffer the
graphs share, sized for the largest graph; a step reads its own rows of it.

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4.engine.speculative import MTPDrafter
from ds4.engine.uploads import layout, padded, upload_into, views
from ds4.model.batch import ForwardBatch


def shared_logits_bytes(vocab_size: int, max_batch_size: int, tokens_per_request: int) -> int:
    """Bytes of the fp32 logits buffer DecodeGraphs shares among its graphs: the largest graph's rows."""
    return max_batch_size * tokens_per_request * vocab_size * 4


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
    """The static input buffers of padded decode batches: a step's requests first, then padding requests (token 0
    at position 0 and context length 0, the padding slot, block-table rows of -1).

    A graph's batch lies in one byte buffer as `upload_into` packs it (ds4.engine.uploads), in the graph's own
    shape (requests, tokens a request, block-table width): the host packs a step's batch with the padding after it
    and one copy from the host writes both where the graph reads (each copy costs ~5-10 us of host time on the
    H200: copying a staged batch field by field, then rewriting stale padding, took five to eleven). Graphs of
    other shapes read the same bytes in their own layouts, so every load writes its whole padded batch. The MTP
    graph's inputs (the token after each row, each request's last kept row) lie in a second buffer the same way.
    """

    def __init__(
        self,
        max_batch_size: int,
        max_pages: int,
        padding_slot: int,
        device: torch.device,
        max_tokens_per_request: int = 1,
    ):
        n, self.padding_slot = max_batch_size, padding_slot
        largest = GraphKey(max_tokens_per_request, n, max_pages)
        self._batch = torch.zeros(layout(_batch_sizes(largest))[1], dtype=torch.uint8, device=device)
        self._draft = torch.zeros(layout(_draft_sizes(largest))[1], dtype=torch.uint8, device=device)
        self.requests = torch.arange(n, device=device)
        self.query_start_loc = {
            m: torch.arange(0, (n + 1) * m, m, dtype=torch.int32, device=device)
            for m in range(1, max_tokens_per_request + 1)
        }
        # Each graph's fields of the buffers, made once (a view costs host time every step otherwise).
        self._views: dict[GraphKey, tuple[torch.Tensor, ...]] = {}
        self._draft_views: dict[GraphKey, tuple[torch.Tensor, torch.Tensor]] = {}

    def load(
        self,
        key: GraphKey,
        input_ids: Sequence[int],
        positions: Sequence[int],
        context_lens: Sequence[int],
        slots: Sequence[int],
        block_tables: Sequence[int],
    ) -> ForwardBatch:
        """A step's batch (host values; block tables key.pages wide, end to end) into the first rows of the graph of
        `key`, padding requests after it, in one copy; returns the step's rows there (its batch on the device)."""
        tokens, requests = key.size * key.tokens_per_request, key.size
        long, int32 = torch.long, torch.int32
        upload_into(
            self._batch,
            padded(input_ids, long, tokens, 0),
            padded(positions, long, tokens, 0),
            padded(context_lens, int32, requests, 0),
            padded(slots, int32, requests, self.padding_slot),
            padded(block_tables, int32, requests * key.pages, -1),
        )
        ids, pos, lens, slot, table = self._fields(key)
        n = len(slots)
        return ForwardBatch(
            input_ids=ids[: len(input_ids)],
            positions=pos[: len(input_ids)],
            query_start_loc=self.query_start_loc[key.tokens_per_request][: n + 1],
            context_lens=lens[:n],
            slots=slot[:n],
            block_tables=table[:n],
            decode_only=True,
            tokens_per_request=key.tokens_per_request,
        )

    def load_draft(self, key: GraphKey, next_ids: Sequence[int], last_rows: Sequence[int]) -> None:
        """The MTP step's inputs (host values) for the first len(last_rows) requests (padding requests draft from
        their first row)."""
        n, r = key.tokens_per_request, len(last_rows)
        upload_into(
            self._draft,
            padded(next_ids, torch.long, key.size * n, 0),
            ([*last_rows, *range(r * n, key.size * n, n)], torch.long),
        )

    def view(self, key: GraphKey) -> ForwardBatch:
        """The padded batch the graph of `key` reads (as the last `load` for `key` left it, unless a load for another
        graph has written other values since)."""
        ids, pos, lens, slot, table = self._fields(key)
        return ForwardBatch(
            input_ids=ids,
            positions=pos,
            query_start_loc=self.query_start_loc[key.tokens_per_request][: key.size + 1],
            context_lens=lens,
            slots=slot,
            block_tables=table,
            decode_only=True,
            tokens_per_request=key.tokens_per_request,
        )

    def draft_view(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """(next ids, last rows) of the padded batch the MTP graph of `key` reads."""
        if key not in self._draft_views:
            self._draft_views[key] = tuple(views(self._draft, _draft_sizes(key)))
        return self._draft_views[key]

    def _fields(self, key: GraphKey) -> tuple[torch.Tensor, ...]:
        if key not in self._views:
            ids, pos, lens, slot, table = views(self._batch, _batch_sizes(key))
            self._views[key] = ids, pos, lens, slot, table.view(key.size, key.pages)
        return self._views[key]


def _batch_sizes(key: GraphKey) -> list[tuple[int, torch.dtype]]:
    """(length, dtype) of the fields of a graph's batch, in order: input ids, positions, context lengths, slots,
    block tables."""
    t = key.size * key.tokens_per_request
    int32 = torch.int32
    return [(t, torch.long), (t, torch.long), (key.size, int32), (key.size, int32), (key.size * key.pages, int32)]


def _draft_sizes(key: GraphKey) -> list[tuple[int, torch.dtype]]:
    """(length, dtype) of the MTP graph's inputs: the token after each row, each request's last kept row."""
    return [(key.size * key.tokens_per_request, torch.long), (key.size, torch.long)]


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
        # Every graph's logits, its rows first: only the streams stay apart (a graph's drafts read its own).
        self.logits: torch.Tensor | None = None
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

    def run(self, batch: ForwardBatch, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        """The streams and fp32 logits of each row of a decode batch of key.tokens_per_request tokens a request (the
        model's forward and compute_logits): the batch `inputs.load` just returned for `key`. The logits stay valid
        until the next run."""
        n = batch.num_tokens
        if self.eager:  # kept apart from the captured graph's output, which later replays still write
            self._eager_streams = self._forward(key)
            return self._eager_streams[:n], self.model.compute_logits(self._eager_streams)[:n]
        self.graphs[key].replay()
        return self.outputs[key][:n], self.logits[:n]

    def draft(self, next_ids: Sequence[int], last_rows: Sequence[int], key: GraphKey) -> torch.Tensor:
        """[len(last_rows), k] drafts after the step `run` just ran for `key` (MTPDrafter.run on its rows), from the
        token after each of its rows and each request's last kept row (host values)."""
        self.inputs.load_draft(key, next_ids, last_rows)
        if self.eager:
            return self._draft(key, self._eager_streams)[: len(last_rows)]
        self.draft_graphs[key].replay()
        return self.drafts[key][: len(last_rows)]

    def _forward(self, key: GraphKey) -> torch.Tensor:
        return self.model.forward(self.inputs.view(key), self.cache)

    def _draft(self, key: GraphKey, streams: torch.Tensor) -> torch.Tensor:
        next_ids, last_rows = self.inputs.draft_view(key)
        return self.drafter.run(self.inputs.view(key), streams, next_ids, last_rows, self.inputs.requests[: key.size])

    def _capture(self) -> None:
        """Largest first, so the shared memory pool is sized by the largest graph. Each graph's inputs are loaded with
        padding only (a step of no requests) first: the other graphs' layouts leave other values in their bytes."""
        pool = None
        for key in self.keys:
            self.inputs.load(key, [], [], [], [], [])
            # warm-up outside the capture: allocator, autotuning, lazy init
            logits = self.model.compute_logits(self._forward(key))
            if self.logits is None:  # the largest graph's, first: every later graph's rows fit
                self.logits = torch.empty_like(logits)
            rows = logits.shape[0]
            del logits
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(key)
                # Computed in the graph's pool (its memory free again for the next capture), then copied to the
                # shared buffer: each graph's own logits would hold ~0.5 MB a row of the vocabulary, every graph.
                self.logits[:rows].copy_(self.model.compute_logits(self.outputs[key]))
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
            if self.drafter is not None:
                self.inputs.load_draft(key, [], [])
                graph.replay()  # the draft warm-up reads the streams of the (padding) rows
                self._draft(key, self.outputs[key])
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.drafts[key] = self._draft(key, self.outputs[key])
                self.draft_graphs[key] = graph
        torch.cuda.synchronize(self.device)
