"""config.json in both spellings: the official Flash and Pro configs, transformers' DeepseekV4Config, and
field-named errors."""

import dataclasses
import json
from importlib import resources

import pytest
import transformers

from ds4.config import CSA, HCA, WINDOW, ConfigError, Yarn, load_config


def official_config(name: str) -> dict:
    """The hub's config.json, as shipped in the package (ds4/configs/)."""
    return json.loads(resources.files("ds4").joinpath("configs", f"deepseek-v4-{name}.json").read_text())


@pytest.fixture(scope="module")
def pro_raw():
    return official_config("pro")


def test_official_pro_config(pro_raw):
    cfg = load_config(pro_raw)
    assert cfg.num_hidden_layers == 61 and cfg.num_mtp_layers == 1
    # Two HCA layers, then CSA/HCA alternating from layer 2, and the MTP layer is window-only.
    expected = [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(2, 61)] + [WINDOW]
    assert list(cfg.layer_kinds) == expected
    assert [cfg.compress_ratios[i] for i in (0, 1, 2, 3, 59, 60, 61)] == [128, 128, 4, 128, 128, 4, 0]
    assert [cfg.is_hash_layer(i) for i in (0, 1, 2, 3, 61)] == [True, True, True, False, False]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (7168, 128, 512, 64)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank, cfg.index_topk) == (16, 1024, 1536, 1024)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (384, 6, 3072)
    assert cfg.routed_scaling_factor == 2.5 and cfg.scoring_func == "sqrtsoftplus"
    assert cfg.yarn == Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000.0, 160000.0)
    assert cfg.fp8_block == (128, 128) and cfg.expert_dtype == "fp4"
    assert (cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id) == (129280, 0, 1)


def test_official_flash_config():
    cfg = load_config(official_config("flash"))
    assert cfg.num_hidden_layers == 43 and cfg.num_mtp_layers == 1
    # Two window-only layers, then CSA/HCA alternating from layer 2, and the MTP layer is window-only.
    expected = [WINDOW, WINDOW] + [CSA if i % 2 == 0 else HCA for i in range(2, 43)] + [WINDOW]
    assert list(cfg.layer_kinds) == expected
    assert [cfg.is_hash_layer(i) for i in (0, 1, 2, 3, 43)] == [True, True, True, False, False]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (4096, 64, 512, 64)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank, cfg.index_topk) == (8, 1024, 1024, 512)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (256, 6, 2048)
    assert cfg.routed_scaling_factor == 1.5 and cfg.scoring_func == "sqrtsoftplus"
    assert cfg.fp8_block == (128, 128) and cfg.expert_dtype == "fp4"


def test_transformers_spelling_parses_to_the_same_config(pro_raw):
    hf = transformers.DeepseekV4Config(
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        head_dim=512,
        q_lora_rank=1536,
        partial_rotary_factor=64 / 512,
        o_groups=16,
        o_lora_rank=1024,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=1024,
        n_routed_experts=384,
        num_experts_per_tok=6,
        n_shared_experts=1,
        moe_intermediate_size=3072,
        routed_scaling_factor=2.5,
        scoring_func="sqrtsoftplus",
        layer_types=["heavily_compressed_attention"] * 2
        + ["compressed_sparse_attention", "heavily_compressed_attention"] * 29
        + ["compressed_sparse_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 58,
        sliding_window=128,
        swiglu_limit=10.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        max_position_embeddings=1048576,
        bos_token_id=0,
        eos_token_id=1,
        num_nextn_predict_layers=1,
        dtype="bfloat16",
    ).to_dict()
    official = dataclasses.replace(load_config(pro_raw), fp8_block=None, expert_dtype=None)
    assert load_config(hf) == official


def test_to_hf_dict_is_accepted_by_transformers(pro_raw):
    cfg = dataclasses.replace(load_config(pro_raw), fp8_block=None, expert_dtype=None)
    hf = transformers.DeepseekV4Config(**cfg.to_hf_dict())
    assert hf.layer_types[:3] == [
        "heavily_compressed_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert load_config(hf.to_dict()) == cfg


def test_official_dict_round_trips(pro_raw):
    cfg = load_config(pro_raw)
    assert load_config(cfg.to_official_dict()) == cfg


def _drop(key):
    return lambda d: d.pop(key)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _set_quant(key, value):
    return lambda d: d["quantization_config"].__setitem__(key, value)


BAD_FIELDS = [
    ("hidden_size", _set("hidden_size", "big")),
    ("num_hidden_layers", _drop("num_hidden_layers")),
    ("num_attention_heads", _set("num_attention_heads", 0)),
    ("o_groups", _set("o_groups", 7)),
    ("num_key_value_heads", _set("num_key_value_heads", 2)),
    ("num_experts_per_tok", _set("num_experts_per_tok", 999)),
    ("scoring_func", _set("scoring_func", "relu")),
    ("n_shared_experts", _set("n_shared_experts", 2)),
    ("num_nextn_predict_layers", _set("num_nextn_predict_layers", 2)),
    ("compress_ratios", _set("compress_ratios", [4, 0])),
    ("compress_ratios", _set("compress_ratios", "4,4")),
    ("qk_rope_head_dim", _set("qk_rope_head_dim", 513)),
    ("model_type", _set("model_type", "llama")),
    ("tie_word_embeddings", _set("tie_word_embeddings", True)),
    ("torch_dtype", _set("torch_dtype", "int8")),
    ("expert_dtype", _set("expert_dtype", "int4")),
    ("quantization_config.quant_method", _set_quant("quant_method", "awq")),
    ("quantization_config.weight_block_size", _set_quant("weight_block_size", [128])),
    ("quantization_config.scale_fmt", _set_quant("scale_fmt", "fp32")),
    ("rope_scaling", _set("rope_scaling", {"type": "linear", "factor": 2})),
    ("eos_token_id", _set("eos_token_id", "</s>")),
    ("vocab_size", _set("vocab_size", 1.5)),
    ("index_head_dim", _set("index_head_dim", 64)),
]


@pytest.mark.parametrize("field,mutate", BAD_FIELDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_FIELDS)])
def test_bad_official_field_is_named(pro_raw, field, mutate):
    raw = json.loads(json.dumps(pro_raw))
    mutate(raw)
    with pytest.raises(ConfigError, match=f"^{field.replace('.', '[.]')}:"):
        load_config(raw)


HF_BASE = {
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "head_dim": 128,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "partial_rotary_factor": 0.5,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
}


@pytest.mark.parametrize(
    "field,value",
    [
        ("layer_types", ["sliding_attention", "full_attention", "sliding_attention"]),
        ("layer_types", ["sliding_attention"]),
        ("mlp_layer_types", ["moe", "hash_moe", "moe"]),
        ("mlp_layer_types", ["dense", "moe", "moe"]),
        ("partial_rotary_factor", 0.3),
    ],
)
def test_bad_transformers_field_is_named(field, value):
    assert load_config(HF_BASE).layer_kinds == (WINDOW, CSA, HCA, WINDOW)
    with pytest.raises(ConfigError, match=f"^{field}:"):
        load_config({**HF_BASE, field: value})


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
