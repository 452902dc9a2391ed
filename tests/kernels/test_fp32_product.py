"""fp32_product: x W^T in fp32, the oracle a float64 matmul of the same values (every product is exact in fp32, so
only the summation order differs)."""

import pytest
import torch

from ds4.kernels import fp32_product as module
from tests.kernels.interpreted import interpreted


@pytest.fixture(scope="module")
def kernels():
    return interpreted(module, "_gemv_kernel")


def _oracle(x, weight):
    return (x.double() @ weight.double().T).float()


@pytest.mark.parametrize("tokens", [1, 3, 8, 11])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_interpreted_gemv_equals_the_float64_product(kernels, tokens, weight_dtype):
    gen = torch.Generator().manual_seed(tokens)
    weight = torch.randn(24, 80, generator=gen).to(weight_dtype)  # K = 80: K steps of 16 columns
    x = torch.randn(tokens, 80, generator=gen).bfloat16()
    got = kernels.fp32_gemv(x, weight)
    assert got.dtype == torch.float32 and got.shape == (tokens, 24)
    torch.testing.assert_close(got, _oracle(x, weight), rtol=1e-6, atol=1e-5)


def test_gemv_rejects_a_mismatched_weight(kernels):
    with pytest.raises(ValueError, match="does not match"):
        kernels.fp32_gemv(torch.zeros(2, 80), torch.zeros(24, 64))


def test_cpu_product_is_the_fp32_linear():
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(24, 80, generator=gen).bfloat16(), torch.randn(5, 80, generator=gen).bfloat16()
    torch.testing.assert_close(module.fp32_product(x, weight), _oracle(x, weight), rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, module.GEMV_TOKENS, module.GEMV_TOKENS + 1, 64])
@pytest.mark.parametrize("rows", [256, 1024])
def test_product_on_the_gpu_equals_the_float64_product(tokens, rows):
    """Both paths (the GEMV up to GEMV_TOKENS rows, cuBLAS above) at the router's and the compressor's shapes."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    weight = (torch.randn(rows, 4096, device="cuda", generator=g) * 4096**-0.5).bfloat16()
    x = torch.randn(tokens, 4096, device="cuda", generator=g).bfloat16()
    got = module.fp32_product(x, weight)
    torch.testing.assert_close(got.cpu(), _oracle(x.cpu(), weight.cpu()), rtol=1e-5, atol=1e-5)
