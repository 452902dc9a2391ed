"""The indexer's MXFP4 simulation: the rotation against the Sylvester matrix, and the one-launch rotate_fp4 kernel
(interpreted) against its torch reference to the bit."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.fp4_act


@pytest.fixture(scope="module")
def fp4():
    return interpreted(ds4.kernels.fp4_act, "_rotate_fp4_kernel")


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@pytest.mark.parametrize("n", [2, 32, 128])
def test_rotation_is_the_normalised_sylvester_hadamard(fp4, n):
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(n))
    want = x.double() @ sylvester(n) / n**0.5
    torch.testing.assert_close(fp4.hadamard_rotate(x).double(), want, rtol=1e-6, atol=1e-6)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_the_reference_to_the_bit(fp4, dtype):
    """Magnitudes from 1e-30 to 1e30 (the interpreter's bf16 casts mishandle subnormals, the GPU's do not),
    zero and -0 rows, a half-zero row (its negative values round to -0)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 128, generator=g) * torch.logspace(-30, 30, 40)[:, None]
    x[3], x[4] = 0.0, -0.0
    x[5, :64] = 0.0
    x = x.to(dtype).view(4, 10, 128)
    got, want = fp4.rotate_fp4_triton(x), fp4.rotate_fp4_reference(x)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(_bits(got), _bits(want))


def test_kernel_rounds_ties_to_the_even_code(fp4):
    """64 channels (8 = sqrt(64) exactly): rows made as the rotation of e2m1 midpoints rotate back onto them
    exactly, so the kernel's rounding meets every tie; 6 in each block fixes its scale to 1."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(4)
    t = torch.stack([mids.repeat(2), -mids.repeat(2), mids.flip(0).repeat(2) * 2.0**-5])
    x = (t.double() @ sylvester(64) / 8).float()
    assert torch.equal(fp4.hadamard_rotate(x), t)
    got = fp4.rotate_fp4_triton(x)
    even = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]).repeat(4)
    assert torch.equal(got[0], even.repeat(2)) and torch.equal(got[1], -even.repeat(2))
    assert torch.equal(got, fp4.rotate_fp4_reference(x))


def test_shapes_it_cannot_round_fail_loudly(fp4):
    with pytest.raises(ValueError):
        fp4.rotate_fp4_triton(torch.zeros(2, 48))
    with pytest.raises(ValueError):
        fp4.rotate_fp4_triton(torch.zeros(2, 16))
