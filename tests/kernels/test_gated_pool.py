"""The compressor's entries kernel (gated pooling, then the entries' norm, RoPE and form; interpreted on the CPU)
against its torch reference, and the reference's pooling against hand values."""

import math

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.fp8_kv
import ds4.kernels.gated_pool
import ds4.kernels.norm_rope
import ds4.kernels.rmsnorm
import ds4.kernels.rope
from ds4.kernels.fp8_kv import quantize_kv
from ds4.kernels.rope import rope_inv_freq


@pytest.fixture(scope="module")
def pool():
    deps = (ds4.kernels.fp8_kv, ds4.kernels.rmsnorm, ds4.kernels.rope, ds4.kernels.norm_rope)
    return interpreted(ds4.kernels.gated_pool, "_pooled_entries_kernel", *deps)


def test_reference_hand_example(pool):
    # Ring row 0 and fresh row 0 pooled; channel 0 scores (0, ln 3) -> weights 1/4, 3/4; channel 1 equal -> 1/2, 1/2.
    ring = (torch.tensor([[4.0, 2.0], [100.0, 100.0]]), torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    fresh = (torch.tensor([[8.0, 6.0]]), torch.tensor([[math.log(3), 1.0]]))
    no_bias = torch.zeros(2, 2)
    got = pool.gated_pool_reference(ring, fresh, no_bias, torch.tensor([[0, 2]]))
    torch.testing.assert_close(got, torch.tensor([[7.0, 4.0]]))
    # The position bias of the second place tips channel 1 as channel 0's scores did; -1 is an empty row.
    bias = torch.tensor([[0.0, 0.0], [0.0, math.log(3)]])
    got = pool.gated_pool_reference(ring, fresh, bias, torch.tensor([[0, 2], [-1, 2]]))
    torch.testing.assert_close(got, torch.tensor([[7.0, 5.0], [8.0, 6.0]]))
    # Overlap (ratio 1): one channel, from the first half of ring row 0 (4, score 0) and the second half of the
    # fresh row (6, score 1).
    got = pool.gated_pool_reference(ring, fresh, torch.zeros(1, 2), torch.tensor([[0, 2]]))
    torch.testing.assert_close(got, torch.tensor([[(4 + 6 * math.e) / (1 + math.e)]]))


@pytest.mark.parametrize(
    "ratio,overlap,head_dim,rope,dtype,fp8",
    [(4, True, 80, 16, torch.float32, True), (8, False, 128, 64, torch.bfloat16, True),
     (4, True, 64, 32, torch.bfloat16, False), (3, False, 80, 16, torch.float32, False),
     (64, False, 128, 64, torch.bfloat16, True)],  # 64 x 128: a row pooled in channel blocks (HCA's path)
)  # fmt: skip
def test_matches_reference(pool, ratio, overlap, head_dim, rope, dtype, fp8):
    g = torch.Generator().manual_seed(ratio + head_dim)
    width, span, n = (2 if overlap else 1) * head_dim, (2 if overlap else 1) * ratio, 6
    ring = (torch.randn(24, width, generator=g), torch.randn(24, width, generator=g) * 3)
    stacked = torch.randn(7, 2 * width, generator=g)  # fresh rows: slices of one buffer, as the compressor has them
    stacked[:, width:] *= 3
    fresh = (stacked[:, :width], stacked[:, width:])
    ape = torch.randn(ratio, width, generator=g)
    rows = torch.randint(-1, 31, (n, span), generator=g)
    rows[0, : span // 2] = -1  # a window reaching before the request's start
    index = torch.randint(0, 5000, (n,), generator=g)
    weight = torch.rand(head_dim, generator=g) + 0.5
    form = pool.EntryForm(weight, rope_inv_freq(rope, 160000.0), 1e-6, dtype, fp8)
    values = pool.EntryForm(weight, form.inv_freq, 1e-6, dtype)
    args = (ring, fresh, ape, rows, index)
    got = pool.pooled_entries_triton(*args, values)
    # fp32 softmax sums in another order: an fp32 ulp, or a bf16 step where that crosses a rounding boundary.
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got.float(), pool.pooled_entries_reference(*args, values).float(), **tol)
    want = quantize_kv(got, rope) if fp8 else got
    assert torch.equal(pool.pooled_entries_triton(*args, form), want)
    # Written into pool rows: the other rows keep what they held, and a window sent to the skipped (scratch) row 9
    # is not even pooled.
    targets = torch.tensor([3, 9, 0, 7, 5, 2])
    cache = torch.full((10, want.shape[1]), 7, dtype=want.dtype)
    assert pool.pooled_entries_triton(*args, form, cache, targets, skip=9) is None
    kept = targets != 9
    assert torch.equal(cache[targets[kept]], want[kept]) and (cache[[1, 4, 6, 8, 9]] == 7).all()
