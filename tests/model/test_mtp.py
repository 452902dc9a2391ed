"""The MTP layer: ds4's mtp_forward equals the official MTP semantics computed from transformers' generic modules.

Official semantics (inference/model.py, MTPBlock): x = e_proj(enorm(embed(next_ids))) + h_proj(hnorm(h)) on each
of the main model's residual streams h, one block (a sliding-window layer with score routing), then the MTP's
own hc_head collapse and norm, then the shared head.
"""

import re

import torch
import torch.nn.functional as F
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, step_batch, tiny_config, transformers_model

from ds4.checkpoint.hf_names import memory_state_to_official
from ds4.checkpoint.weights_spec import FP32, INDEX, expected_parameter_shapes


def _mtp_tensors(cfg, seed=7):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, spec in expected_parameter_shapes(cfg, with_mtp=True).items():
        if not name.startswith("mtp."):
            continue
        assert spec.kind != INDEX  # the MTP layer routes by score
        noise = torch.randn(spec.shape, generator=gen)
        if len(spec.shape) == 1 or spec.kind == FP32:
            out[name] = (1.0 if name.endswith("norm.weight") else 0.0) + 0.3 * noise
        else:
            out[name] = 0.05 * noise
    return out


def _transformers_block(cfg, mtp):
    """transformers' one-layer model whose layer 0 holds the MTP block's weights."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model as HFModel

    hf_cfg = cfg.to_hf_dict()
    hf_cfg.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
    assert cfg.layer_kinds[cfg.num_hidden_layers] == "window"
    model = HFModel(DeepseekV4Config(**hf_cfg)).float().eval()
    state = {}
    for name, value in model.state_dict().items():
        merged = re.fullmatch(r"layers\.0\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if merged:
            e = range(cfg.n_routed_experts)
            if merged.group(1) == "gate_up_proj":
                state[name] = torch.stack(
                    [
                        torch.cat((mtp[f"mtp.0.ffn.experts.{i}.w1.weight"], mtp[f"mtp.0.ffn.experts.{i}.w3.weight"]))
                        for i in e
                    ]
                )
            else:
                state[name] = torch.stack([mtp[f"mtp.0.ffn.experts.{i}.w2.weight"] for i in e])
        elif name.startswith("layers.0."):
            (official,) = memory_state_to_official({name: value})
            state[name] = mtp[official.replace("layers.0.", "mtp.0.", 1)]
        else:
            state[name] = value
    model.load_state_dict(state)
    return model


def _reference_mtp_logits(cfg, hf, mtp, embed, head, next_ids, h):
    s = next_ids.shape[0]
    pos = torch.arange(s)[None]
    e = F.linear(
        F.rms_norm(embed[next_ids], (cfg.hidden_size,), mtp["mtp.0.enorm.weight"], cfg.rms_norm_eps),
        mtp["mtp.0.e_proj.weight"],
    )
    hn = F.rms_norm(h, (cfg.hidden_size,), mtp["mtp.0.hnorm.weight"], cfg.rms_norm_eps)
    x = (e[:, None] + F.linear(hn, mtp["mtp.0.h_proj.weight"]))[None]
    rel = pos[0][:, None] - pos[0][None, :]
    mask = torch.where((rel >= 0) & (rel < cfg.sliding_window), 0.0, float("-inf"))[None, None]
    rope = {kind: hf.rotary_emb(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
    with torch.no_grad():
        x = hf.layers[0](x, position_embeddings=rope, position_ids=pos, attention_mask=mask, input_ids=next_ids[None])
        collapsed = _hc_head(x[0], mtp["mtp.0.hc_head_fn"], mtp["mtp.0.hc_head_scale"], mtp["mtp.0.hc_head_base"], cfg)
        normed = F.rms_norm(collapsed, (cfg.hidden_size,), mtp["mtp.0.norm.weight"], cfg.rms_norm_eps)
    return F.linear(normed, head)


def _hc_head(x, fn, scale, base, cfg):
    flat = x.flatten(1)
    mixes = F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    pre = torch.sigmoid(mixes * scale + base) + cfg.hc_eps
    return (pre[..., None] * x).sum(1)


def _setup():
    cfg = tiny_config("mixed_hca8")
    tensors = official_tensors(transformers_model(cfg))
    mtp = _mtp_tensors(cfg)
    model = ds4_model(cfg, {**tensors, **mtp}, with_mtp=True)
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(8))
    return cfg, tensors, mtp, model, ids


def test_mtp_matches_official_semantics():
    cfg, tensors, mtp, model, ids = _setup()
    cache = model.new_cache(2, 4, 16)
    table = torch.tensor([3, 1, 0, 2])
    hidden = model(step_batch([(ids, 0, 1, table)]), cache)
    # Row t pairs the main model's streams at t with token t + 1; the layer predicts token t + 2.
    mtp_hidden = model.mtp_forward(step_batch([(ids[1:], 0, 1, table)]), hidden[:-1], cache)
    got = model.compute_mtp_logits(mtp_hidden)

    hf = _transformers_block(cfg, mtp)
    expected = _reference_mtp_logits(
        cfg, hf, mtp, tensors["embed.weight"], tensors["head.weight"], ids[1:], hidden[:-1]
    )
    assert max_rel_err(got, expected) <= 1e-4
    assert max_rel_err(got, model.compute_logits(hidden[:-1])) > 0.1  # its own hc_head / norm / block


def test_mtp_decode_steps_match_one_pass():
    cfg, _, _, model, ids = _setup()
    cache = model.new_cache(1, 4, 16)
    table = torch.arange(4)
    hidden = model(step_batch([(ids, 0, 0, table)]), cache)
    whole = model.compute_mtp_logits(model.mtp_forward(step_batch([(ids[1:], 0, 0, table)]), hidden[:-1], cache))

    cache = model.new_cache(1, 4, 16)
    hidden = model(step_batch([(ids, 0, 0, table)]), cache)
    steps, done = [], 0
    for n in [11, 1, 1, 3, 1, 2, 10]:
        batch = step_batch([(ids[1 + done : 1 + done + n], done, 0, table)])
        steps.append(model.compute_mtp_logits(model.mtp_forward(batch, hidden[done : done + n], cache)))
        done += n
    assert done == len(ids) - 1
    assert max_rel_err(torch.cat(steps), whole) <= 1e-5
