"""What a DeepSeek-V4 step must at least move and compute, counted from the config (for `ds4 bench model`).

Weights are counted in checkpoint precision, from the stored specs (`weights_spec.stored_tensor_specs`: FP8
linears 1 B + one UE8M0 byte per 128x128 block, MXFP4 experts 0.5 B + one byte per 32, bf16 / fp32 / int32
otherwise), whatever precision the model currently holds them in.

Decode (batch B, each request with `context` tokens cached) must read once: every dense weight of every layer
(attention, compressors, indexer projections, router, shared expert, mHC, norms), the routed experts the batch
touches (B tokens routed uniformly to k distinct of E experts touch E * (1 - (1 - k/E)^B) on average), the
head, B embedding rows and B rows of a hash layer's tid2eid, and per request and layer its cache entries:
the sliding window, the compressed entries it attends to (HCA: all it may see; CSA: the indexer's top-k)
and, in CSA layers, every indexer key it may see. Compressor states and writes are left out.

Prefill (one prompt of n tokens from position 0) FLOPs by kind (2 per multiply-add), each kind the operands its
exact product takes: dense FP8 GEMMs (the FP8 linears whose input is act_quant'ed: FP8 tensor cores), dense bf16
GEMMs (the linears stored in bf16 - compressor projections, the indexer's weights_proj, the router, the head for
the one sampled row - and wo_a, which the reference multiplies without act_quant: its bf16 activations have no
exact FP8 product), routed experts (k per token, three projections), attention (QK and PV over the window and the
compressed entries each token sees) and the indexer (one score per head and visible entry).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ds4.checkpoint.weights_spec import EXPERT, FP8_LINEAR, INDEX, expected_parameter_shapes, stored_tensor_specs
from ds4.config import CSA, HCA, WINDOW, ModelConfig

_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


@dataclass(frozen=True)
class CheckpointBytes:
    """Bytes of the stored tensors: per main layer (split into routed experts and the rest) and outside layers."""

    layers: tuple[int, ...]
    layer_experts: tuple[int, ...]
    expert: int  # one routed expert (w1, w2, w3 and their scales)
    top: int  # embed, head, final norm, hc_head
    embed_row: int
    head: int
    tid2eid_row: int

    @property
    def total(self) -> int:
        return self.top + sum(self.layers)


def checkpoint_bytes(cfg: ModelConfig) -> CheckpointBytes:
    stored = stored_tensor_specs(cfg)
    layers = [0] * cfg.num_hidden_layers
    experts = [0] * cfg.num_hidden_layers
    expert_of_layer: dict[int, int] = {}
    top = 0
    for name, spec in stored.items():
        size = _nbytes(spec.shape, spec.dtype)
        layer = _LAYER.match(name)
        if layer is None:
            top += size
            continue
        i = int(layer.group(1))
        layers[i] += size
        expert = _EXPERT.search(name)
        if expert:
            experts[i] += size
            if expert.group(1) == "0":
                expert_of_layer[i] = expert_of_layer.get(i, 0) + size
    embed = stored["embed.weight"]
    hash_tables = [s for n, s in stored.items() if n.endswith("gate.tid2eid")]
    return CheckpointBytes(
        layers=tuple(layers),
        layer_experts=tuple(experts),
        expert=expert_of_layer.get(0, 0),
        top=top,
        embed_row=_nbytes(embed.shape[1:], embed.dtype),
        head=_nbytes(stored["head.weight"].shape, stored["head.weight"].dtype),
        tid2eid_row=_nbytes(hash_tables[0].shape[1:], hash_tables[0].dtype) if hash_tables else 0,
    )


def expected_experts_touched(cfg: ModelConfig, tokens: int) -> float:
    """Distinct experts B tokens touch on average when each picks k distinct of E uniformly."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)


def entries_seen(cfg: ModelConfig, layer: int, position: int) -> tuple[int, int, int]:
    """(window keys, compressed entries attended, indexer keys scored) of the token at `position` in `layer`."""
    kind, ratio = cfg.layer_kinds[layer], cfg.compress_ratios[layer]
    window = min(position + 1, cfg.sliding_window)
    if kind == WINDOW:
        return window, 0, 0
    visible = (position + 1) // ratio
    if kind == HCA:
        return window, visible, 0
    return window, min(cfg.index_topk, visible), visible


def decode_bytes(
    cfg: ModelConfig, batch: int, context: int, kv_entry_bytes: int, index_entry_bytes: int
) -> dict[str, float]:
    """Bytes one decode step must read, by part: dense, experts, head, kv_cache (window + attended compressed
    entries), index_keys. kv_entry_bytes / index_entry_bytes: one cache entry as the model stores it."""
    ck = checkpoint_bytes(cfg)
    touched = expected_experts_touched(cfg, batch)
    hash_layers = sum(cfg.is_hash_layer(i) for i in range(cfg.num_hidden_layers))
    table = ck.tid2eid_row * cfg.vocab_size
    dense = sum(ck.layers) - sum(ck.layer_experts) - hash_layers * (table - batch * ck.tid2eid_row)
    dense += ck.top - ck.head - ck.embed_row * (cfg.vocab_size - batch)
    kv = index = 0
    for layer in range(cfg.num_hidden_layers):
        window, attended, scored = entries_seen(cfg, layer, context)
        kv += batch * (window + attended) * kv_entry_bytes
        index += batch * scored * index_entry_bytes
    return {
        "dense": float(dense),
        "experts": touched * ck.expert * cfg.num_hidden_layers,
        "head": float(ck.head),
        "kv_cache": float(kv),
        "index_keys": float(index),
    }


def prefill_flops(cfg: ModelConfig, tokens: int) -> dict[str, float]:
    """FLOPs of prefilling one prompt of `tokens` tokens, by kind: dense (FP8), dense_bf16, experts, attention,
    indexer."""
    specs = expected_parameter_shapes(cfg)
    fp8_params = bf16_params = 0
    for name, spec in specs.items():
        leaf = name.rsplit(".", 1)[-1]
        if spec.kind in (EXPERT, INDEX) or len(spec.shape) != 2 or leaf.startswith("hc_") or "embed" in name:
            continue
        if name == "head.weight" or leaf == "ape":
            continue
        params = spec.shape[0] * spec.shape[1]
        if spec.kind == FP8_LINEAR and cfg.fp8_block is not None and not name.endswith(".attn.wo_a.weight"):
            fp8_params += params
        else:
            bf16_params += params
    d, inter, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    positions = torch.arange(tokens, dtype=torch.float64)
    attention = indexer = 0.0
    for layer in range(cfg.num_hidden_layers):
        kind, ratio = cfg.layer_kinds[layer], cfg.compress_ratios[layer]
        keys = (positions + 1).clamp(max=cfg.sliding_window)
        if kind != WINDOW:
            visible = torch.div(positions + 1, ratio, rounding_mode="floor")
            keys = keys + (visible.clamp(max=cfg.index_topk) if kind == CSA else visible)
            if kind == CSA:
                indexer += 2.0 * cfg.index_n_heads * cfg.index_head_dim * float(visible.sum())
        attention += 4.0 * cfg.num_attention_heads * cfg.head_dim * float(keys.sum())
    return {
        "dense": 2.0 * tokens * fp8_params,
        "dense_bf16": 2.0 * tokens * bf16_params + 2.0 * cfg.vocab_size * d,
        "experts": 2.0 * tokens * k * 3 * inter * d * cfg.num_hidden_layers,
        "attention": attention,
        "indexer": indexer,
    }
