"""Quick A/B of grouped-GEMM plans on the GPU: the default plans against the same tiles with a one-step
prefetch, at 1 and 8192 tokens (Flash shapes). Equal outputs asserted, graph-replay medians printed as they come."""

import dataclasses
import sys

import torch

from ds4.bench.moe import FLASH_CONFIG, PackedExperts, _graph_ms
from ds4.config import load_config
from ds4.kernels import moe as km
from ds4.kernels._device import num_sms, shared_memory_per_block
from ds4.model.moe import expert_weights


def main() -> int:
    torch.set_grad_enabled(False)
    cfg = load_config(FLASH_CONFIG)
    weights = expert_weights(PackedExperts(cfg))
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dev = torch.device("cuda")
    for tokens in [int(t) for t in sys.argv[1:]] or [1, 8192]:
        g = torch.Generator(device="cuda").manual_seed(tokens)
        sets = 8 if tokens < 64 else 1
        xs = [torch.randn(tokens, d, device="cuda", generator=g).bfloat16() for _ in range(sets)]
        routes = [
            (
                torch.rand(tokens, 6, device="cuda", generator=g),
                torch.randn(tokens, e, device="cuda", generator=g).topk(6).indices,
            )
            for _ in xs
        ]
        s = tokens * 6
        base = (
            km.gemm_plan(s, e, i, True, True, 2, num_sms(dev), shared_memory_per_block(dev)),
            km.gemm_plan(s, e, d, False, True, 2, num_sms(dev), shared_memory_per_block(dev)),
        )
        want = km.routed_experts_triton(xs[0], *routes[0], weights, 10.0, base)
        for name, plans in (
            ("default", base),
            ("prefetch", tuple(dataclasses.replace(p, prefetch=True) for p in base)),
        ):
            got = km.routed_experts_triton(xs[0], *routes[0], weights, 10.0, plans)

            def run():
                for x, (w, idx) in zip(xs, routes):
                    km.routed_experts_triton(x, w, idx, weights, 10.0, plans)

            ms = _graph_ms(run) / sets
            print(f"tokens {tokens} {name} {plans} equal={torch.equal(got, want)} graph_ms={ms:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
