"""The lightning indexer of a CSA layer: picks, per query token, the top-k compressed entries to attend to.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the entries s the token may see (s < (t + 1) // ratio),
with q from the query low-rank residual and k from the indexer's own (overlapping) compressor.

With the packed e4m3 key cache (fp8 mode; see ds4.model.cache) the scores come from ds4.kernels.indexer
(Triton on CUDA, its torch reference elsewhere): q and k are MXFP4-rounded there, which e4m3 with
power-of-two scales holds exactly, so only the order of the sums differs from the dense path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ds4.config import ModelConfig
from ds4.kernels.indexer import indexer_logits, indexer_topk, quantize_rows
from ds4.kernels.rope import apply_rope
from ds4.kernels.topk import topk_indices
from ds4.model.batch import ForwardBatch, StepLayout
from ds4.model.cache import LayerCache, entries_per_page
from ds4.model.compressor import Compressor
from ds4.model.linear import DEQUANTIZED, Linear, kept_fp8_block
from ds4.model.paging import entry_rows, visible_entry_rows

# Per-head scores are formed for a piece of tokens at a time, at most this many bytes.
_PIECE_BYTES = 1 << 28


def top_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row (the order among them does not matter).

    On CUDA the exact Triton top-k (ties to the lowest index, no host sync, graph-safe); elsewhere a stable
    sort, which breaks ties the same way. Ties are common (relu makes whole scores 0), and torch.topk breaks
    them by the row's length, so chunked and whole prefill would pick different entries.
    """
    if scores.is_cuda and k > 0 and scores.shape[0] > 0:
        lengths = torch.full((scores.shape[0],), scores.shape[1], dtype=torch.int32, device=scores.device)
        return topk_indices(scores, lengths, k).long()
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class Indexer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ratio: int, dtype: torch.dtype, device: torch.device, weight_format: str = DEQUANTIZED
    ):
        super().__init__()
        self.ratio, self.topk = ratio, cfg.index_topk
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        fp8 = kept_fp8_block(cfg, weight_format)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.head_dim, dtype, device, fp8)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, dtype, device)
        self.compressor = Compressor(cfg.hidden_size, ratio, self.head_dim, True, cfg.rms_norm_eps, device)
        self.weight_scale = self.head_dim**-0.5 * self.heads**-0.5

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        layout: StepLayout,
        cache: LayerCache,
        inv_freq: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Rows of the flattened compressed pool each token attends to: [T, k] (-1 = none)."""
        snapshot = cache.snapshot.indexer if cache.snapshot is not None else None
        self.compressor(x, batch, layout, cache.indexer, cache.index_keys, inv_freq, finish, snapshot)
        q = self.wq_b(qr).view(x.shape[0], self.heads, self.head_dim)
        q = finish(apply_rope(q, batch.positions, inv_freq)).float()
        weights = self.weights_proj(x).float() * self.weight_scale
        pool = cache.index_keys
        per_page = entries_per_page(pool)
        packed = pool.dtype == torch.uint8
        q8, q_scale = quantize_rows(q) if packed else (None, None)
        per_request = []
        for r in range(len(layout.counts)):
            tokens = layout.token_slice(r)
            n_entries = (layout.context_lens[r] + layout.counts[r]) // self.ratio
            if layout.counts[r] == 0 or n_entries == 0:
                per_request.append(torch.full((layout.counts[r], 0), -1, dtype=torch.long, device=x.device))
                continue
            rows = entry_rows(batch.block_tables[r], torch.arange(n_entries, device=x.device), per_page)
            if packed:
                picked = indexer_topk(
                    q8[tokens],
                    weights[tokens],
                    pool,
                    batch.block_tables[r : r + 1],
                    (batch.positions[tokens] + 1) // self.ratio,
                    layout.counts[r],
                    n_entries,
                    min(self.topk, n_entries),
                    q_scale=q_scale[tokens],
                ).long()
                per_request.append(torch.where(picked >= 0, rows[picked.clamp_min(0)], -1))
            else:
                keys = pool.view(-1, self.head_dim)[rows].float()
                per_request.append(self._select(q[tokens], weights[tokens], keys, rows, batch.positions[tokens]))
        width = max((p.shape[1] for p in per_request), default=0)
        return torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=-1) for p in per_request])

    def decode(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        batch: ForwardBatch,
        cache: LayerCache,
        inv_freq: torch.Tensor,
        finish: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """forward for a decode_only batch, without host syncs: scores over every entry the block table can
        hold (unseen ones -inf), then the top min(index_topk, that width). [T, k] rows (-1 = none)."""
        self.compressor.decode(x, batch, cache.indexer, cache.index_keys, inv_freq, finish)
        q = self.wq_b(qr).view(x.shape[0], self.heads, self.head_dim)
        q = finish(apply_rope(q, batch.positions, inv_freq)).float()
        weights = self.weights_proj(x).float() * self.weight_scale
        pool = cache.index_keys
        rows = visible_entry_rows(batch.block_tables, batch.positions, self.ratio, entries_per_page(pool))
        k = min(self.topk, rows.shape[1])
        if k == 0:
            return rows[:, :0]
        if pool.dtype == torch.uint8:
            # Entries a token sees form a prefix; counting them (not (position + 1) // ratio) keeps the
            # padding rows of a captured batch, whose pages are all unassigned, at zero keys.
            seen = (rows >= 0).sum(dim=1)
            q8, q_scale = quantize_rows(q)
            scores = indexer_logits(q8, weights, pool, batch.block_tables, seen, 1, rows.shape[1], q_scale=q_scale)
            picked = topk_indices(scores, seen, k).long()
        else:
            keys = pool.view(-1, self.head_dim)
            piece = max(1, _PIECE_BYTES // (4 * max(1, rows.shape[1]) * (self.heads + self.head_dim)))
            scores = torch.cat(
                [
                    (
                        torch.einsum(
                            "thd,tsd->ths", q[i : i + piece], keys[rows[i : i + piece].clamp_min(0)].float()
                        ).relu()
                        * weights[i : i + piece, :, None]
                    ).sum(dim=1)
                    for i in range(0, q.shape[0], piece)
                ]
            )
            picked = top_entries(scores.masked_fill(rows < 0, float("-inf")), k)
        return torch.where(picked >= 0, rows.gather(1, picked.clamp_min(0)), -1)

    def _select(self, q, weights, keys, rows, positions) -> torch.Tensor:
        piece = max(1, _PIECE_BYTES // (4 * self.heads * keys.shape[0]))
        scores = torch.cat(
            [
                (torch.einsum("thd,sd->ths", q[i : i + piece], keys).relu() * weights[i : i + piece, :, None]).sum(
                    dim=1
                )
                for i in range(0, q.shape[0], piece)
            ]
        )
        visible = (positions + 1) // self.ratio
        entry = torch.arange(keys.shape[0], device=q.device)
        scores = scores.masked_fill(entry[None, :] >= visible[:, None], float("-inf"))
        picked = top_entries(scores, min(self.topk, keys.shape[0]))
        return torch.where(picked < visible[:, None], rows[picked], torch.full_like(picked, -1))
