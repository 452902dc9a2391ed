"""Bias-free linear layers filled by load_weights: floating, or FP8 as the checkpoint stores them.

Weight formats of a model (DeepseekV4Model's `weight_format`): CHECKPOINT keeps FP8 linears in e4m3 with their
128x128 block scales (held as fp32 powers of two) and multiplies them with act_quant'ed activations
(ds4.kernels.fp8_linear); DEQUANTIZED holds every weight in a floating dtype (the CPU path and the spec).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ds4.checkpoint.quant import e8m0_to_float, fp8_block_dequantize
from ds4.config import ModelConfig
from ds4.kernels.fp8_linear import QUANT_BLOCK, fp8_linear, shared_act_quant
from ds4.kernels.fp32_product import fp32_product
from ds4.model.shard import cut, hold, read, read_grouped, region_of

CHECKPOINT, DEQUANTIZED = "checkpoint", "dequantized"
WEIGHT_FORMATS = (CHECKPOINT, DEQUANTIZED)


def kept_fp8_block(cfg: ModelConfig, weight_format: str) -> tuple[int, int] | None:
    """The FP8 block shape when FP8 linears stay quantised; None when they are held dequantised."""
    return cfg.fp8_block if weight_format == CHECKPOINT else None


class Linear(nn.Module):
    """y = x W^T. `groups` > 1: x holds that many column groups and the weight that many row blocks, block g
    multiplying group g only (the attention's grouped wo_a). `quantize_input=False` multiplies an FP8 weight
    without act_quant on the input, as the reference does for wo_a. `fp32_output`: y in fp32 as the reference's
    x.float() @ W.float().T (the compressor's projections; see fp32_product). rows / cols: the part of the stored
    weight this layer holds (a tensor-parallel shard, see ds4.model.shard); None: all of it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device,
        fp8_block: tuple[int, int] | None = None,
        groups: int = 1,
        quantize_input: bool = True,
        rows: slice | None = None,
        cols: slice | None = None,
        fp32_output: bool = False,
    ):
        super().__init__()
        self.dtype, self.groups, self.quantize_input, self.fp32_output = dtype, groups, quantize_input, fp32_output
        if fp8_block is not None and tuple(fp8_block) != (QUANT_BLOCK, QUANT_BLOCK):
            raise ValueError(f"FP8 linears in checkpoint precision need 128x128 blocks, the config has {fp8_block}")
        weight_dtype = torch.float8_e4m3fn if fp8_block is not None else dtype
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=weight_dtype, device=device), requires_grad=False
        )
        hold(self.weight, rows, cols)
        self.scale = None
        if fp8_block is not None:
            blocks = (-(-out_features // QUANT_BLOCK), -(-in_features // QUANT_BLOCK))
            self.scale = nn.Parameter(torch.empty(blocks, dtype=torch.float32, device=device), requires_grad=False)

    @torch.no_grad()
    def load(self, weight, scale, block: tuple[int, int] | None) -> None:
        """A stored weight (with its e8m0 `scale` for an FP8 one), a tensor or a lazy slice of which only this
        layer's part is read: kept as is, or dequantised into this layer."""
        region = region_of(self.weight)
        if scale is None:
            self.weight.copy_(read(weight, region))
            return
        weight, scale, offset = read_grouped(weight, scale, region, block)
        if self.scale is not None:
            self.weight.copy_(weight)
            self.scale.copy_(e8m0_to_float(scale.to(self.scale.device)))
        else:
            device = self.weight.device
            full = fp8_block_dequantize(weight.to(device), scale.to(device), block, self.dtype)
            self.weight.copy_(cut(full, offset, self.weight.shape))

    def forward(self, x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """quantized: x's act_quant from `quantize_shared_input`, if this layer is one of those it was made for."""
        if self.scale is not None:
            return fp8_linear(
                x, self.weight, self.scale, self.groups, self.quantize_input, out_dtype=self.dtype, quantized=quantized
            )
        if self.fp32_output:
            return fp32_product(x, self.weight)
        x = x.to(self.weight.dtype)
        if self.groups == 1:
            return F.linear(x, self.weight)
        w = self.weight.view(self.groups, -1, self.weight.shape[1])
        return torch.einsum("tgd,grd->tgr", x.view(x.shape[0], self.groups, -1), w).flatten(1)


def quantize_shared_input(x: torch.Tensor, *layers: Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x act_quant'ed once for FP8 layers that would each act_quant it (ds4.kernels.fp8_linear.shared_act_quant),
    else None; pass it to each layer's forward with x."""
    if any(layer.scale is None or not layer.quantize_input or layer.groups != 1 for layer in layers):
        return None
    return shared_act_quant(x, [layer.weight for layer in layers])


class Norm(nn.Module):
    """Holds an RMSNorm weight (fp32, as the reference computes norms)."""

    def __init__(self, dim: int, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device), requires_grad=False)


def fp32_param(*shape: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device), requires_grad=False)
