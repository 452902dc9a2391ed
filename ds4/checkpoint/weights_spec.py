"""Every tensor of a DeepSeek-V4 checkpoint under its official hub name: logical shape, kind, stored form.

The single list the model loader, the checkpoint reader and the tiny-checkpoint writer agree on.
Kinds follow the official reference: which linears are FP8 block-scaled, which are routed experts
(FP8 or MXFP4), which stay bf16, which are fp32 and which are integer tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ds4.config import CSA, WINDOW, ModelConfig

FP8_LINEAR = "fp8_linear"  # weight float8_e4m3fn + `.scale` (e8m0, one per fp8_block) in a quantised checkpoint
EXPERT = "expert"  # routed-expert weight: like FP8_LINEAR, or MXFP4 when expert_dtype is "fp4"
BF16 = "bf16"  # stored bf16 always (embed, head, norms, compressor projections, gate weight)
FP32 = "fp32"  # stored fp32 always (hc_*, ape, attn_sink, gate bias)
INDEX = "index"  # integer table (tid2eid)

FP4_BLOCK = 32


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as the model uses it: logical (dequantised) shape and kind."""

    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True)
class StoredSpec:
    """One tensor as a checkpoint file holds it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def expected_parameter_shapes(cfg: ModelConfig, with_mtp: bool = False) -> dict[str, TensorSpec]:
    """Official name -> logical shape and kind, for the main model and (optionally) the MTP layer."""
    d = cfg.hidden_size
    specs: dict[str, TensorSpec] = {
        "embed.weight": TensorSpec((cfg.vocab_size, d), BF16),
        "head.weight": TensorSpec((cfg.vocab_size, d), BF16),
        "norm.weight": TensorSpec((d,), BF16),
        **_hc_head("", cfg),
    }
    for layer in range(cfg.num_hidden_layers):
        specs.update(_block(f"layers.{layer}.", cfg, layer))
    if with_mtp:
        if cfg.num_mtp_layers < 1:
            raise ValueError("with_mtp: the config has no MTP layer (num_nextn_predict_layers is 0)")
        prefix = "mtp.0."
        specs.update(_block(prefix, cfg, cfg.num_hidden_layers))
        specs.update(
            {
                prefix + "e_proj.weight": TensorSpec((d, d), FP8_LINEAR),
                prefix + "h_proj.weight": TensorSpec((d, d), FP8_LINEAR),
                prefix + "enorm.weight": TensorSpec((d,), BF16),
                prefix + "hnorm.weight": TensorSpec((d,), BF16),
                prefix + "norm.weight": TensorSpec((d,), BF16),
                **_hc_head(prefix, cfg),
            }
        )
    return specs


def stored_tensor_specs(cfg: ModelConfig, with_mtp: bool = False) -> dict[str, StoredSpec]:
    """Name -> shape and dtype as written on the hub, incl. the `.scale` companions of quantised weights."""
    out: dict[str, StoredSpec] = {}
    for name, spec in expected_parameter_shapes(cfg, with_mtp).items():
        out.update(_stored(cfg, name, spec))
    return out


def _stored(cfg: ModelConfig, name: str, spec: TensorSpec) -> dict[str, StoredSpec]:
    if spec.kind == FP32:
        return {name: StoredSpec(spec.shape, torch.float32)}
    if spec.kind == INDEX:
        return {name: StoredSpec(spec.shape, torch.int32)}
    quantised = cfg.fp8_block is not None and spec.kind in (FP8_LINEAR, EXPERT)
    if not quantised:
        return {name: StoredSpec(spec.shape, torch.bfloat16)}
    out_dim, in_dim = spec.shape
    scale = name.removesuffix(".weight") + ".scale"
    if spec.kind == EXPERT and cfg.expert_dtype == "fp4":
        if in_dim % FP4_BLOCK:
            raise ValueError(f"{name}: input dim {in_dim} is not a multiple of the MXFP4 block {FP4_BLOCK}")
        return {
            name: StoredSpec((out_dim, in_dim // 2), torch.int8),
            scale: StoredSpec((out_dim, in_dim // FP4_BLOCK), torch.float8_e8m0fnu),
        }
    block_out, block_in = cfg.fp8_block
    return {
        name: StoredSpec(spec.shape, torch.float8_e4m3fn),
        scale: StoredSpec((math.ceil(out_dim / block_out), math.ceil(in_dim / block_in)), torch.float8_e8m0fnu),
    }


def _hc_head(prefix: str, cfg: ModelConfig) -> dict[str, TensorSpec]:
    hc = cfg.hc_mult
    return {
        prefix + "hc_head_fn": TensorSpec((hc, hc * cfg.hidden_size), FP32),
        prefix + "hc_head_base": TensorSpec((hc,), FP32),
        prefix + "hc_head_scale": TensorSpec((1,), FP32),
    }


def _block(prefix: str, cfg: ModelConfig, layer: int) -> dict[str, TensorSpec]:
    """One block (attention + MoE + two mHC mixers); `layer` indexes cfg.layer_kinds (MTP after the main layers)."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    mix = (2 + hc) * hc
    specs = {prefix + "attn_norm.weight": TensorSpec((d,), BF16), prefix + "ffn_norm.weight": TensorSpec((d,), BF16)}
    for site in ("attn", "ffn"):
        specs[f"{prefix}hc_{site}_fn"] = TensorSpec((mix, hc * d), FP32)
        specs[f"{prefix}hc_{site}_base"] = TensorSpec((mix,), FP32)
        specs[f"{prefix}hc_{site}_scale"] = TensorSpec((3,), FP32)
    specs.update(_attention(prefix + "attn.", cfg, layer))
    specs.update(_moe(prefix + "ffn.", cfg, layer))
    return specs


