"""The lightning indexer of a CSA layer: picks, per query token, the top-k compressed entries to attend to.

score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) over the entries s the token may see (s < (t + 1) // ratio),
with q from the query low-rank residual and k from the indexer's own (overlapping) compressor.

With the packed e4m3 key cache (fp8 mode; see ds4.model.cache) the scores come from ds4.kernels.indexer
(Triton on CUDA, its torch reference elsewhere): q and k are MXFP4-rounded there, which e4m3 with
power-of-two scales holds exactly, so only the order of the sums differs from the dense path. There a
decode step's indexer is a few launches past its two projections (wq_b's in the attention's launch): the
queries' RoPE and rounding (ds4.kernels.indexer.index_queries), the scores, the top-k, the picks' pool rows; its
keys take two (the rounding, `finish`, and the packed write).
"""

from __future__ import annotations

import torch
from torch import nn

from ds4.config import ModelConfig
from ds4.kernels.fp4_act import rotate_fp4_rows
from ds4.kernels.indexer import entry_rows, index_queries, indexer_topk
from ds4.kernels.paging import table_entry_rows
from ds4.kernels.rope import apply_rope
from ds4.kernels.topk import topk_indices
from ds4.model.batch import LayerStep
from ds4.model.cache import entries_per_page
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
    return rotate_fp4_rows(x)


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
        # Multiplied with the compressors' projections of x (one launch, on the side stream: see Attention), its
        # fp32 products rounded to the model's dtype as the reference's linear stores them.
        self.weights_proj = Linear(cfg.hidden_size, self.heads, dtype, device, fp32_output=True)
        # Without fp8 the keys go straight into their pool; with it, through the rounding, then the packed store.
        finish = self.finish if fp8_kv else None
        self.compressor = Compressor(
            cfg.hidden_size, ratio, self.head_dim, True, cfg.rms_norm_eps, device, dtype, finish
        )
        self.weight_scale = self.head_dim**-0.5 * self.heads**-0.5

    def forward(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        products: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        step: LayerStep,
        width: int,
    ) -> torch.Tensor:
        """Pool rows of the entries each token attends to, [T, min(index_topk, width)] (-1 = none); a token's
        scores span `width` entries (see Attention._entry_width), -inf past the ones it sees. The attention
        multiplies the projections with its own: q is wq_b of the query low-rank residual [T, heads * head_dim],
        `products` the compressor's wkv and wgate products of x and weights_proj's (fp32)."""
        batch, cache = step.batch, step.cache
        snapshot = cache.snapshot.indexer if cache.snapshot is not None else None
        kv, score, weights = products
        self.compressor(kv, score, step, cache.indexer, cache.index_keys, snapshot)
        k = min(self.topk, width)
        if k == 0 or x.shape[0] == 0:
            return torch.full((x.shape[0], 0), -1, dtype=torch.long, device=x.device)
        pool = cache.index_keys
        q = q.view(x.shape[0], self.heads, self.head_dim)
        if pool.dtype == torch.uint8:  # RoPE, and the weights' rounding to x's dtype, inside the queries' launch
            q, weights = index_queries(q, weights, self.weight_scale, rope=(batch.positions, step.inv_freq))
            top = indexer_topk
        else:
            q = self.finish(apply_rope(q, batch.positions, step.inv_freq)).float()
            weights = weights.to(x.dtype).float() * self.weight_scale
            top = self._dense_topk
        # Entries a token sees, the same in every layer of this ratio.
        key_end = batch.shared(
            ("index key ends", self.ratio, width),
            lambda: ((batch.positions + 1) // self.ratio).clamp(max=width).to(torch.int32),
        )
        picks = [top(q[t], weights[t], pool, table, key_end[t], n, width, k) for t, table, n in self._groups(step)]
        picked = picks[0] if len(picks) == 1 else torch.cat(picks)
        return entry_rows(picked, key_end, batch.block_tables, step.token_requests, entries_per_page(pool))

    @staticmethod
    def _groups(step: LayerStep) -> list[tuple[slice, torch.Tensor, int]]:
        """(tokens, their block table rows, tokens a request) in groups of requests with equal token counts, as
        the scorers take them (a request's tokens share its keys): a decode_only batch is one group of
        tokens_per_request tokens a request, a general step one group per request."""
        tables = step.batch.block_tables
        if step.decode_only:
            return [(slice(None), tables, step.batch.tokens_per_request)]
        layout = step.layout
        return [(layout.token_slice(r), tables[r : r + 1], n) for r, n in enumerate(layout.counts) if n]

    def _dense_topk(self, q, weights, pool, tables, visible, per_request, width, k) -> torch.Tensor:
        """ds4.kernels.indexer.indexer_topk over the dense pool: [rows, k] entry indices of the top scores, the
        rows grouped per_request a request (tables [rows // per_request, pages]). A request's keys are gathered
        once; its rows are scored a piece at a time."""
        keys, per_page, count = pool.view(-1, self.head_dim), pool.shape[1], tables.shape[0]
        budget = max(1, _PIECE_BYTES // (4 * width * (self.heads + self.head_dim)))
        requests_per_piece, rows_per_piece = max(1, budget // per_request), min(per_request, budget)
        q = q.view(count, per_request, self.heads, self.head_dim)
        weights = weights.view(count, per_request, self.heads, 1)
        visible = visible.view(count, per_request, 1)
        entries = torch.arange(width, device=q.device)
        picked = torch.empty(count, per_request, k, dtype=torch.long, device=q.device)
        for g in range(0, count, requests_per_piece):
            requests = slice(g, g + requests_per_piece)
            key_rows = table_entry_rows(tables[requests], entries.expand(tables[requests].shape[0], -1), per_page)
            request_keys = keys[key_rows.clamp_min(0)].float()
            for t in range(0, per_request, rows_per_piece):
                rows = (requests, slice(t, t + rows_per_piece))
                per_head = torch.einsum("gthd,gsd->gths", q[rows], request_keys).relu()
                scores = (per_head * weights[rows]).sum(dim=2)
                hidden = (entries >= visible[rows]) | (key_rows < 0)[:, None, :]
                scores = scores.masked_fill(hidden, float("-inf"))
                picked[rows] = top_entries(scores.flatten(0, 1), k).view(*scores.shape[:2], k)
        return picked.flatten(0, 1)
