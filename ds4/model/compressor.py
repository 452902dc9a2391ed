"""The KV compressor: every `ratio` tokens become one entry, a per-channel softmax-gated sum of their projections.

With overlap (CSA), entry i pools the first half of the channels of window i-1 and the second half of
window i (2 * ratio tokens, stride ratio). Entries get RMSNorm and RoPE at position i * ratio. Unfinished
windows wait in a per-slot fp32 ring of the last tokens' projections (token p in row p % rows, see
ds4.model.cache), so chunks may end anywhere and tokens written past what a request keeps need no undo.

`decode` is the same update for one token per request with fixed shapes: every row pools its current
window, and rows whose window did not complete write their entry to the pool's scratch page.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ds4.kernels.rmsnorm import rms_norm
from ds4.kernels.rope import apply_rope
from ds4.model.batch import ForwardBatch, StepLayout
from ds4.model.cache import CompressorState, entries_per_page, store_entries
from ds4.model.linear import Linear, Norm, fp32_param
from ds4.model.paging import entry_rows, table_entry_rows


class Compressor(nn.Module):
    def __init__(self, hidden: int, ratio: int, head_dim: int, overlap: bool, eps: float, device: torch.device):
        super().__init__()
        self.ratio, self.head_dim, self.overlap, self.eps = ratio, head_dim, overlap, eps
        width = (2 if overlap else 1) * head_dim
        self.ape = fp32_param(ratio, width, device=device)
        # Compression runs in fp32, as in the reference.
        self.wkv = Linear(hidden, width, torch.float32, device)
        self.wgate = Linear(hidden, width, torch.float32, device)
        self.norm = Norm(head_dim, device)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        layout: StepLayout,
        state: CompressorState,
        pool: torch.Tensor,
        inv_freq: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
        snapshots: CompressorState | None = None,
    ) -> None:
        """Write every entry whose window completes in this step into `pool` (page_size // ratio entries a page;
        dense [pages, entries, head_dim], or the packed indexer cache).

        `finish` applies the storage rounding (fp8 / fp4 simulation) to normalised, rotated entries.
        `snapshots`: the layer's snapshot rows of this state, written for batch.snapshots (overlap only).
        """
        xf = x.float()
        kv = self.wkv(xf)
        score = self.wgate(xf) + self.ape[batch.positions % self.ratio]
        for r in range(len(layout.counts)):
            if layout.counts[r] == 0:
                continue
            tokens = layout.token_slice(r)
            keep = [(s.position, s.snapshot) for s in batch.snapshots if s.request == r] if self.overlap else []
            entries, first = self._request(
                kv[tokens], score[tokens], layout.context_lens[r], layout.slots[r], state, keep, snapshots
            )
            if entries is None:
                continue
            entries = rms_norm(entries.to(x.dtype), self.norm.weight, self.eps)
            index = torch.arange(first, first + entries.shape[0], device=x.device)
            entries = finish(apply_rope(entries, index * self.ratio, inv_freq))
            store_entries(pool, entry_rows(batch.block_tables[r], index, entries_per_page(pool)), entries)

    def decode(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        state: CompressorState,
        pool: torch.Tensor,
        inv_freq: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """forward for a decode_only batch (token r belongs to request r), without host syncs."""
        ratio, d, rows = self.ratio, self.head_dim, state.kv.shape[1]
        pos, slots = batch.positions, batch.slots.long()
        xf = x.float()
        state.kv[slots, pos % rows] = self.wkv(xf)
        state.score[slots, pos % rows] = self.wgate(xf) + self.ape[pos % ratio]
        index = pos // ratio
        window = (index * ratio)[:, None] + torch.arange(ratio, device=x.device)[None, :]
        ring = slots[:, None], window % rows
        pooled_kv, pooled_score = state.kv[ring], state.score[ring]
        if self.overlap:
            first = (index == 0)[:, None, None]
            prev = slots[:, None], (window - ratio) % rows
            prev_kv = state.kv[prev].masked_fill(first, 0.0)
            prev_score = state.score[prev].masked_fill(first, float("-inf"))
            pooled_kv = torch.cat((prev_kv[..., :d], pooled_kv[..., d:]), dim=1)
            pooled_score = torch.cat((prev_score[..., :d], pooled_score[..., d:]), dim=1)
        entries = (pooled_kv * pooled_score.softmax(dim=1)).sum(dim=1)
        entries = rms_norm(entries.to(x.dtype), self.norm.weight, self.eps)
        entries = finish(apply_rope(entries, index * ratio, inv_freq))
        per_page = entries_per_page(pool)
        target = table_entry_rows(batch.block_tables, index[:, None], per_page)[:, 0]
        scratch = (pool.shape[0] - 1) * per_page
        completes = pos % ratio == ratio - 1
        target = torch.where(completes & (target >= 0), target, scratch)
        store_entries(pool, target, entries)

    def _request(self, kv, score, start: int, slot: int, state: CompressorState, keep=(), snapshots=None):
        """Pool the windows one request completes; keep its last tokens in the ring. keep: (page end e, snapshot
        id) pairs inside the chunk, whose overlap rows (the full window e - ratio .. e - 1) go to `snapshots`.

        Returns (entries [m, head_dim] | None, first index)."""
        ratio, rows = self.ratio, state.kv.shape[1]
        end = start + kv.shape[0]
        first, done = start // ratio, end // ratio - start // ratio
        # Completed windows read from the start of the first one (of the window before it, with overlap).
        base = (first - int(self.overlap)) * ratio
        history = torch.arange(max(base, 0), start, device=kv.device) % rows
        buf_kv = torch.cat((state.kv[slot, history], kv))
        buf_score = torch.cat((state.score[slot, history], score))
        kept = torch.arange(max(start, end - rows), end, device=kv.device)
        state.kv[slot, kept % rows] = kv[kept - start]
        state.score[slot, kept % rows] = score[kept - start]
        if not done:
            return None, first
        if base < 0:  # the window before the first one is empty: contributes nothing to the softmax
            buf_kv = torch.cat((buf_kv.new_zeros(ratio, buf_kv.shape[1]), buf_kv))
            buf_score = torch.cat((buf_score.new_full((ratio, buf_score.shape[1]), float("-inf")), buf_score))
        off = int(self.overlap) * ratio
        win_kv = buf_kv[off : off + done * ratio].view(done, ratio, -1)
        win_score = buf_score[off : off + done * ratio].view(done, ratio, -1)
        if keep:
            windows = torch.tensor([e // ratio - first - 1 for e, _ in keep], device=kv.device)
            ids = torch.tensor([snapshot for _, snapshot in keep], device=kv.device)
            snapshots.kv[ids], snapshots.score[ids] = win_kv[windows], win_score[windows]
        if self.overlap:
            prev_kv = buf_kv[: done * ratio].view(done, ratio, -1)
            prev_score = buf_score[: done * ratio].view(done, ratio, -1)
            d = self.head_dim
            win_kv = torch.cat((prev_kv[..., :d], win_kv[..., d:]), dim=1)
            win_score = torch.cat((prev_score[..., :d], win_score[..., d:]), dim=1)
        return (win_kv * win_score.softmax(dim=1)).sum(dim=1), first
