"""CUDA graphs of the model's forward for decode steps (one token per request), padded to a few batch sizes.

A decode step is launch-bound: replaying a captured graph replaces thousands of kernel launches with
one. Graphs are captured for sizes 1, 2, 4, 8, then multiples of 16; a step of R requests replays the
smallest size >= R, the extra rows being padding (position 0, no pages) that writes only to a reserved
scratch slot and the cache's scratch page, so they never touch a real request's cache.

A captured graph also fixes the block-table width, and the model's decode path does work in proportion
to it (every compressed entry the table could hold), not to the context. So graphs are captured per
(batch size, page bucket), buckets growing 4x up to the pages of max_model_len: a step replays the
narrowest table that holds its longest page table, at most 4x as wide as that page table.

The batches are marked decode_only, and the model's forward must be capturable for them: no host syncs
and no Python decisions on the batch's values. A model says so with `cuda_graph_safe = True`.
"""

from __future__ import annotations

import torch

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


class DecodeInputs:
    """The static input buffers of padded decode batches: a step's rows first, then padding rows."""

    def __init__(self, max_batch_size: int, max_pages: int, padding_slot: int, device: torch.device):
        n, self.padding_slot = max_batch_size, padding_slot
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), padding_slot, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_pages), -1, dtype=torch.int32, device=device)

    def load(self, batch: ForwardBatch, size: int, pages: int) -> ForwardBatch:
        """Copy a decode batch into the first rows, pad the rest up to `size`; the padded batch (a view)."""
        r, width = batch.num_requests, batch.block_tables.shape[1]
        self.input_ids[:r] = batch.input_ids
        self.positions[:r] = batch.positions
        self.context_lens[:r] = batch.context_lens
        self.slots[:r] = batch.slots
        self.block_tables[:r, :width] = batch.block_tables
        self.block_tables[:r, width:] = -1
        self.input_ids[r:size] = 0
        self.positions[r:size] = 0
        self.context_lens[r:size] = 0
        self.slots[r:size] = self.padding_slot
        self.block_tables[r:size] = -1
        return self.view(size, pages)

    def view(self, size: int, pages: int) -> ForwardBatch:
        """The first `size` rows, with block tables `pages` wide."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            slots=self.slots[:size],
            block_tables=self.block_tables[:size, :pages],
            decode_only=True,
        )


class DecodeGraphs:
    def __init__(self, model, cache, max_batch_size: int, max_pages: int, padding_slot: int, device: torch.device):
        self.model, self.cache, self.device = model, cache, device
        self.sizes = graph_sizes(max_batch_size)
        self.page_buckets = page_buckets(max_pages)
        self.padding_slot = padding_slot
        self.inputs = DecodeInputs(self.sizes[-1], max_pages, padding_slot, device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._capture()

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.num_tokens == batch.num_requests <= self.sizes[-1]
            and batch.block_tables.shape[1] <= self.page_buckets[-1]
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        r, width = batch.num_requests, batch.block_tables.shape[1]
        key = (next(s for s in self.sizes if s >= r), next(p for p in self.page_buckets if p >= width))
        self.inputs.load(batch, *key)
        return self._replay(key)[:r]

    def _capture(self) -> None:
        """Largest first, so the shared memory pool is sized by the largest graph; the buffers hold padding only."""
        pool = None
        for key in sorted(((s, p) for s in self.sizes for p in self.page_buckets), reverse=True):
            batch = self.inputs.view(*key)
            self.model.forward(batch, self.cache)  # warm-up outside the capture: allocator, autotuning, lazy init
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self.model.forward(batch, self.cache)
            pool = graph.pool() if pool is None else pool
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)

    def _replay(self, key: tuple[int, int]) -> torch.Tensor:
        self.graphs[key].replay()
        return self.outputs[key]
