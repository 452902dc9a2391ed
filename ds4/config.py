"""The DeepSeek-V4 model configuration, read from `config.json` in the official or the transformers spelling.

Everything ds4 cannot serve is rejected here, at load, with the field that is wrong and why.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WINDOW, CSA, HCA = "window", "csa", "hca"

_HF_LAYER_TYPES = {"sliding_attention": WINDOW, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
_HF_LAYER_TYPE_NAMES = {kind: name for name, kind in _HF_LAYER_TYPES.items()}
_SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_CSA_RATIO = 4


class ConfigError(ValueError):
    """A config.json that ds4 cannot serve."""


@dataclass(frozen=True)
class Yarn:
    """YaRN scaling of the compressed layers' RoPE (the reference applies no mscale)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    # Per layer, main layers then MTP layers: 0 = sliding window only, else the compression ratio.
    compress_ratios: tuple[int, ...]
    # Per layer, main layers then MTP layers: WINDOW, CSA (compressed + indexer top-k) or HCA (compressed, dense).
    layer_kinds: tuple[str, ...]
    num_hash_layers: int = 3
    num_nextn_predict_layers: int = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    sliding_window: int = 128
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: Yarn | None = None
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    torch_dtype: str = "bfloat16"
    # Checkpoint precision: None (unquantised), else the FP8 block shape of the linears.
    fp8_block: tuple[int, int] | None = None
    # Routed experts' precision when quantised: "fp8" or "fp4" (MXFP4).
    expert_dtype: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_mtp_layers(self) -> int:
        return len(self.layer_kinds) - self.num_hidden_layers

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def is_hash_layer(self, layer: int) -> bool:
        """Hash routing (token id -> experts) in the first layers; MTP layers always route by score."""
        return layer < min(self.num_hash_layers, self.num_hidden_layers)

    def to_official_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _DERIVED_FIELDS}
        d["compress_ratios"] = list(self.compress_ratios)
        d["num_key_value_heads"] = 1
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        if self.fp8_block is not None:
            d["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": "ue8m0",
                "weight_block_size": list(self.fp8_block),
            }
        if self.expert_dtype is not None:
            d["expert_dtype"] = self.expert_dtype
        for kind, ratio in zip(self.layer_kinds, self.compress_ratios):
            if (kind == CSA) != (ratio == _CSA_RATIO):
                raise ConfigError(
                    f"compress_ratios: the official format reads ratio 4 as CSA, "
                    f"so {kind} ratio {ratio} cannot be written"
                )
        return {**d, **self.extra}

    def to_hf_dict(self) -> dict[str, Any]:
        """The same model in transformers' DeepseekV4Config spelling (main layers only: it has no MTP)."""
        n = self.num_hidden_layers
        ratios = {_HF_LAYER_TYPE_NAMES[k]: r for k, r in zip(self.layer_kinds, self.compress_ratios) if k != WINDOW}
        rope_parameters: dict[str, Any] = {"rope_type": "default"}
        if self.yarn is not None:
            rope_parameters = {"rope_type": "yarn", **dataclasses.asdict(self.yarn)}
        keep = (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "moe_intermediate_size",
            "routed_scaling_factor",
            "scoring_func",
            "norm_topk_prob",
            "sliding_window",
            "swiglu_limit",
            "hc_mult",
            "hc_sinkhorn_iters",
            "hc_eps",
            "rms_norm_eps",
            "rope_theta",
            "compress_rope_theta",
            "max_position_embeddings",
            "bos_token_id",
            "eos_token_id",
            "num_nextn_predict_layers",
        )
        d = {k: getattr(self, k) for k in keep}
        d.update(
            model_type="deepseek_v4",
            architectures=["DeepseekV4ForCausalLM"],
            num_key_value_heads=1,
            partial_rotary_factor=self.qk_rope_head_dim / self.head_dim,
            layer_types=[_HF_LAYER_TYPE_NAMES[k] for k in self.layer_kinds[:n]],
            compress_rates=ratios,
            mlp_layer_types=["hash_moe" if self.is_hash_layer(i) else "moe" for i in range(n)],
            rope_parameters=rope_parameters,
            dtype=self.torch_dtype,
        )
        return d


