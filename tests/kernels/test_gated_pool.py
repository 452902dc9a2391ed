"""The compressor's gated pooling kernel (interpreted on the CPU) against its torch reference, and the reference
against hand values."""

import math

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.gated_pool


@pytest.fixture(scope="module")
def pool():
    return interpreted(ds4.kernels.gated_pool, "_gated_pool_kernel")


def test_reference_hand_example(pool):
    # Rows 0, 1 pooled; channel 0 scores (0, ln 3) -> weights 1/4, 3/4; channel 1 equal scores -> 1/2, 1/2.
    kv = torch.tensor([[4.0, 2.0], [8.0, 6.0], [100.0, 100.0]])
    score = torch.tensor([[0.0, 1.0], [math.log(3), 1.0], [0.0, 0.0]])
    got = pool.gated_pool_reference(kv, score, torch.tensor([[0, 1]]), overlap=False)
    torch.testing.assert_close(got, torch.tensor([[7.0, 4.0]]))
    # Overlap: one channel, from the first half of row 0 (4, score 0) and the second half of row 1 (6, score 1).
    got = pool.gated_pool_reference(kv, score, torch.tensor([[0, 1]]), overlap=True)
    torch.testing.assert_close(got, torch.tensor([[(4 + 6 * math.e) / (1 + math.e)]]))


@pytest.mark.parametrize("ratio,overlap,head_dim", [(4, True, 48), (8, False, 80), (3, False, 16)])
def test_matches_reference(pool, ratio, overlap, head_dim):
    g = torch.Generator().manual_seed(ratio)
    width = (2 if overlap else 1) * head_dim
    sources = 40
    kv = torch.randn(sources, width, generator=g)
    score = torch.randn(sources, width, generator=g) * 3
    score[-1] = float("-inf")  # the empty row windows point at before a request's start or past its end
    span = (2 if overlap else 1) * ratio
    rows = torch.randint(0, sources, (9, span), generator=g)
    rows[0, : span // 2] = sources - 1
    got = pool.gated_pool_triton(kv, score, rows, overlap)
    torch.testing.assert_close(got, pool.gated_pool_reference(kv, score, rows, overlap), rtol=1e-5, atol=1e-6)
