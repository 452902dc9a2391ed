"""The KV compressor: every `ratio` tokens become one entry, a per-channel softmax-gated sum of their projections.

With overlap (CSA), entry i pools the first half of the channels of window i-1 and the second half of
window i (2 * ratio tokens, stride ratio). Entries get RMSNorm and RoPE at position i * ratio. Unfinished
windows wait in a per-slot fp32 ring of the last tokens' projections (token p in row p % rows, see
ds4.model.cache), so chunks may end anywhere and tokens written past what a request keeps need no undo.

A step reads window rows from two places: the rings of the request's slot (positions before the step) and the
step's fresh projections; positions before 0 or past the request's end read an empty row (kv 0, score -inf).
The rings keep the raw gate logits; the position bias is added as windows are pooled. The entry of a token
completing a window and the snapshot at a page end are the same gather. A decode_only batch pools every token's
window (fixed shapes; the entries of unfinished windows go to the pool's scratch page); the general path pools
only the finished ones. Pooling, RMSNorm, RoPE and the cache's form are one launch on CUDA
(ds4.kernels.gated_pool), writing each entry into its pool row, except where the entries take a further step
(`finish`, the indexer's FP8-mode rounding) before the pool's own store.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ds4.kernels.gated_pool import pooled_entries, window_rows
from ds4.kernels.norm_rope import EntryForm
from ds4.kernels.paging import decode_windows, table_entry_rows, window_source_rows
from ds4.kernels.ring_write import write_rings
from ds4.model.batch import LayerStep
from ds4.model.cache import CompressorState, entries_per_page, store_entries
from ds4.model.linear import Linear, Norm, fp32_param


class Compressor(nn.Module):
    def __init__(
        self,
        hidden: int,
        ratio: int,
        head_dim: int,
        overlap: bool,
        eps: float,
        device: torch.device,
        dtype: torch.dtype,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """dtype: the model's, which the projections' weights and the entries are held in. finish: None when
        entries go to `pool` in its own form (rows of the compute dtype, or FP8 attention entries in a uint8 pool),
        else what normalised, rotated entries take before the pool's store (the indexer's fp4 simulation)."""
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.eps, self.finish = ratio, head_dim, overlap, eps, finish
        self.dtype = dtype
        width = (2 if overlap else 1) * head_dim
        self.ape = fp32_param(ratio, width, device=device)
        # Compression runs in fp32, as in the reference; the projections' weights are held in the model's dtype
        # (the checkpoint's bf16 on CUDA), their products with the bf16 input exact in fp32.
        # Multiplied by the attention with the other projections of its input (StackedLinears: one launch).
        self.wkv = Linear(hidden, width, dtype, device, fp32_output=True)
        self.wgate = Linear(hidden, width, dtype, device, fp32_output=True)
        self.norm = Norm(head_dim, device)

    def forward(
        self,
        kv: torch.Tensor,
        score: torch.Tensor,
        step: LayerStep,
        state: CompressorState,
        pool: torch.Tensor,
        snapshots: CompressorState | None = None,
    ) -> None:
        """Write every entry whose window completes in this step into `pool` (page_size // ratio entries a page;
        dense [pages, entries, head_dim], or the packed indexer cache) and carry the rest in `state`. kv, score:
        the step's wkv and wgate products (fp32 [T, width], row slices of one product: ring writes and pooling take
        them so).

        `snapshots`: the layer's snapshot rows of this state, written for batch.snapshots (overlap only)."""
        batch, ratio = step.batch, self.ratio
        ring_rows, width = state.kv.shape[1], kv.shape[1]
        ring = (state.kv.view(-1, width), state.score.view(-1, width))

        # The windows, and where their entries go, depend on the batch alone: layers of one ratio share them.
        shape = (ring_rows, ring[0].shape[0])
        per_page, pages = entries_per_page(pool), pool.shape[0]
        if step.decode_only:  # one launch on CUDA
            index, rows, target = batch.shared(
                ("decode windows", ratio, self.overlap, shape, per_page, pages),
                lambda: decode_windows(
                    batch.positions, batch.tokens_per_request, batch.context_lens, batch.query_start_loc, batch.slots,
                    batch.block_tables, ratio, self._span, *shape, per_page, pages,
                ),
            )  # fmt: skip
        else:
            index, rows = batch.shared(("windows", ratio, self.overlap, shape), lambda: self._windows(step, *shape))
            target = batch.shared(
                ("entry rows", ratio, per_page, pages), lambda: self._entry_rows(step, index, per_page, pages)
            )
        direct = self.finish is None
        form = EntryForm(self.norm.weight, step.inv_freq, self.eps, self.dtype, direct and pool.dtype == torch.uint8)
        if direct:
            scratch = (pages - 1) * per_page  # what _entry_rows sends nowhere: not even pooled
            flat = pool.view(-1, pool.shape[-1])
            pooled_entries(ring, (kv, score), self.ape, rows, index, form, flat, target, scratch)
        else:
            store_entries(pool, target, self.finish(pooled_entries(ring, (kv, score), self.ape, rows, index, form)))

        if snapshots is not None and batch.snapshots:
            # A snapshot at page end e keeps the overlap: the full window e - ratio .. e - 1, in window order.
            requests, ends, ids = batch.snapshot_fields()
            rows = self._rows(step, *shape, requests, ends // ratio)[:, :ratio]
            snapshots.kv[ids] = window_rows(ring[0], kv, rows, 0.0)
            snapshots.score[ids] = window_rows(ring[1], score, rows, float("-inf"))
        # Each token writes its ring row with the kv of its request's last token there (equal values, any order).
        write_rings([(state.kv, kv), (state.score, score)], *step.ring_writes(ring_rows))

    @property
    def _span(self) -> int:
        """Positions a window pools (with overlap, the window before's too)."""
        return (2 if self.overlap else 1) * self.ratio

    def _windows(self, step: LayerStep, ring_rows: int, ring_total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window index of each token completing a window and its source rows (a general step's)."""
        index, requests = self._finished_windows(step)
        return index, self._rows(step, ring_rows, ring_total, requests, index)

    def _finished_windows(self, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows the step's tokens complete, request after request, and their requests: request r completes
        windows context // ratio .. end // ratio - 1. Their count comes from the host-side layout (no sync)."""

        def windows():
            batch, ratio = step.batch, self.ratio
            dev = batch.positions.device
            first = batch.context_lens.long() // ratio
            counts = step.request_ends // ratio - first
            total = step.layout.finished_windows(ratio)
            requests = torch.repeat_interleave(torch.arange(batch.num_requests, device=dev), counts, output_size=total)
            before = torch.cumsum(counts, 0) - counts
            return first[requests] + torch.arange(total, device=dev) - before[requests], requests

        return step.batch.shared(("finished windows", self.ratio), windows)

    def _entry_rows(self, step: LayerStep, index: torch.Tensor, per_page: int, pages: int) -> torch.Tensor:
        """Each finished window's row in a pool of `pages` pages of per_page entries (a general step's); a window
        on an unassigned page (padding) goes to the last, scratch, page."""
        requests = self._finished_windows(step)[1]
        target = table_entry_rows(step.batch.block_tables[requests], index[:, None], per_page)[:, 0]
        return torch.where(target >= 0, target, (pages - 1) * per_page)

    def _rows(
        self, step: LayerStep, ring: int, ring_total: int, requests: torch.Tensor, window: torch.Tensor
    ) -> torch.Tensor:
        """[N, span]: window_source_rows of window `window` of each request `requests` (as ds4.kernels.gated_pool
        reads them)."""
        batch = step.batch
        return window_source_rows(
            requests, window, batch.context_lens, batch.query_start_loc, step.request_ends, batch.slots, self.ratio,
            self._span, ring, ring_total,
        )  # fmt: skip
