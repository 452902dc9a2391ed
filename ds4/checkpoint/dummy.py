"""Dummy weights (`--load-format dummy`): a checkpoint's tensors made up on the device from its config alone.

`dummy_weights` yields (official name, stored tensor) in the checkpoint's own shapes and dtypes (FP8 e4m3
linears with UE8M0 128x128 block scales, MXFP4-packed experts with UE8M0 scales per 32, bf16 / fp32 / int32
otherwise), one tensor at a time, generated on the target device: no file is read, nothing is held back.
Values follow the tiny model's law (`tiny.value_law`: projections ~ N(0, 1/in), norms ~ 1), so activations
stay finite through every layer of a real-size model:
  - FP8: e4m3 values ~ N(0, 1) times one power-of-two scale per block, the one nearest to in^-1/2;
  - MXFP4: uniformly random bytes (every e2m1 code equally likely, RMS value E2M1_RMS) times the power of
    two nearest to in^-1/2 / E2M1_RMS;
  - the score routers' bias (the checkpoint's e_score_correction_bias) zero. A trained one keeps the experts'
    loads balanced; random values (the tiny law's N(0, 0.1)) beside scores that spread by about 0.2 make some
    experts take several times their share, which would make a benchmark's MoE time that of a skewed load.
    Flash's first 5 layers cut to 24 experts, one 512-token prompt on the CPU, the two score layers' rows an
    expert around a mean of 128: std 65 and 84 (max 393) with random biases, 38 and 51 (max 263) with zero ones,
    where a balanced draw gives about 10; what remains comes from the tokens of one prompt sharing much of their
    hidden state in a random model (independent inputs: within 1.5x of a balanced draw, see the tests).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Iterator

import torch

from ds4.checkpoint.quant import E2M1_VALUES, fp8_block_dequantize, mxfp4_dequantize
from ds4.checkpoint.tiny import random_routes, value_law
from ds4.checkpoint.weights_spec import INDEX, StoredSpec, expected_parameter_shapes, stored_tensor_specs
from ds4.config import ModelConfig

# The root mean square of the e2m1 values when all 16 codes are equally likely.
E2M1_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
_E8M0_BIAS = 127
ROUTER_BIAS = ".ffn.gate.bias"  # official name of a score layer's router bias (zero here: see the module doc)


def dummy_weights(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    seed: int = 0,
    with_mtp: bool = False,
    holds: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, stored tensor) for every tensor of the checkpoint, each weight followed by its `.scale`.

    Every tensor's values depend on the seed and its name only, so the ranks of a sharded model make the same
    tensors and each keeps its part; holds(name) False (a shard's `holds`: another rank's experts): not made."""
    device = torch.device(device)
    stored = stored_tensor_specs(cfg, with_mtp)
    for name, spec in expected_parameter_shapes(cfg, with_mtp).items():
        if holds is not None and not holds(name):
            continue
        gen = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        weight = stored[name]
        scale_name = name.removesuffix(".weight") + ".scale"
        if spec.kind == INDEX:
            yield name, random_routes(cfg, spec, gen).to(torch.int32)
        elif weight.dtype == torch.float8_e4m3fn:
            values = torch.randn(weight.shape, generator=gen, device=device).to(torch.float8_e4m3fn)
            yield name, values
            yield scale_name, _power_of_two(stored[scale_name], spec.shape[-1] ** -0.5, device)
        elif weight.dtype == torch.int8:
            codes = torch.randint(0, 256, weight.shape, generator=gen, device=device, dtype=torch.uint8)
            yield name, codes.view(torch.int8)
            yield scale_name, _power_of_two(stored[scale_name], spec.shape[-1] ** -0.5 / E2M1_RMS, device)
        elif name.endswith(ROUTER_BIAS):
            yield name, torch.zeros(weight.shape, dtype=weight.dtype, device=device)
        else:
            mean, std = value_law(name, spec)
            values = torch.randn(weight.shape, generator=gen, device=device) * std + mean
            yield name, values.to(weight.dtype)


def _power_of_two(spec: StoredSpec, target: float, device: torch.device) -> torch.Tensor:
    """A UE8M0 scale tensor holding the power of two nearest to target everywhere."""
    exponent = round(math.log2(target))
    return torch.full(spec.shape, _E8M0_BIAS + exponent, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)


def dequantised(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stored (name, tensor) pairs -> the model's dequantised ones (FP8 and MXFP4 weights times their scales).

    A weight waits only for its own `.scale`, which follows it in dummy_weights and in the reader's order."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(".scale"):
            weight_name = name.removesuffix(".scale") + ".weight"
            weight = waiting.pop(weight_name)
            if weight.dtype == torch.int8:
                yield weight_name, mxfp4_dequantize(weight, tensor, dtype)
            else:
                yield weight_name, fp8_block_dequantize(weight, tensor, cfg.fp8_block, dtype)
        elif tensor.element_size() == 1 and tensor.dtype != torch.uint8:
            waiting[name] = tensor
        else:
            yield name, tensor
    if waiting:
        raise ValueError(f"weights without a .scale: {sorted(waiting)[:8]}")
