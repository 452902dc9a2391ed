"""The lightning indexer of a CSA layer: picks, per query token, the top-k compressed entries to attend to.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the entries s the token may see (s < (t + 1) // ratio),
with q from the query low-rank residual and k from the indexer's own (overlapping) compressor.

With the packed e4m3 key cache (fp8 mode; see ds4.model.cache) the scores come from ds4.kernels.indexer
(Triton on CUDA, its torch reference elsewhere): q and k are MXFP4-rounded there, which e4m3 with
power-of-two scales holds exactly, so only the order of the sums differs from the dense path.
"""

from __future__ import annotations

import torch
from torch import nn

from ds4.config import ModelConfig
from ds4.kernels.fp4_act import fp4_quant_dequant, hadamard_rotate
from ds4.kernels.indexer import indexer_topk, quantize_rows
from ds4.kernels.rope import apply_rope
from ds4.kernels.topk import topk_indices
from ds4.model.batch import LayerStep
from ds4.model.compressor import Compressor
from ds4.model.linear import DEQUANTIZED, Linear, kept_fp8_block

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


def _round_index(x: torch.Tensor) -> torch.Tensor:
    """fp8 mode keeps the reference's indexer simulation: Hadamard rotation, then MXFP4."""
    return fp4_quant_dequant(hadamard_rotate(x))


class Indexer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        ratio: int,
        dtype: torch.dtype,
        device: torch.device,
        fp8_kv: bool,
        weight_format: str = DEQUANTIZED,
    ):
        super().__init__()
        self.ratio, self.topk = ratio, cfg.index_topk
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.finish = _round_index if fp8_kv else nn.Identity()
        fp8 = kept_fp8_block(cfg, weight_format)
        self.wq_b = Linear(cfg.q_lora_rank, self.heads * self.head_dim, dtype, device, fp8)
        self.weights_proj = Linear(cfg.hidden_size, self.heads, dtype, device)
        self.compressor = Compressor(cfg.hidden_size, ratio, self.head_dim, True, cfg.rms_norm_eps, device, self.finish)
        self.weight_scale = self.head_dim**-0.5 * self.heads**-0.5

    def forward(self, x: torch.Tensor, qr: torch.Tensor, step: LayerStep, visible: torch.Tensor) -> torch.Tensor:
        """Of the pool rows each token may see (visible [T, W], a prefix of each row, -1 past it), the ones it
        attends to: [T, min(index_topk, W)] (-1 = none)."""
        cache = step.cache
        snapshot = cache.snapshot.indexer if cache.snapshot is not None else None
        self.compressor(x, step, cache.indexer, cache.index_keys, snapshot)
        k = min(self.topk, visible.shape[1])
        if k == 0:
            return visible
        q = self.wq_b(qr).view(x.shape[0], self.heads, self.head_dim)
        q = self.finish(apply_rope(q, step.batch.positions, step.inv_freq)).float()
        weights = self.weights_proj(x).float() * self.weight_scale
        if cache.index_keys.dtype == torch.uint8:
            picked = self._packed_top(q, weights, step, visible, k)
        else:
            picked = top_entries(self._scores(q, weights, cache.index_keys, visible), k)
        return torch.where(picked >= 0, visible.gather(1, picked.clamp_min(0)), -1)

    def _scores(self, q, weights, pool, visible) -> torch.Tensor:
        """[T, W] indexer scores over the dense pool's visible rows, -inf past them."""
        keys = pool.view(-1, self.head_dim)
        piece = max(1, _PIECE_BYTES // (4 * visible.shape[1] * (self.heads + self.head_dim)))
        scores = []
        for i in range(0, q.shape[0], piece):
            part = keys[visible[i : i + piece].clamp_min(0)].float()
            per_head = torch.einsum("thd,tsd->ths", q[i : i + piece], part).relu()
            scores.append((per_head * weights[i : i + piece, :, None]).sum(dim=1))
        return torch.cat(scores).masked_fill(visible < 0, float("-inf"))

    def _packed_top(self, q, weights, step: LayerStep, visible, k) -> torch.Tensor:
        """[T, k] entry indices from the packed cache's kernels, which read the keys through the block tables.

        The kernels group rows by request (a prefill chunk shares its keys): a decode_only batch is one group
        of one row a request, the general path one group per request. Entries a token sees form a prefix;
        counting them (not (position + 1) // ratio) keeps the padding rows of a captured batch, whose pages
        are all unassigned, at zero keys."""
        seen = (visible >= 0).sum(dim=1)
        q8, q_scale = quantize_rows(q)
        tables = step.batch.block_tables
        if step.decode_only:
            groups = [(slice(None), tables, 1)]
        else:
            layout = step.layout
            groups = [(layout.token_slice(r), tables[r : r + 1], n) for r, n in enumerate(layout.counts) if n]
        width = visible.shape[1]
        picked = [
            indexer_topk(q8[t], weights[t], step.cache.index_keys, table, seen[t], n, width, k, q_scale=q_scale[t])
            for t, table, n in groups
        ]
        return torch.cat(picked).long()
