"""load_weights takes the checkpoint's stored tensors as a stream: dequantised exactly (the CPU spec) or kept in
checkpoint precision, each tensor placed and dropped as it comes, every name exactly once."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from dsv4_tiny import run_in_chunks

from ds4.checkpoint.tiny import official_state, tiny_config
from ds4.kernels import fp8_linear
from ds4.model.deepseek_v4 import DeepseekV4Model

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config({"vocab_size": 1000})
    return cfg, official_state(cfg, seed=5)


def e8m0(scale):
    return (scale.view(torch.uint8).float() - 127).exp2()


def fp8_by_hand(w, s):
    s = e8m0(s).repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w.float() * s[: w.shape[0], : w.shape[1]]


def mxfp4_by_hand(packed, s):
    codes = packed.view(torch.uint8)
    values = torch.stack([E2M1[(codes & 15).long()], E2M1[(codes >> 4).long()]], dim=-1).flatten(1)
    return values * e8m0(s).repeat_interleave(32, 1)


def test_dequantized_format_decodes_the_stored_bytes(tiny):
    cfg, state = tiny
    model = DeepseekV4Model(cfg, torch.float32, "cpu", weight_format="dequantized", with_mtp=True)
    model.load_weights(state)
    wq_b = model.layers[1].attn.wq_b
    assert wq_b.scale is None and wq_b.weight.dtype == torch.float32
    want = fp8_by_hand(state["layers.1.attn.wq_b.weight"], state["layers.1.attn.wq_b.scale"])
    assert torch.equal(wq_b.weight, want)
    experts = model.layers[2].ffn.experts
    assert experts.format == "dequantized"
    for proj in ("w1", "w2", "w3"):
        stored = state[f"layers.2.ffn.experts.3.{proj}.weight"], state[f"layers.2.ffn.experts.3.{proj}.scale"]
        assert torch.equal(getattr(experts, proj)[3], mxfp4_by_hand(*stored)), proj
    assert torch.equal(model.layers[0].ffn.gate.tid2eid, state["layers.0.ffn.gate.tid2eid"].long())


def logits(model, cfg):
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    return run_in_chunks(model, model.new_cache(2, 4, 16), ids, [24], slot=0, table=torch.arange(4))


def test_checkpoint_format_keeps_the_stored_bytes_and_computes_close_to_the_spec(tiny):
    cfg, state = tiny
    main = {n: t for n, t in state.items() if not n.startswith("mtp.")}
    model = DeepseekV4Model(cfg, torch.float32, "cpu", weight_format="checkpoint")
    model.load_weights(main)
    wq_b = model.layers[1].attn.wq_b
    assert wq_b.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(wq_b.weight.view(torch.uint8), state["layers.1.attn.wq_b.weight"].view(torch.uint8))
    assert torch.equal(wq_b.scale, e8m0(state["layers.1.attn.wq_b.scale"]))
    experts, inter = model.layers[2].ffn.experts, cfg.moe_intermediate_size
    assert experts.format == "mxfp4" and experts.w13.dtype == torch.uint8
    for proj, codes, scales in (
        ("w1", experts.w13[5, :inter], experts.w13_scale[5, :inter]),
        ("w3", experts.w13[5, inter:], experts.w13_scale[5, inter:]),
        ("w2", experts.w2[5], experts.w2_scale[5]),
    ):
        assert torch.equal(codes, state[f"layers.2.ffn.experts.5.{proj}.weight"].view(torch.uint8)), proj
        assert torch.equal(scales, state[f"layers.2.ffn.experts.5.{proj}.scale"].view(torch.uint8)), proj
    spec = DeepseekV4Model(cfg, torch.float32, "cpu")
    spec.load_weights(main)
    # act_quant rounds the input of every FP8 linear and MXFP4 expert to e4m3 (3 mantissa bits), which moves routing
    # and top-k choices of a few tokens in this random model; the logits stay close.
    cos = F.cosine_similarity(logits(model, cfg), logits(spec, cfg), dim=-1)
    assert cos.mean() > 0.98 and cos.min() > 0.9


def test_fp8_linears_in_checkpoint_precision_compute_the_spec_but_for_act_quant(monkeypatch):
    """FP8 experts stay dequantised, so only the FP8 linears differ: without act_quant's rounding the model in
    checkpoint precision is the dequantised one."""
    cfg = tiny_config({"vocab_size": 1000, "expert_dtype": "fp8"})
    state = {n: t for n, t in official_state(cfg, seed=6).items() if not n.startswith("mtp.")}
    model = DeepseekV4Model(cfg, torch.float32, "cpu", weight_format="checkpoint")
    model.load_weights(state)
    assert model.layers[0].attn.wo_b.weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].ffn.experts.format == "dequantized"
    spec = DeepseekV4Model(cfg, torch.float32, "cpu")
    spec.load_weights(state)
    monkeypatch.setattr(fp8_linear, "act_quant", lambda x: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // 128))))
    torch.testing.assert_close(logits(model, cfg), logits(spec, cfg), rtol=1e-5, atol=1e-5)


def test_loading_streams_each_tensor_once_without_holding_copies(tiny):
    cfg, state = tiny
    model = DeepseekV4Model(cfg, torch.float32, "cpu", weight_format="checkpoint")
    alive, most = [], 0

    def stream():
        nonlocal most
        for name, tensor in state.items():
            if name.startswith("mtp."):
                continue
            gc.collect(0)
            most = max(most, sum(ref() is not None for ref in alive))
            fresh = tensor.clone()
            alive.append(weakref.ref(fresh))
            yield name, fresh
            del fresh

    model.load_weights(stream())
    # While a tensor is yielded, only the one before it (the loader's loop variable) or a weight waiting for
    # its scale may still be alive.
    assert len(alive) == len([n for n in state if not n.startswith("mtp.")]) and most <= 2


def test_errors_name_missing_duplicated_unexpected_and_misshapen_tensors(tiny):
    cfg, state = tiny
    main = {n: t for n, t in state.items() if not n.startswith("mtp.")}
    model = DeepseekV4Model(cfg, torch.float32, "cpu", weight_format="checkpoint")
    scale = "layers.1.attn.wq_b.scale"
    with pytest.raises(ValueError, match=f"missing {scale}"):
        model.load_weights((n, t) for n, t in main.items() if n != scale)
    with pytest.raises(ValueError, match=f"duplicated {scale}"):
        model.load_weights([*main.items(), (scale, main[scale])])
    with pytest.raises(ValueError, match="unexpected mtp.0.attn_norm.weight"):
        model.load_weights(state)
    name = "layers.1.attn.wq_b.weight"
    with pytest.raises(ValueError, match="wrong shapes or dtypes: layers.1.attn.wq_b.weight: dtype torch.bfloat16"):
        model.load_weights({**main, name: main[name].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="wrong shapes or dtypes: layers.1.attn.wq_b.scale: shape"):
        model.load_weights({**main, scale: main[scale][:1]})


def test_mxfp4_scales_beyond_the_kernels_range_fail_at_load(tiny):
    """The GPU kernels decode MXFP4 weights up to 12 in magnitude (scale bytes up to 128): larger scales are
    refused when the expert is loaded, not decoded wrongly later."""
    cfg, state = tiny
    model = DeepseekV4Model(cfg, torch.float32, "cpu", weight_format="checkpoint")
    name = "layers.2.ffn.experts.5.w2"
    scale = state[f"{name}.scale"].view(torch.uint8).clone()
    scale[0, 0] = 129
    with pytest.raises(ValueError, match="MXFP4 scales above"):
        model.layers[2].ffn.experts.load(5, "w2", state[f"{name}.weight"], scale.view(torch.float8_e8m0fnu), None)
