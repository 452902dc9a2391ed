"""The official weight list: names and shapes agree with transformers; load_weights refuses anything else."""

import pytest
import torch
from dsv4_tiny import ds4_model, official_tensors, tiny_config, transformers_model

from ds4.checkpoint.weights_spec import EXPERT, FP8_LINEAR, expected_parameter_shapes, stored_tensor_specs
from ds4.config import load_config


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config("mixed_hca8")
    return cfg, official_tensors(transformers_model(cfg))


def test_spec_names_and_shapes_equal_transformers(tiny):
    cfg, tensors = tiny
    spec = expected_parameter_shapes(cfg)
    assert set(spec) == set(tensors)
    assert all(tuple(tensors[n].shape) == s.shape for n, s in spec.items())


def test_spec_kinds_follow_the_reference():
    cfg = tiny_config("mixed_hca8")
    spec = expected_parameter_shapes(cfg, with_mtp=True)
    assert spec["layers.1.attn.wo_a.weight"].kind == FP8_LINEAR
    assert spec["mtp.0.e_proj.weight"].kind == FP8_LINEAR
    assert spec["layers.3.ffn.experts.2.w2.weight"].kind == EXPERT
    assert spec["layers.3.ffn.shared_experts.w2.weight"].kind == FP8_LINEAR
    assert {
        spec[n].kind
        for n in (
            "layers.1.attn.compressor.wkv.weight",
            "layers.1.attn.indexer.weights_proj.weight",
            "layers.2.ffn.gate.weight",
            "embed.weight",
            "head.weight",
        )
    } == {"bf16"}
    assert {
        spec[n].kind
        for n in (
            "layers.1.attn.attn_sink",
            "layers.1.attn.compressor.ape",
            "layers.2.ffn.gate.bias",
            "hc_head_fn",
            "mtp.0.hc_attn_base",
        )
    } == {"fp32"}
    assert spec["layers.0.ffn.gate.tid2eid"].kind == "index"


def test_stored_specs_of_a_quantised_checkpoint():
    raw = dict(tiny_config("mixed_hca8").to_official_dict())
    raw.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}, expert_dtype="fp4")
    cfg = load_config(raw)
    stored = stored_tensor_specs(cfg)
    assert stored["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.1.attn.wq_b.scale"].shape == (3, 1)  # [ceil(320 / 128), ceil(32 / 128)]
    assert (
        stored["layers.1.ffn.experts.0.w1.weight"].shape == (32, 32)
        and stored["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    )
    assert stored["layers.1.ffn.experts.0.w1.scale"].shape == (32, 2)
    assert stored["layers.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16
    assert "layers.1.attn.compressor.wkv.scale" not in stored


def test_load_weights_rejects_missing_unexpected_and_misshapen(tiny):
    cfg, tensors = tiny
    name = "layers.1.attn.wq_b.weight"
    with pytest.raises(ValueError, match=f"missing {name}"):
        ds4_model(cfg, {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(ValueError, match="unexpected layers.9.attn.wq_b.weight"):
        ds4_model(cfg, {**tensors, "layers.9.attn.wq_b.weight": tensors[name]})
    with pytest.raises(ValueError, match="wrong shapes or dtypes"):
        ds4_model(cfg, {**tensors, name: tensors[name].T})
    with pytest.raises(ValueError, match="dequantise"):
        ds4_model(cfg, {**tensors, name: tensors[name].to(torch.float8_e4m3fn)})
