"""The token embedding and the output head, split by vocabulary rows across ranks.

A rank holds rows V / N * rank onward of both. Embedding: a rank looks up the tokens in its rows (zeros for
the others) and an all-reduce sums the ranks' rows into every token's embedding. Head: a rank computes its
slice of every row's logits, and an all-gather gives every rank the whole row (sampling then needs nothing
more). At world size 1 both are the plain lookup and the plain fp32 product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ds4.distributed.parallel import Parallel
from ds4.kernels.fp32_product import fp32_product
from ds4.model.shard import hold


class VocabEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device: torch.device, parallel: Parallel):
        super().__init__()
        self.parallel = parallel
        rows = parallel.shard(vocab)
        self.first = rows.start
        weight = nn.Parameter(torch.empty(rows.stop - rows.start, dim, dtype=dtype, device=device), requires_grad=False)
        self.weight = hold(weight, None if parallel.is_single else rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.is_single:
            return F.embedding(ids, self.weight)
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.parallel.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))


class VocabHead(nn.Module):
    """fp32 logits, as the reference computes them (x.float() @ W.float().T), from a weight held in the model's
    dtype (the checkpoint's bf16 on CUDA: half the bytes a decode step reads; see fp32_product)."""

    def __init__(self, dim: int, vocab: int, dtype: torch.dtype, device: torch.device, parallel: Parallel):
        super().__init__()
        self.parallel = parallel
        rows = parallel.shard(vocab)
        weight = torch.empty(rows.stop - rows.start, dim, dtype=dtype, device=device)
        self.weight = hold(nn.Parameter(weight, requires_grad=False), None if parallel.is_single else rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_gather(fp32_product(x, self.weight), dim=-1)
