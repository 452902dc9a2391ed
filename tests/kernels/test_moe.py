"""Routed experts: the grouped loop and the dense fixed-shape form (the decode path's) equal a per-token sum."""

import torch

from ds4.kernels.moe import routed_experts, routed_experts_dense


def _per_token(x, weights, indices, w1, w2, w3, limit):
    """Each token alone: sum over its k experts of w2 (silu(min(w1 x, limit)) * clamp(w3 x) * weight)."""
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t].tolist(), indices[t].tolist()):
            gate = (w1[e] @ x[t]).clamp(max=limit)
            up = (w3[e] @ x[t]).clamp(-limit, limit)
            out[t] += w2[e] @ (gate * torch.sigmoid(gate) * up * weight)
    return out


def test_dense_and_grouped_experts_equal_the_per_token_sum():
    gen = torch.Generator().manual_seed(0)
    e, d, i, t, k = 6, 16, 24, 9, 2
    x = torch.randn(t, d, generator=gen)
    w1, w3 = torch.randn(e, i, d, generator=gen), torch.randn(e, i, d, generator=gen)
    w2 = torch.randn(e, d, i, generator=gen) * 0.1
    indices = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    indices[3] = torch.tensor([5, 0])  # expert 1..4 unused by this token; expert 5 first in its list
    weights = torch.rand(t, k, generator=gen)
    expected = _per_token(x, weights, indices, w1, w2, w3, limit=2.0)
    for experts in (routed_experts, routed_experts_dense):
        got = experts(x, weights, indices, w1, w2, w3, 2.0)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), experts.__name__


def test_dense_experts_ignore_overflow_in_experts_a_token_did_not_pick():
    x = torch.tensor([[1.0], [1.0]])
    w1 = torch.tensor([[[1.0]], [[3e38]]])  # expert 1 overflows to inf without a clamp (limit 0: none)
    w3 = torch.tensor([[[1.0]], [[3e38]]])
    w2 = torch.ones(2, 1, 1)
    got = routed_experts_dense(x, torch.ones(2, 1), torch.tensor([[0], [0]]), w1, w2, w3, 0.0)
    assert torch.isfinite(got).all()
