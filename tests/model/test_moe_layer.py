"""The MoE layer on packed MXFP4 experts (the Experts module's "mxfp4" storage) is gate, routed experts on the
per-projection weights, and the shared expert: w13's first half is the gate (w1), its second the up (w3)."""

import torch
from dsv4_tiny import tiny_config
from torch import nn

from ds4.checkpoint.quant import mxfp4_quantize
from ds4.kernels.moe import ExpertWeights, routed_experts_reference
from ds4.model.moe import MoE


def _quantize(w):
    pairs = [mxfp4_quantize(m) for m in w]
    return torch.stack([p.view(torch.uint8) for p, _ in pairs]), torch.stack([s.view(torch.uint8) for _, s in pairs])


def test_packed_experts_are_read_gate_first():
    cfg = tiny_config("mixed_hca8")
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gen = torch.Generator().manual_seed(0)
    layer = MoE(cfg, hashed=False, dtype=torch.float32, device=torch.device("cpu"))
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    (w1, s1), (w3, s3), (w2, s2) = (_quantize(torch.randn(e, *s, generator=gen)) for s in ((i, d), (i, d), (d, i)))
    packed = nn.Module()
    packed.format = "mxfp4"
    packed.w13, packed.w13_scale = torch.cat((w1, w3), dim=1), torch.cat((s1, s3), dim=1)
    packed.w2, packed.w2_scale = w2, s2
    layer.experts = packed
    x = torch.randn(5, d, generator=gen)
    routes = layer.gate(x, torch.zeros(5, dtype=torch.long))
    weights, indices = routes.weights, routes.indices
    routed = routed_experts_reference(x, weights, indices, ExpertWeights(w1, w3, w2, s1, s3, s2), cfg.swiglu_limit)
    want = routed + layer.shared_experts(x).float()
    assert torch.equal(layer(x, torch.zeros(5, dtype=torch.long)), want)
    swapped = routed_experts_reference(x, weights, indices, ExpertWeights(w3, w1, w2, s3, s1, s2), cfg.swiglu_limit)
    assert not torch.allclose(swapped, routed, atol=1e-3)
