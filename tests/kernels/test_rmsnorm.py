"""RMSNorm kernel (interpreted on the CPU) against its torch reference."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.rmsnorm


@pytest.fixture(scope="module")
def norm():
    return interpreted(ds4.kernels.rmsnorm, "_rms_norm_kernel")


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 100), (1, 512), (0, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_matches_reference(norm, shape, dtype, weighted):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = (torch.randn(shape[-1], generator=g) + 1).to(torch.bfloat16) if weighted else None
    got = norm.rms_norm_triton(x, weight, 1e-6)
    want = norm.rms_norm_reference(x, weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_strided_rows(norm):
    x = torch.randn(6, 96)[:, :48]
    torch.testing.assert_close(norm.rms_norm_triton(x, None, 1e-6), norm.rms_norm_reference(x, None, 1e-6))