_DERIVED_FIELDS = ("layer_kinds", "yarn", "fp8_block", "expert_dtype", "extra")


def load_config(source: str | Path | dict[str, Any]) -> ModelConfig:
    """Read a model directory, a config.json path or an already parsed dict."""
    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return _parse(raw)


def _parse(raw: dict[str, Any]) -> ModelConfig:
    r = _Reader(raw)
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type not in ("deepseek_v4",):
        raise ConfigError(f"model_type: {model_type!r} is not a DeepSeek-V4 model (expected 'deepseek_v4')")
    n_layers = r.int("num_hidden_layers", minimum=1)
    n_mtp = r.int("num_nextn_predict_layers", default=1, minimum=0)
    if n_mtp > 1:
        raise ConfigError(f"num_nextn_predict_layers: {n_mtp} MTP layers; ds4 serves at most one")
    head_dim = r.int("head_dim", minimum=2)
    rope_dim = _rope_head_dim(r, head_dim)
    kinds, ratios = _layer_schedule(r, n_layers, n_mtp)
    heads = r.int("num_attention_heads", minimum=1)
    o_groups = r.int("o_groups", minimum=1)
    if heads % o_groups:
        raise ConfigError(f"o_groups: {o_groups} does not divide num_attention_heads {heads}")
    if r.int("num_key_value_heads", default=1) != 1:
        raise ConfigError("num_key_value_heads: DeepSeek-V4 attention has exactly one KV head")
    index_head_dim = r.int("index_head_dim", default=128, minimum=2)
    if index_head_dim <= rope_dim:
        raise ConfigError(
            f"index_head_dim: {index_head_dim} must exceed qk_rope_head_dim {rope_dim} "
            "(the indexer rotates its last qk_rope_head_dim channels)"
        )
    n_experts = r.int("n_routed_experts", minimum=1)
    top_k = r.int("num_experts_per_tok", minimum=1)
    if top_k > n_experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} exceeds n_routed_experts {n_experts}")
    scoring = r.str("scoring_func", default="sqrtsoftplus")
    if scoring not in _SCORING_FUNCS:
        raise ConfigError(f"scoring_func: {scoring!r} is not one of {_SCORING_FUNCS}")
    n_shared = r.int("n_shared_experts", default=1, minimum=0)
    if n_shared > 1:
        raise ConfigError(f"n_shared_experts: {n_shared}; DeepSeek-V4 has at most one shared expert")
    if raw.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings: DeepSeek-V4 has a separate output head")
    fp8_block, expert_dtype = _quantisation(raw)
    known = set(_KNOWN_KEYS)
    return ModelConfig(
        vocab_size=r.int("vocab_size", minimum=2),
        hidden_size=r.int("hidden_size", minimum=1),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=r.int("q_lora_rank", minimum=1),
        qk_rope_head_dim=rope_dim,
        o_groups=o_groups,
        o_lora_rank=r.int("o_lora_rank", minimum=1),
        index_n_heads=r.int("index_n_heads", default=64, minimum=1),
        index_head_dim=index_head_dim,
        index_topk=r.int("index_topk", default=512, minimum=1),
        n_routed_experts=n_experts,
        num_experts_per_tok=top_k,
        n_shared_experts=n_shared,
        moe_intermediate_size=r.int("moe_intermediate_size", minimum=1),
        routed_scaling_factor=r.float("routed_scaling_factor", default=1.0),
        compress_ratios=ratios,
        layer_kinds=kinds,
        num_hash_layers=_num_hash_layers(r, n_layers),
        num_nextn_predict_layers=n_mtp,
        scoring_func=scoring,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        sliding_window=r.int("sliding_window", default=128, minimum=1),
        swiglu_limit=r.float("swiglu_limit", default=10.0),
        hc_mult=r.int("hc_mult", default=4, minimum=1),
        hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", default=20, minimum=1),
        hc_eps=r.float("hc_eps", default=1e-6),
        rms_norm_eps=r.float("rms_norm_eps", default=1e-6),
        rope_theta=_main_rope_theta(r),
        compress_rope_theta=_compress_rope_theta(r),
        yarn=_yarn(raw),
        max_position_embeddings=r.int("max_position_embeddings", default=1048576, minimum=1),
        bos_token_id=r.int("bos_token_id", default=0),
        eos_token_id=_eos(raw),
        torch_dtype=_dtype_name(raw),
        fp8_block=fp8_block,
        expert_dtype=expert_dtype,
        extra={k: v for k, v in raw.items() if k not in known},
    )


