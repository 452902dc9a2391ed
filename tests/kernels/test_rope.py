"""RoPE kernel (interpreted on the CPU) against its torch reference, and the reference against hand values."""

import math

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.rope


@pytest.fixture(scope="module")
def rope():
    return interpreted(ds4.kernels.rope, "_rope_kernel")


def test_reference_rotates_the_last_pairs_by_position_times_frequency(rope):
    x = torch.tensor([[5.0, 1.0, 0.0, 0.0, 1.0]])  # one leading channel, two pairs
    inv_freq = torch.tensor([0.5, 0.25])
    y = rope.apply_rope_reference(x, torch.tensor([2]), inv_freq)
    # pair (1, 0) turned by 1 rad, pair (0, 1) by 0.5 rad
    want = [5.0, math.cos(1), math.sin(1), -math.sin(0.5), math.cos(0.5)]
    torch.testing.assert_close(y, torch.tensor([want]))
    torch.testing.assert_close(rope.apply_rope_reference(y, torch.tensor([2]), inv_freq, inverse=True), x)


@pytest.mark.parametrize("shape", [(7, 3, 48), (5, 32), (0, 2, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_reference(rope, shape, dtype, inverse):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g).to(dtype)
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=g)
    inv_freq = rope.rope_inv_freq(32, 10000.0)
    got = rope.apply_rope_triton(x, positions, inv_freq, inverse)
    want = rope.apply_rope_reference(x, positions, inv_freq, inverse)
    assert got.shape == x.shape and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert torch.equal(got[..., :-32], x[..., :-32])


def test_heads_of_a_row_slice_of_a_wider_buffer(rope):
    """x [T, H, D] as a row slice of a stacked projection's output (token stride wider than H * D): rotated where
    it lies, the result contiguous."""
    g = torch.Generator().manual_seed(4)
    stacked = torch.randn(5, 3 * 64 + 4 * 48, generator=g)
    x = stacked[:, 3 * 64 :].view(5, 4, 48)
    positions = torch.randint(0, 1 << 20, (5,), generator=g)
    inv_freq = rope.rope_inv_freq(32, 10000.0)
    got = rope.apply_rope_triton(x, positions, inv_freq)
    assert got.is_contiguous() and x.stride(0) == stacked.stride(0)
    torch.testing.assert_close(got, rope.apply_rope_reference(x, positions, inv_freq), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_in_place_rotates_x_itself(rope, layout):
    """in_place writes the rotated channels into x (where its rows lie) and returns x; the leading
    channels are untouched, the rotated ones the reference's."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, 96, generator=g)
    x = base if layout == "contiguous" else base.transpose(0, 1).contiguous().transpose(0, 1)
    positions = torch.randint(0, 1 << 20, (6,), generator=g)
    inv_freq = rope.rope_inv_freq(32, 10000.0)
    want = rope.apply_rope_reference(x, positions, inv_freq, inverse=True)
    got = rope.apply_rope_triton(x, positions, inv_freq, inverse=True, in_place=True)
    assert got is x
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(x[..., :-32], base[..., :-32])


def test_int32_positions_and_yarn_frequencies(rope):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 64, generator=g)
    positions = torch.tensor([0, 1, 65535, 1048575], dtype=torch.int32)
    inv_freq = rope.rope_inv_freq(64, 160000.0, 16.0, 65536)
    got = rope.apply_rope_triton(x, positions, inv_freq)
    torch.testing.assert_close(got, rope.apply_rope_reference(x, positions, inv_freq), rtol=1e-5, atol=1e-5)
