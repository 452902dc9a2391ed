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
from ds4.kernels.fp8_linear import QUANT_BLOCK, fp8_linear
from ds4.kernels.fp32_product import fp32_product
from ds4.kernels.rmsnorm import rms_norm
from ds4.kernels.swiglu import swiglu_to
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.multiply(x, self.weight, self.scale)

    def gated(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """self(swiglu(gate, up, limit) in gate's dtype): an FP8 layer takes gate and up as its kernel's input (no
        launch of their own at decode)."""
        if self.scale is not None:
            return fp8_linear(
                gate, self.weight, self.scale, self.groups, self.quantize_input, self.dtype, swiglu_up=up,
                swiglu_limit=limit,
            )  # fmt: skip
        return self(swiglu_to(gate, up, limit, gate.dtype))

    def normed(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """self(rms_norm(x, norm, eps)): an FP8 layer normalises x as its kernel loads it (no launch of its own at
        one token)."""
        return self.multiply(x, self.weight, self.scale, (norm, eps))

    def multiply(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        norm: tuple[torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """x (first rms_norm'ed with `norm`'s weight and eps, if given) times `weight` (with FP8 block `scale`) as
        this layer multiplies its own: StackedLinears passes the weights of several such layers at once."""
        if scale is not None:
            return fp8_linear(x, weight, scale, self.groups, self.quantize_input, out_dtype=self.dtype, norm=norm)
        if norm is not None:
            x = rms_norm(x, *norm)
        if self.fp32_output:
            return fp32_product(x, weight)
        x = x.to(weight.dtype)
        if self.groups == 1:
            return F.linear(x, weight)
        w = weight.view(self.groups, -1, weight.shape[1])
        return torch.einsum("tgd,grd->tgr", x.view(x.shape[0], self.groups, -1), w).flatten(1)


class StackedLinears(nn.Module):
    """Linears that multiply the same input alike, their weights (and FP8 block scales) held as row slices of one
    buffer, so that one launch multiplies x by all of them: one act_quant and one stream of weights at decode (each
    launch there costs a latency of several microseconds), one GEMM at prefill. Each layer keeps its parameters
    (views of the buffer, with their shard regions), so loading fills them as before. FP8 layers whose rows end
    inside a 128-row scale block cannot share a block grid: they run one by one."""

    def __init__(self, *layers: Linear):
        super().__init__()
        first = layers[0]
        if any(_linear_kind(layer) != _linear_kind(first) for layer in layers):
            raise ValueError(
                f"StackedLinears: layers multiply their input differently: {[_linear_kind(layer) for layer in layers]}"
            )
        self.parts = tuple(layers)  # a tuple, not submodules: the layers stay registered where they are
        self.sizes = [layer.weight.shape[0] for layer in layers]
        self.stacked = first.scale is None or all(n % QUANT_BLOCK == 0 for n in self.sizes)
        if self.stacked:
            self.weight = _stack(layers, "weight")
            self.scale = _stack(layers, "scale") if first.scale is not None else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.stacked:
            return tuple(layer(x) for layer in self.parts)
        return self.parts[0].multiply(x, self.weight, self.scale).split(self.sizes, dim=-1)

    def normed(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
        """self(rms_norm(x, norm, eps)), normalised as Linear.normed does."""
        if not self.stacked:
            return self(rms_norm(x, norm, eps))
        return self.parts[0].multiply(x, self.weight, self.scale, (norm, eps)).split(self.sizes, dim=-1)


def _linear_kind(layer: Linear) -> tuple:
    scale = None if layer.scale is None else layer.scale.dtype
    return layer.weight.shape[1], layer.weight.dtype, scale, layer.groups, layer.quantize_input, layer.fp32_output


def _stack(layers: tuple[Linear, ...], name: str) -> torch.Tensor:
    """One buffer for the layers' `name` parameters, which become views of its row slices (keeping their shard
    regions); returned as a plain tensor (each parameter is registered once, by its own layer)."""
    parts = [getattr(layer, name) for layer in layers]
    buffer = torch.cat([p.data for p in parts])
    start = 0
    for layer, part in zip(layers, parts):
        view = nn.Parameter(buffer[start : start + part.shape[0]], requires_grad=False)
        region = region_of(part)
        if region is not None:
            view.region = region
        setattr(layer, name, view)
        start += part.shape[0]
    return buffer


class Norm(nn.Module):
    """Holds an RMSNorm weight (fp32, as the reference computes norms)."""

    def __init__(self, dim: int, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device), requires_grad=False)


def fp32_param(*shape: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device), requires_grad=False)