class _Reader:
    """Typed field access that names the field in every error."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def _get(self, name: str, default: Any) -> Any:
        if name in self.raw and self.raw[name] is not None:
            return self.raw[name]
        if default is _REQUIRED:
            raise ConfigError(f"{name}: missing from config.json")
        return default

    def int(self, name: str, default: Any = None, minimum: int | None = None) -> int:
        value = self._get(name, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{name}: {value} is below the minimum {minimum}")
        return value

    def float(self, name: str, default: Any = None) -> float:
        value = self._get(name, _REQUIRED if default is None else default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        return float(value)

    def str(self, name: str, default: Any = None) -> str:
        value = self._get(name, _REQUIRED if default is None else default)
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value


_REQUIRED = object()


def _rope_head_dim(r: _Reader, head_dim: int) -> int:
    if "qk_rope_head_dim" in r.raw:
        rope_dim = r.int("qk_rope_head_dim", minimum=2)
    elif r.raw.get("partial_rotary_factor") is not None:
        factor = r.float("partial_rotary_factor")
        rope_dim = round(head_dim * factor)
        if abs(rope_dim - head_dim * factor) > 1e-6:
            raise ConfigError(f"partial_rotary_factor: {factor} x head_dim {head_dim} is not a whole number of dims")
    else:
        rope_dim = 64
    if rope_dim % 2 or rope_dim >= head_dim:
        raise ConfigError(f"qk_rope_head_dim: {rope_dim} must be even and smaller than head_dim {head_dim}")
    return rope_dim


def _layer_schedule(r: _Reader, n_layers: int, n_mtp: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    raw = r.raw
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ratios):
            raise ConfigError(f"compress_ratios: expected a list of integers, got {ratios!r}")
        if len(ratios) not in (n_layers, n_layers + n_mtp):
            raise ConfigError(
                f"compress_ratios: {len(ratios)} entries; expected num_hidden_layers ({n_layers}) "
                f"+ num_nextn_predict_layers ({n_mtp}) = {n_layers + n_mtp}"
            )
        ratios = list(ratios) + [0] * (n_layers + n_mtp - len(ratios))
        kinds = [WINDOW if x == 0 else CSA if x == _CSA_RATIO else HCA for x in ratios]
    elif raw.get("layer_types") is not None:
        names = raw["layer_types"]
        if not isinstance(names, list) or len(names) != n_layers:
            raise ConfigError(f"layer_types: expected a list of {n_layers} entries, got {names!r}")
        bad = [x for x in names if x not in _HF_LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer_types: unknown layer types {bad}; ds4 knows {list(_HF_LAYER_TYPES)}")
        rates = {"compressed_sparse_attention": _CSA_RATIO, "heavily_compressed_attention": 128}
        rates.update(raw.get("compress_rates") or {})
        kinds = [_HF_LAYER_TYPES[x] for x in names] + [WINDOW] * n_mtp
        ratios = [0 if k == WINDOW else rates[_HF_LAYER_TYPE_NAMES[k]] for k in kinds]
    else:
        raise ConfigError("compress_ratios: missing (nor are layer_types given); ds4 needs the per-layer schedule")
    for i, (kind, ratio) in enumerate(zip(kinds, ratios)):
        if kind != WINDOW and (not isinstance(ratio, int) or ratio < 2):
            raise ConfigError(f"compress_ratios: layer {i} has ratio {ratio!r}; a compressed layer needs ratio >= 2")
        if kind == CSA and ratio % 2:
            raise ConfigError(f"compress_ratios: layer {i} is CSA with odd ratio {ratio}; overlap needs an even ratio")
    return tuple(kinds), tuple(ratios)


def _num_hash_layers(r: _Reader, n_layers: int) -> int:
    types = r.raw.get("mlp_layer_types")
    if types is None:
        return r.int("num_hash_layers", default=3, minimum=0)
    if not isinstance(types, list) or len(types) != n_layers or any(t not in ("hash_moe", "moe") for t in types):
        raise ConfigError(f"mlp_layer_types: expected {n_layers} entries of 'hash_moe'/'moe', got {types!r}")
    n_hash = types.count("hash_moe")
    if types[:n_hash] != ["hash_moe"] * n_hash:
        raise ConfigError("mlp_layer_types: hash-routed layers must come first (as in every DeepSeek-V4 model)")
    return n_hash


def _rope_parameters(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(main, compress) RoPE settings from `rope_parameters` (transformers) or `rope_scaling` (official)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        return params["main"], params.get("compress") or {}
    if isinstance(params, dict):
        return {}, params
    return {}, raw.get("rope_scaling") or {}


def _main_rope_theta(r: _Reader) -> float:
    main, _ = _rope_parameters(r.raw)
    return float(main.get("rope_theta", r.float("rope_theta", default=10000.0)))


def _compress_rope_theta(r: _Reader) -> float:
    _, compress = _rope_parameters(r.raw)
    if "rope_theta" in compress and "main" in (r.raw.get("rope_parameters") or {}):
        return float(compress["rope_theta"])
    return r.float("compress_rope_theta", default=160000.0)


def _yarn(raw: dict[str, Any]) -> Yarn | None:
    _, compress = _rope_parameters(raw)
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind in ("default", None) or not compress.get("factor"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling: type {kind!r} is not supported; DeepSeek-V4 uses 'yarn'")
    try:
        return Yarn(
            factor=float(compress["factor"]),
            original_max_position_embeddings=int(compress["original_max_position_embeddings"]),
            beta_fast=float(compress.get("beta_fast", 32)),
            beta_slow=float(compress.get("beta_slow", 1)),
        )
    except KeyError as e:
        raise ConfigError(f"rope_scaling: yarn needs {e.args[0]}") from e


def _eos(raw: dict[str, Any]) -> int:
    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        if not eos:
            raise ConfigError("eos_token_id: empty list")
        eos = eos[0]
    if not isinstance(eos, int):
        raise ConfigError(f"eos_token_id: expected an integer, got {eos!r}")
    return eos


def _dtype_name(raw: dict[str, Any]) -> str:
    name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if name not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"torch_dtype: {name!r}; ds4 computes in bfloat16, float16 or float32")
    return name


def _quantisation(raw: dict[str, Any]) -> tuple[tuple[int, int] | None, str | None]:
    q = raw.get("quantization_config")
    expert_dtype = raw.get("expert_dtype") or (q or {}).get("expert_dtype")
    if q is None:
        if expert_dtype is not None:
            raise ConfigError("expert_dtype: set, but there is no quantization_config for the FP8 linears")
        return None, None
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config.quant_method: {q.get('quant_method')!r}; ds4 reads 'fp8' checkpoints")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt: {q.get('fmt')!r}; ds4 reads e4m3")
    if q.get("scale_fmt", "ue8m0") != "ue8m0":
        raise ConfigError(f"quantization_config.scale_fmt: {q.get('scale_fmt')!r}; ds4 reads ue8m0 block scales")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size: {block!r} is not two positive integers")
    expert_dtype = expert_dtype or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise ConfigError(f"expert_dtype: {expert_dtype!r}; ds4 reads 'fp8' or 'fp4' (MXFP4) experts")
    return (block[0], block[1]), expert_dtype


_KNOWN_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "qk_rope_head_dim",
    "partial_rotary_factor",
    "o_groups",
    "o_lora_rank",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "routed_scaling_factor",
    "compress_ratios",
    "layer_types",
    "compress_rates",
    "num_hash_layers",
    "mlp_layer_types",
    "num_nextn_predict_layers",
    "scoring_func",
    "norm_topk_prob",
    "sliding_window",
    "swiglu_limit",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "rms_norm_eps",
    "rope_theta",
    "compress_rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "dtype",
    "quantization_config",
    "expert_dtype",
    "num_key_value_heads",
    "model_type",
    "architectures",
    "tie_word_embeddings",
)
