"""`ds4 bench moe`'s skewed inputs (its runs need CUDA): a shared direction sends more of a batch's top-k picks to a
few experts of a random router, counted with torch.topk and bincount."""

import torch

from ds4.bench.moe import inputs


def largest_over_mean(x: torch.Tensor, gate: torch.Tensor, k: int) -> float:
    loads = torch.bincount((x.float() @ gate.T).topk(k, dim=-1).indices.flatten(), minlength=gate.shape[0]).float()
    return (loads.max() / loads.mean()).item()


def test_a_shared_direction_skews_the_routing():
    g = torch.Generator().manual_seed(0)
    hidden, experts, k = 512, 64, 6
    gate = torch.randn(experts, hidden, generator=g) * hidden**-0.5
    balanced = inputs(4096, hidden, 0.0, g)
    skewed = inputs(4096, hidden, 2.0, g)
    assert balanced.shape == skewed.shape == (4096, hidden) and skewed.dtype == torch.bfloat16
    assert largest_over_mean(balanced, gate, k) < 1.5 < 3 < largest_over_mean(skewed, gate, k)
