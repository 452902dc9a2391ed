"""Tensor names: transformers' DeepSeek-V4 spellings <-> the official hub names ds4 uses everywhere.

transformers has two spellings. In memory (`model.state_dict()`) modules are renamed (`self_attn.q_a_proj`,
merged `experts.gate_up_proj`); `save_pretrained` writes nearly the official names under a `model.` prefix,
with a few leftovers of the in-memory spelling (`embed_tokens`, `hc_head.hc_fn`, `attn.norm` for `attn.kv_norm`).
Both are read here; `official_to_saved` writes the on-disk spelling so transformers can load what ds4 writes.
"""

from __future__ import annotations

import re

import torch

# The few places where `save_pretrained` does not write the official name (after its `model.` prefix).
_OFFICIAL_TO_SAVED = [
    (r"embed\.weight", r"embed_tokens.weight"),
    (r"hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
    (r"(layers\.\d+)\.attn\.kv_norm\.weight", r"\1.attn.norm.weight"),
]
_SAVED_TO_OFFICIAL = [
    (r"embed_tokens\.weight", r"embed.weight"),
    (r"hc_head\.hc_(fn|base|scale)", r"hc_head_\1"),
    (r"(layers\.\d+)\.attn\.norm\.weight", r"\1.attn.kv_norm.weight"),
]

# In-memory module names -> official names, applied in order to the name without its `model.` prefix.
_MEMORY_RENAMES = [
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.position_bias$", ".ape"),
    (r"(compressor)\.kv_norm\.", r"\1.norm."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.shared_experts\.wgate\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.", ".ffn."),
]

_MERGED_EXPERTS = re.compile(r"^(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_transformers_name(name: str) -> bool:
    """True for a name in either transformers spelling (official names never start with `model.`)."""
    return name.startswith("model.")


def saved_to_official(name: str) -> str:
    """An on-disk `save_pretrained` name -> the official name."""
    if not name.startswith("model."):
        return name
    return _rename(name[len("model.") :], _SAVED_TO_OFFICIAL)


def official_to_saved(name: str) -> str:
    """The official name -> what `save_pretrained` writes; `from_pretrained` reads it back.

    transformers has no MTP layer, so `mtp.*` keeps its official name (transformers ignores it).
    """
    if name == "head.weight" or name.startswith("mtp."):
        return name
    return "model." + _rename(name, _OFFICIAL_TO_SAVED)


def _rename(name: str, table: list[tuple[str, str]]) -> str:
    for pattern, replacement in table:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return name


def memory_state_to_official(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory `state_dict()` -> official names, splitting the merged expert tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        short = name[len("model.") :] if name.startswith("model.") else name
        if short == "lm_head.weight":
            out["head.weight"] = tensor
            continue
        merged = _MERGED_EXPERTS.match(short)
        if merged:
            out.update(_split_experts(merged.group(1), merged.group(2), tensor))
            continue
        for pattern, replacement in _MEMORY_RENAMES:
            short = re.sub(pattern, replacement, short)
        out[short] = tensor
    return out


def _split_experts(layer: str, kind: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """gate_up_proj [E, 2I, D] holds w1 then w3 along dim 1; down_proj [E, D, I] holds w2."""
    out = {}
    for e in range(tensor.shape[0]):
        prefix = f"{layer}.ffn.experts.{e}"
        if kind == "gate_up_proj":
            w1, w3 = tensor[e].chunk(2, dim=0)
            out[f"{prefix}.w1.weight"] = w1
            out[f"{prefix}.w3.weight"] = w3
        else:
            out[f"{prefix}.w2.weight"] = tensor[e]
    return out
