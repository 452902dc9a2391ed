"""The KV compressor: every `ratio` tokens become one entry, a per-channel softmax-gated sum of their projections.

With overlap (CSA), entry i pools the first half of the channels of window i-1 and the second half of
window i (2 * ratio tokens, stride ratio). Entries get RMSNorm and RoPE at position i * ratio. Unfinished
windows wait in a per-slot fp32 ring of the last tokens' projections (token p in row p % rows, see
ds4.model.cache), so chunks may end anywhere and tokens written past what a request keeps need no undo.

A step reads window rows from one flat source: every request's ring, then the step's fresh projections,
then an empty row (kv 0, score -inf) for positions before 0 or past the request's end. The entry of a
token completing a window and the snapshot at a page end are the same gather from it. A decode_only batch
pools every token's window (fixed shapes; the entries of unfinished windows go to the pool's scratch
page); the general path pools only the finished ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ds4.kernels.gated_pool import gated_pool
from ds4.kernels.rmsnorm import rms_norm
from ds4.kernels.rope import apply_rope
from ds4.model.batch import LayerStep
from ds4.model.cache import CompressorState, entries_per_page, store_entries
from ds4.model.linear import Linear, Norm, fp32_param
from ds4.model.paging import table_entry_rows


class Compressor(nn.Module):
    def __init__(
        self,
        hidden: int,
        ratio: int,
        head_dim: int,
        overlap: bool,
        eps: float,
        device: torch.device,
        finish: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype,
    ):
        """finish: normalised, rotated entries -> the form `pool` takes (FP8 attention entries, the indexer's fp4
        simulation, or as they are). dtype: the model's, which the projections' weights are held in."""
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.eps, self.finish = ratio, head_dim, overlap, eps, finish
        width = (2 if overlap else 1) * head_dim
        self.ape = fp32_param(ratio, width, device=device)
        # Compression runs in fp32, as in the reference; the projections' weights are held in the model's dtype
        # (the checkpoint's bf16 on CUDA), their products with the bf16 input exact in fp32.
        self.wkv = Linear(hidden, width, dtype, device, fp32_output=True)
        self.wgate = Linear(hidden, width, dtype, device, fp32_output=True)
        self.norm = Norm(head_dim, device)

    def forward(
        self,
        x: torch.Tensor,
        step: LayerStep,
        state: CompressorState,
        pool: torch.Tensor,
        snapshots: CompressorState | None = None,
    ) -> None:
        """Write every entry whose window completes in this step into `pool` (page_size // ratio entries a page;
        dense [pages, entries, head_dim], or the packed indexer cache) and carry the rest in `state`.

        `snapshots`: the layer's snapshot rows of this state, written for batch.snapshots (overlap only)."""
        batch, ratio = step.batch, self.ratio
        pos, slots = batch.positions, batch.slots.long()
        kv, score = self.wkv(x), self.wgate(x) + self.ape[pos % ratio]
        width, ring_rows = kv.shape[1], state.kv.shape[1]
        source_kv = torch.cat((state.kv[slots].flatten(0, 1), kv, kv.new_zeros(1, width)))
        source_score = torch.cat((state.score[slots].flatten(0, 1), score, score.new_full((1, width), float("-inf"))))

        # The windows, and where their entries go, depend on the batch alone: layers of one ratio share them.
        index, rows = batch.shared(("windows", ratio, self.overlap, ring_rows), lambda: self._windows(step, ring_rows))
        entries = gated_pool(source_kv, source_score, rows, self.overlap)
        entries = rms_norm(entries.to(x.dtype), self.norm.weight, self.eps)
        entries = self.finish(apply_rope(entries, index * ratio, step.inv_freq))
        per_page = entries_per_page(pool)
        target = batch.shared(("entry rows", ratio, per_page), lambda: self._entry_rows(step, index, per_page))
        store_entries(pool, torch.where(target >= 0, target, (pool.shape[0] - 1) * per_page), entries)

        if snapshots is not None and batch.snapshots:
            # A snapshot at page end e keeps the overlap: the full window e - ratio .. e - 1, in window order.
            dev, snaps = pos.device, batch.snapshots
            ends = torch.tensor([s.position for s in snaps], device=dev)
            requests = torch.tensor([s.request for s in snaps], device=dev)
            rows = self._rows(step, ring_rows, requests, ends // ratio)[:, :ratio]
            ids = torch.tensor([s.snapshot for s in snaps], device=dev)
            snapshots.kv[ids], snapshots.score[ids] = source_kv[rows], source_score[rows]
        # Each token writes its ring row with the kv of its request's last token there (equal values, any order).
        last, ring = step.ring_writes(ring_rows)
        state.kv[ring], state.score[ring] = kv[last], score[last]

    def _windows(self, step: LayerStep, ring_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The window index of each token completing a window (decode_only: of every token) and its source rows."""
        pos, ratio = step.batch.positions, self.ratio
        if step.decode_only:
            tokens = torch.arange(pos.shape[0], device=pos.device)
        else:
            tokens = torch.nonzero(pos % ratio == ratio - 1).flatten()
        index = pos[tokens] // ratio
        rows = self._rows(step, ring_rows, step.token_requests[tokens], index)
        return index, rows

    def _entry_rows(self, step: LayerStep, index: torch.Tensor, per_page: int) -> torch.Tensor:
        """Each window's row in a pool of per_page entries a page; -1 for a decode_only token whose window is
        unfinished or whose page is unassigned (padding), which the caller sends to the scratch page."""
        batch, ratio = step.batch, self.ratio
        if step.decode_only:
            requests, completes = step.token_requests, batch.positions % ratio == ratio - 1
        else:
            requests, completes = step.token_requests[(batch.positions % ratio == ratio - 1)], None
        target = table_entry_rows(batch.block_tables[requests], index[:, None], per_page)[:, 0]
        if completes is None:
            if bool((target < 0).any()):
                raise ValueError("block table: a compressed entry falls on an unassigned page (-1)")
            return target
        return torch.where(completes, target, -1)

    def _rows(self, step: LayerStep, ring: int, requests: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """[N, (2 if overlap else 1) * ratio]: the source rows of window `window` of each request (with overlap,
        window - 1 first). Positions before the request's context come from its ring, which still holds them:
        a window reaches back at most 2 * ratio - 1 positions."""
        batch, ratio = step.batch, self.ratio
        span = (2 if self.overlap else 1) * ratio
        q = ((window - (span // ratio - 1)) * ratio)[:, None] + torch.arange(span, device=window.device)
        ctx = batch.context_lens.long()[requests][:, None]
        start = batch.query_start_loc.long()[requests][:, None]
        end = step.request_ends[requests][:, None]
        held = requests[:, None] * ring + q % ring
        fresh = batch.num_requests * ring + start + q - ctx
        empty = batch.num_requests * ring + batch.num_tokens
        return torch.where((q >= 0) & (q < end), torch.where(q >= ctx, fresh, held), empty)
