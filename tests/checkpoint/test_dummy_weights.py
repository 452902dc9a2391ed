"""Dummy weights: the checkpoint's tensors in stored form, made from the config alone, finite through the model."""

import builtins
import io
import json

import pytest
import torch

from ds4.checkpoint.dummy import dequantised, dummy_weights
from ds4.checkpoint.tiny import TINY_CONFIG, tiny_config
from ds4.checkpoint.weights_spec import stored_tensor_specs
from ds4.config import ConfigError, load_config
from ds4.configs import config_dict, with_layers
from ds4.engine.loader import load_model, model_config
from ds4.model.batch import ForwardBatch


def _forbid_files(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"dummy weights opened a file: {args[:1]}")

    import safetensors
    import safetensors.torch

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(io, "open", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr("ds4.checkpoint.reader.load_checkpoint", refuse)


def _prompt_logits(model, n: int = 24) -> torch.Tensor:
    cache = model.new_cache(1, 1, 256)
    batch = ForwardBatch(
        input_ids=torch.randint(2, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)),
        positions=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        context_lens=torch.tensor([0]),
        slots=torch.tensor([0]),
        block_tables=torch.tensor([[0]]),
    )
    return model.compute_logits(model(batch, cache))


def test_dummy_weights_are_every_stored_tensor_in_its_checkpoint_shape_and_dtype():
    cfg = tiny_config()
    got = {name: (tuple(t.shape), t.dtype) for name, t in dummy_weights(cfg, with_mtp=True)}
    want = {name: (spec.shape, spec.dtype) for name, spec in stored_tensor_specs(cfg, with_mtp=True).items()}
    assert got == want
    assert any(dtype == torch.float8_e4m3fn for _, dtype in got.values())
    assert any(dtype == torch.int8 for _, dtype in got.values())


def test_dummy_projections_have_the_scale_of_one_over_the_square_root_of_their_input():
    cfg = tiny_config()
    weights = dict(dequantised(cfg, dummy_weights(cfg, seed=3), torch.float32))
    for name in ("layers.1.attn.wq_b.weight", "layers.2.ffn.experts.5.w2.weight", "layers.0.attn.wkv.weight"):
        std = weights[name].std().item() * weights[name].shape[1] ** 0.5
        assert 0.5 < std < 2.0, (name, std)
    routes = weights["layers.0.ffn.gate.tid2eid"]
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in routes[:50].tolist())


def test_load_format_dummy_builds_a_finite_model_without_opening_a_file(monkeypatch):
    _forbid_files(monkeypatch)
    cfg = model_config(None, None, "dummy", None)
    model = load_model(cfg, None, "dummy", device=torch.device("cpu"), dtype=torch.float32)
    logits = _prompt_logits(model)
    assert logits.shape == (24, cfg.vocab_size) and bool(torch.isfinite(logits).all())


def test_dummy_activations_stay_finite_and_bounded_through_many_layers():
    ratios = [0, 4, 16, 4] * 4
    cfg = load_config({**TINY_CONFIG, "num_hidden_layers": 16, "compress_ratios": ratios + [0]})
    model = load_model(cfg, None, "dummy", device=torch.device("cpu"), dtype=torch.float32, seed=1)
    logits = _prompt_logits(model)
    assert bool(torch.isfinite(logits).all())
    assert logits.std().item() < 30


def test_llm_with_load_format_dummy_generates_without_reading_a_checkpoint(monkeypatch):
    from ds4 import LLM, SamplingParams

    monkeypatch.setattr("ds4.checkpoint.reader.load_checkpoint", lambda *a, **k: pytest.fail("read a checkpoint"))
    llm = LLM(load_format="dummy", device="cpu", max_num_seqs=2)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.token_ids) == 3


def test_shipped_configs_are_the_official_flash_and_pro_and_cut_to_their_first_layers():
    flash, pro = load_config(config_dict("flash")), load_config(config_dict("pro"))
    assert (flash.num_hidden_layers, flash.hidden_size, flash.n_routed_experts) == (43, 4096, 256)
    assert (pro.num_hidden_layers, pro.hidden_size, pro.n_routed_experts) == (61, 7168, 384)
    four = load_config(with_layers(config_dict("flash"), 4))
    assert four.layer_kinds == ("window", "window", "csa", "hca", "window")  # the MTP layer stays last
    assert four.compress_ratios == (0, 0, 4, 128, 0)
    assert four.expert_dtype == "fp4" and four.fp8_block == (128, 128)
    with pytest.raises(ConfigError, match="--layers 44"):
        with_layers(config_dict("flash"), 44)
    with pytest.raises(ConfigError, match="flash nor pro"):
        config_dict("no-such-model")


def test_a_config_or_a_layer_count_needs_load_format_dummy(tmp_path):
    with pytest.raises(ValueError, match="load_format dummy"):
        model_config(None, "flash", "auto", None)
    with pytest.raises(ValueError, match="not both"):
        model_config(tmp_path, "flash", "dummy", None)
    with pytest.raises(ValueError, match="load_format"):
        model_config(None, None, "safetensors", None)
    (tmp_path / "config.json").write_text(json.dumps(with_layers(config_dict("pro"), 2)))
    assert model_config(tmp_path, None, "dummy", None).num_hidden_layers == 2


def test_dummy_routers_spread_tokens_over_the_experts_as_a_balanced_draw():
    """Flash's first score layer's dummy router (bias zero, as a trained one balances the loads) gives each of its
    256 experts about its share of random inputs of RMS 1: the counts' spread within 1.5x of a uniform multinomial
    draw's (the tiny law's random bias values made it over 10x)."""
    from ds4.model.moe import Gate

    cfg = load_config(with_layers(config_dict("flash"), 4))
    layer = cfg.num_hash_layers  # the first score layer
    made = dummy_weights(cfg, seed=2, holds=lambda name: name.startswith(f"layers.{layer}.ffn.gate."))
    weights = dict(dequantised(cfg, made, torch.float32))
    gate = Gate(cfg, hashed=False, device=torch.device("cpu"), dtype=torch.float32)
    gate.weight.copy_(weights[f"layers.{layer}.ffn.gate.weight"])
    gate.bias.copy_(weights[f"layers.{layer}.ffn.gate.bias"])
    tokens, experts, k = 8192, cfg.n_routed_experts, cfg.num_experts_per_tok
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(gate(x, torch.zeros(tokens, dtype=torch.long)).indices.flatten(), minlength=experts)
    balanced_std = (tokens * k / experts * (1 - 1 / experts)) ** 0.5
    assert counts.sum() == tokens * k
    assert counts.float().std() < 1.5 * balanced_std, (counts.float().std(), balanced_std)
