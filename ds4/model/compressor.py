"""The KV compressor: every `ratio` tokens become one entry, a per-channel softmax-gated sum of their projections.

With overlap (CSA), entry i pools the first half of the channels of window i-1 and the second half of
window i (2 * ratio tokens, stride ratio). Entries get RMSNorm and RoPE at position i * ratio. Unfinished
windows wait in a per-slot fp32 state, so chunks may end anywhere.

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
        ratio, d = self.ratio, self.head_dim
        pos, slots = batch.positions, batch.slots.long()
        rows = torch.arange(pos.shape[0], device=x.device)
        xf = x.float()
        cur = ratio if self.overlap else 0
        buf_kv, buf_score = state.kv[slots], state.score[slots]  # copies, written back whole
        buf_kv[rows, cur + pos % ratio] = self.wkv(xf)
        buf_score[rows, cur + pos % ratio] = self.wgate(xf) + self.ape[pos % ratio]
        win_kv, win_score = buf_kv[:, cur:], buf_score[:, cur:]
        index = pos // ratio
        completes = pos % ratio == ratio - 1
        if self.overlap:
            first = (index == 0)[:, None, None]
            prev_kv = buf_kv[:, :ratio].masked_fill(first, 0.0)
            prev_score = buf_score[:, :ratio].masked_fill(first, float("-inf"))
            pooled_kv = torch.cat((prev_kv[..., :d], win_kv[..., d:]), dim=1)
            pooled_score = torch.cat((prev_score[..., :d], win_score[..., d:]), dim=1)
            done = completes[:, None, None]
            buf_kv[:, :ratio] = torch.where(done, win_kv, buf_kv[:, :ratio])
            buf_score[:, :ratio] = torch.where(done, win_score, buf_score[:, :ratio])
        else:
            pooled_kv, pooled_score = win_kv, win_score
        entries = (pooled_kv * pooled_score.softmax(dim=1)).sum(dim=1)
        state.kv[slots] = buf_kv
        state.score[slots] = buf_score
        entries = rms_norm(entries.to(x.dtype), self.norm.weight, self.eps)
        entries = finish(apply_rope(entries, index * ratio, inv_freq))
        per_page = entries_per_page(pool)
        target = table_entry_rows(batch.block_tables, index[:, None], per_page)[:, 0]
        scratch = (pool.shape[0] - 1) * per_page
        target = torch.where(completes & (target >= 0), target, scratch)
        store_entries(pool, target, entries)

    def _request(self, kv, score, start: int, slot: int, state: CompressorState, keep=(), snapshots=None):
        """Pool the windows one request completes; update its state. keep: (page end e, snapshot id) pairs
        inside the chunk, whose overlap rows (the full window e - ratio .. e - 1) go to `snapshots`.

        Returns (entries [m, head_dim] | None, first index)."""
        ratio = self.ratio
        cur = ratio if self.overlap else 0
        filled = start % ratio
        buf_kv = torch.cat((state.kv[slot, cur : cur + filled], kv))
        buf_score = torch.cat((state.score[slot, cur : cur + filled], score))
        done = buf_kv.shape[0] // ratio
        left = buf_kv.shape[0] - done * ratio
        first = start // ratio
        entries = None
        if done:
            win_kv = buf_kv[: done * ratio].view(done, ratio, -1)
            win_score = buf_score[: done * ratio].view(done, ratio, -1)
            if self.overlap:
                pooled_kv, pooled_score = self._overlap(win_kv, win_score, state, slot, first)
            else:
                pooled_kv, pooled_score = win_kv, win_score
            entries = (pooled_kv * pooled_score.softmax(dim=1)).sum(dim=1)
            if keep:
                windows = torch.tensor([end // ratio - first - 1 for end, _ in keep], device=kv.device)
                ids = torch.tensor([snapshot for _, snapshot in keep], device=kv.device)
                snapshots.kv[ids], snapshots.score[ids] = win_kv[windows], win_score[windows]
            if self.overlap:
                state.kv[slot, :ratio] = win_kv[-1]
                state.score[slot, :ratio] = win_score[-1]
        state.kv[slot, cur : cur + left] = buf_kv[done * ratio :]
        state.score[slot, cur : cur + left] = buf_score[done * ratio :]
        return entries, first

    def _overlap(self, win_kv, win_score, state: CompressorState, slot: int, first: int):
        """[m, 2 * ratio, head_dim]: the previous window's first channel half, then this window's second half."""
        d, ratio = self.head_dim, self.ratio
        if first == 0:
            prev_kv = torch.zeros_like(win_kv[:1])
            prev_score = torch.full_like(win_score[:1], float("-inf"))
        else:
            prev_kv, prev_score = state.kv[slot, None, :ratio], state.score[slot, None, :ratio]
        prev_kv = torch.cat((prev_kv, win_kv[:-1]))
        prev_score = torch.cat((prev_score, win_score[:-1]))
        pooled_kv = torch.cat((prev_kv[..., :d], win_kv[..., d:]), dim=1)
        pooled_score = torch.cat((prev_score[..., :d], win_score[..., d:]), dim=1)
        return pooled_kv, pooled_score