def _attention(prefix: str, cfg: ModelConfig, layer: int) -> dict[str, TensorSpec]:
    d, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    specs = {
        prefix + "wq_a.weight": TensorSpec((cfg.q_lora_rank, d), FP8_LINEAR),
        prefix + "q_norm.weight": TensorSpec((cfg.q_lora_rank,), BF16),
        prefix + "wq_b.weight": TensorSpec((heads * hd, cfg.q_lora_rank), FP8_LINEAR),
        prefix + "wkv.weight": TensorSpec((hd, d), FP8_LINEAR),
        prefix + "kv_norm.weight": TensorSpec((hd,), BF16),
        prefix + "wo_a.weight": TensorSpec((cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups), FP8_LINEAR),
        prefix + "wo_b.weight": TensorSpec((d, cfg.o_groups * cfg.o_lora_rank), FP8_LINEAR),
        prefix + "attn_sink": TensorSpec((heads,), FP32),
    }
    kind, ratio = cfg.layer_kinds[layer], cfg.compress_ratios[layer]
    if kind == WINDOW:
        return specs
    specs.update(_compressor(prefix + "compressor.", cfg, ratio, hd, overlap=kind == CSA))
    if kind == CSA:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        specs[prefix + "indexer.wq_b.weight"] = TensorSpec((ih * idim, cfg.q_lora_rank), FP8_LINEAR)
        specs[prefix + "indexer.weights_proj.weight"] = TensorSpec((ih, d), BF16)
        specs.update(_compressor(prefix + "indexer.compressor.", cfg, ratio, idim, overlap=True))
    return specs


def _compressor(prefix: str, cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool) -> dict[str, TensorSpec]:
    width = (2 if overlap else 1) * head_dim
    return {
        prefix + "ape": TensorSpec((ratio, width), FP32),
        prefix + "wkv.weight": TensorSpec((width, cfg.hidden_size), BF16),
        prefix + "wgate.weight": TensorSpec((width, cfg.hidden_size), BF16),
        prefix + "norm.weight": TensorSpec((head_dim,), BF16),
    }


def _moe(prefix: str, cfg: ModelConfig, layer: int) -> dict[str, TensorSpec]:
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    specs = {prefix + "gate.weight": TensorSpec((cfg.n_routed_experts, d), BF16)}
    if cfg.is_hash_layer(layer):
        specs[prefix + "gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.num_experts_per_tok), INDEX)
    else:
        specs[prefix + "gate.bias"] = TensorSpec((cfg.n_routed_experts,), FP32)
    for e in range(cfg.n_routed_experts):
        specs.update(_swiglu(f"{prefix}experts.{e}.", d, inter, EXPERT))
    if cfg.n_shared_experts:
        specs.update(_swiglu(prefix + "shared_experts.", d, inter, FP8_LINEAR))
    return specs


def _swiglu(prefix: str, d: int, inter: int, kind: str) -> dict[str, TensorSpec]:
    return {
        prefix + "w1.weight": TensorSpec((inter, d), kind),
        prefix + "w2.weight": TensorSpec((d, inter), kind),
        prefix + "w3.weight": TensorSpec((inter, d), kind),
    }
