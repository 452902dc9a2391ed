"""The tiny random model: every DSv4 feature, deterministic, loadable by transformers, sane activations."""

import json
import threading
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers

from ds4.checkpoint import hf_names, tiny
from ds4.checkpoint.reader import load_checkpoint
from ds4.checkpoint.tiny import make_tiny
from ds4.config import CSA, HCA, WINDOW, load_config

SMALL = {"vocab_size": 1000}


def shard_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def stored_dtypes(path: Path) -> dict[str, str]:
    out = {}
    for shard in path.glob("*.safetensors"):
        raw = shard.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        out.update({k: v["dtype"] for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"})
    return out


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = shard_bytes(make_tiny(tmp_path / "a", seed=5, config_overrides=SMALL))
    b = shard_bytes(make_tiny(tmp_path / "b", seed=5, config_overrides=SMALL))
    c = shard_bytes(make_tiny(tmp_path / "c", seed=6, config_overrides=SMALL))
    assert len(a) >= 2 and a == b
    assert a.keys() == c.keys() and all(a[k] != c[k] for k in a)
    index = "model.safetensors.index.json"
    assert (tmp_path / "a" / index).read_text() == (tmp_path / "b" / index).read_text()


def test_every_feature_is_present(tmp_path):
    path = make_tiny(tmp_path, config_overrides=SMALL)
    cfg = load_config(path)
    main = list(zip(cfg.layer_kinds, cfg.compress_ratios))[: cfg.num_hidden_layers]
    assert {(WINDOW, 0), (CSA, 4), (HCA, 16)} <= set(main)
    routing = [cfg.is_hash_layer(i) for i in range(cfg.num_hidden_layers)]
    assert True in routing and False in routing
    assert cfg.num_mtp_layers == 1 and cfg.layer_kinds[-1] == WINDOW
    assert cfg.hc_mult == 4 and cfg.fp8_block == (128, 128) and cfg.expert_dtype == "fp4"
    dtypes = stored_dtypes(path)
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.3.ffn.experts.7.w2.weight"] == "I8" and dtypes["layers.3.ffn.experts.7.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.shared_experts.w1.weight"] == "F8_E4M3"
    assert dtypes["embed.weight"] == "BF16" and dtypes["layers.1.attn.compressor.wkv.weight"] == "BF16"
    assert dtypes["layers.0.hc_attn_fn"] == "F32" and dtypes["layers.0.ffn.gate.tid2eid"] == "I32"
    assert dtypes["mtp.0.e_proj.weight"] == "F8_E4M3" and "layers.1.attn.indexer.wq_b.weight" in dtypes
    tid2eid = dict(load_checkpoint(path, progress=False))["layers.0.ffn.gate.tid2eid"]
    assert tid2eid.min() >= 0 and tid2eid.max() < cfg.n_routed_experts
    assert all(len(set(row)) == cfg.num_experts_per_tok for row in tid2eid[:100].tolist())


def test_hf_format_is_what_transformers_loads_and_its_activations_stay_order_one(tmp_path):
    path = make_tiny(tmp_path, format="hf")
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert not [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    ours = dict(load_checkpoint(path, progress=False))
    theirs = hf_names.memory_state_to_official(model.state_dict())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name].to(ours[name].dtype)), name
    ids = torch.randint(0, 129280, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in out.hidden_states:
        rms = h.pow(2).mean().sqrt().item()
        assert 0.3 < rms < 10, rms
    logits = out.logits[0]
    assert torch.isfinite(logits).all()
    spread = logits.std(dim=-1)
    assert bool(((spread > 1) & (spread < 10)).all()), spread
    assert len(set(logits.argmax(-1).tolist())) > 24  # the prediction depends on the input


def test_default_model_dir_builds_once_with_the_real_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    path = tiny.default_model_dir()
    assert path.parent == tmp_path and path.name == f"tiny-{tiny.TINY_VERSION}-seed0"
    cfg = load_config(path)
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg.vocab_size == 129280
    assert tok.token_to_id("<｜end▁of▁sentence｜>") == cfg.eos_token_id
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    monkeypatch.setattr(tiny, "make_tiny", lambda *a, **k: pytest.fail("rebuilt an existing default model"))
    assert tiny.default_model_dir() == path
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_concurrent_first_uses_agree_and_leave_no_debris(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    real = tiny.make_tiny
    barrier = threading.Barrier(3)

    def small_make_tiny(out, format, seed):
        barrier.wait()  # all three builds are in flight before any finishes
        return real(out, format=format, seed=seed, config_overrides=SMALL)

    monkeypatch.setattr(tiny, "make_tiny", small_make_tiny)
    results, errors = [], []

    def first_use():
        try:
            results.append(tiny.default_model_dir())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert dict(load_checkpoint(results[0], progress=False))["embed.weight"].shape == (1000, 64)
