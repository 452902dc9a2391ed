"""StackedLinears: linears of one input held in one buffer give what each layer gives alone. Oracle: the FP8
linear's reference (act_quant, then an fp32 product with the dequantised weight) on each loaded tensor, and plain
matmuls for floating weights."""

import pytest
import torch

from ds4.checkpoint.quant import fp8_block_quantize
from ds4.kernels.fp8_linear import fp8_linear_reference
from ds4.kernels.fp32_product import fp32_product
from ds4.model.linear import Linear, StackedLinears
from ds4.model.shard import region_of

CPU = torch.device("cpu")
BLOCK = (128, 128)


def _fp8_layers(sizes, k, gen, **kwargs):
    layers, stored = [], []
    for n in sizes:
        layers.append(Linear(k, n, torch.bfloat16, CPU, BLOCK, **kwargs))
        stored.append(fp8_block_quantize(torch.randn(n, k, generator=gen) * k**-0.5, BLOCK))
    return layers, stored


@pytest.mark.parametrize("rows", [(256, 128), (128, 200)])  # 200: rows inside a scale block, each layer alone
def test_fp8_layers_stacked_give_each_layer_s_product(rows):
    gen = torch.Generator().manual_seed(sum(rows))
    layers, stored = _fp8_layers(rows, 384, gen)
    stacked = StackedLinears(*layers)
    assert stacked.stacked == all(n % 128 == 0 for n in rows)
    for layer, (weight, scale) in zip(layers, stored):  # loading after stacking fills the stacked buffer
        layer.load(weight, scale, BLOCK)
    x = torch.randn(5, 384, generator=gen).bfloat16()
    outputs = stacked(x)
    assert len(outputs) == len(rows)
    for out, (weight, scale) in zip(outputs, stored):
        want = fp8_linear_reference(x, weight, scale.float(), out_dtype=torch.bfloat16)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_fp32_output_layers_stacked_give_fp32_products():
    gen = torch.Generator().manual_seed(7)
    layers = [Linear(64, n, torch.bfloat16, CPU, fp32_output=True) for n in (48, 16)]
    stacked = StackedLinears(*layers)
    weights = [torch.randn(n, 64, generator=gen).bfloat16() for n in (48, 16)]
    for layer, w in zip(layers, weights):
        layer.load(w, None, None)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    for out, w in zip(stacked(x), weights):
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, (x.double() @ w.double().T).float(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out, fp32_product(x, w), rtol=0, atol=0)


def test_stacking_keeps_each_layer_s_parameters_and_shard_region():
    gen = torch.Generator().manual_seed(3)
    layers, _ = _fp8_layers((128, 128), 256, gen, rows=slice(128, 256))
    stacked = StackedLinears(*layers)
    for layer in layers:
        assert region_of(layer.weight).rows == slice(128, 256)
        assert layer.weight.untyped_storage().data_ptr() == stacked.weight.untyped_storage().data_ptr()
        assert layer.scale.untyped_storage().data_ptr() == stacked.scale.untyped_storage().data_ptr()
    names = [name for name, _ in torch.nn.ModuleDict({"a": layers[0], "b": layers[1], "s": stacked}).named_parameters()]
    assert names == ["a.weight", "a.scale", "b.weight", "b.scale"]  # the buffer is not a parameter of its own


def test_layers_that_multiply_differently_cannot_stack():
    with pytest.raises(ValueError, match="differently"):
        StackedLinears(Linear(64, 16, torch.bfloat16, CPU), Linear(32, 16, torch.bfloat16, CPU))
    with pytest.raises(ValueError, match="differently"):
        StackedLinears(Linear(256, 128, torch.bfloat16, CPU, BLOCK), Linear(256, 128, torch.bfloat16, CPU))
