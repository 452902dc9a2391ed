"""CUDA graphs of the model's forward for decode steps (one token per request), padded to a few batch sizes.

A decode step is launch-bound: replaying a captured graph replaces thousands of kernel launches with
one. Graphs are captured for sizes 1, 2, 4, 8, then multiples of 16; a step of R requests replays the
smallest size >= R, the extra rows being padding that writes only to a reserved scratch slot (position 0,
no pages), so they never touch a real request's cache.

The model's forward must be capturable for such batches: no host syncs and no Python decisions on the
batch's values. A model says so with `cuda_graph_safe = True`.
"""

from __future__ import annotations

import torch

from ds4.model.batch import ForwardBatch


def graph_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size] + list(range(16, max_batch_size, 16))
    return sizes + [max_batch_size]


class DecodeGraphs:
    def __init__(self, model, cache, max_batch_size: int, max_pages: int, padding_slot: int, device: torch.device):
        self.sizes = graph_sizes(max_batch_size)
        self.padding_slot = padding_slot
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), padding_slot, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, max_pages), -1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        for size in reversed(self.sizes):
            batch = self._view(size)
            model.forward(batch, cache)  # warm-up outside the capture: allocator, autotuning, lazy init
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model.forward(batch, cache)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.num_tokens == batch.num_requests <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        r = batch.num_requests
        size = next(s for s in self.sizes if s >= r)
        width = batch.block_tables.shape[1]
        self.input_ids[:r] = batch.input_ids
        self.positions[:r] = batch.positions
        self.context_lens[:r] = batch.context_lens
        self.slots[:r] = batch.slots
        self.block_tables[:r, :width] = batch.block_tables
        self.block_tables[:r, width:] = -1
        self._pad(r, size)
        self.graphs[size].replay()
        return self.outputs[size][:r]

    def _pad(self, start: int, stop: int) -> None:
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.context_lens[start:stop] = 0
        self.slots[start:stop] = self.padding_slot
        self.block_tables[start:stop] = -1

    def _view(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            slots=self.slots[:size],
            block_tables=self.block_tables[:size],
        )
