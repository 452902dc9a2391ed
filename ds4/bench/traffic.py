"""`ds4 bench traffic`: the collective traffic of a sharded model per decode step and per prefill, computed from
the config (ds4.distributed.traffic, the counts the tests check against a real gloo run), the time it implies on
each interconnect's one-way bandwidth, and the routed-expert weight bytes the busiest rank reads per MoE layer
(TP: 1 / N of every touched expert; EP: the touched experts it holds, plus its expert 0, which takes the other
ranks' slots at weight 0), under uniform random routing. Nothing is timed: the bandwidths are the vendors'.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ds4.bench.lengths import parse_length
from ds4.config import load_config
from ds4.configs import config_dict
from ds4.distributed.parallel import ParallelConfig
from ds4.distributed.traffic import Traffic, decode_step_traffic, prefill_traffic

# One-way bandwidth per GPU, bytes/s.
INTERCONNECTS = {
    "NVLink 4 (H200)": 450e9,
    "PCIe 5 x16 (RTX PRO 6000)": 64e9,
    "200 GbE (GB10 cluster)": 25e9,
}


def busiest_rank_experts(n_experts: int, top_k: int, world: int, tokens: int, expert_parallel: bool) -> float:
    """Expected routed experts' weights (in whole experts) the busiest rank reads per MoE layer, routing uniform."""
    gen = torch.Generator().manual_seed(0)
    total, trials = 0.0, 200 if tokens <= 256 else 10  # a long prefill touches every expert in every trial
    for _ in range(trials):
        picks = torch.rand(tokens, n_experts, generator=gen).topk(top_k, dim=1).indices.flatten()
        touched = torch.zeros(n_experts, dtype=torch.bool)
        touched[picks] = True
        if expert_parallel:
            per_rank = touched.view(world, -1)
            per_rank[:, 0] = True
            total += per_rank.sum(dim=1).max().item()
        else:
            total += touched.sum().item() / world
    return total / trials


def rows(cfg, batches: list[int], prefill: int, worlds: list[int]) -> list[dict]:
    expert_bytes = expert_weight_bytes(cfg)
    out = []
    for ep in (False, True):
        for n in worlds:
            pc = ParallelConfig(n, ep)
            phases = [(f"decode B={b}", decode_step_traffic(cfg, pc, b), b) for b in batches]
            phases.append((f"prefill {prefill}", prefill_traffic(cfg, pc, prefill), prefill))
            for phase, traffic, tokens in phases:
                experts = busiest_rank_experts(cfg.n_routed_experts, cfg.num_experts_per_tok, n, tokens, ep)
                out.append(_row("EP" if ep else "TP", n, phase, traffic, experts * expert_bytes))
    return out


def _row(layout: str, n: int, phase: str, t: Traffic, expert_bytes: float) -> dict:
    return {
        "layout": layout,
        "ranks": n,
        "phase": phase,
        "calls": t.total_calls,
        "payload_bytes": t.total_payload,
        "wire_bytes_per_rank": t.wire_bytes,
        "ms": {name: t.wire_bytes / bw * 1e3 for name, bw in INTERCONNECTS.items()},
        "busiest_rank_expert_bytes_per_layer": expert_bytes,
    }


def expert_weight_bytes(cfg) -> float:
    """One routed expert's stored bytes (w1, w2, w3): MXFP4 (half a byte a weight, a scale byte per 32), FP8
    (a byte a weight), else bf16."""
    weights = 3 * cfg.moe_intermediate_size * cfg.hidden_size
    if cfg.expert_dtype == "fp4":
        return weights * (0.5 + 1 / 32)
    return weights * (1 if cfg.fp8_block else 2)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench traffic", description=__doc__)
    parser.add_argument("--config", default="flash", help="flash, pro, a model directory or config.json")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="decode batch sizes")
    parser.add_argument("--prefill", type=parse_length, default=8192, help="prompt length of the prefill row")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", metavar="PATH", help="write the rows here")
    args = parser.parse_args(argv)
    cfg = load_config(config_dict(args.config))
    for n in args.ranks:
        for ep in (False, True):
            ParallelConfig(n, ep).validate(cfg, num_devices=n)
    table = rows(cfg, args.batch, args.prefill, args.ranks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "interconnects_bytes_per_s": INTERCONNECTS, "rows": table}, f, indent=1)
    names = list(INTERCONNECTS)
    print(f"{args.config}: collective traffic per rank (computed), bf16 activations, fp32 logits")
    links = " | ".join(f"{n} ms" for n in names)
    print(f"| layout | ranks | phase | calls | payload MB | wire MB/rank | {links} | busiest rank expert MB/layer |")
    print("|---" * (7 + len(names)) + "|")
    for r in table:
        times = " | ".join(f"{r['ms'][n]:.3f}" for n in names)
        print(
            f"| {r['layout']} | {r['ranks']} | {r['phase']} | {r['calls']} | {r['payload_bytes'] / 1e6:.2f} | "
            f"{r['wire_bytes_per_rank'] / 1e6:.2f} | {times} | {r['busiest_rank_expert_bytes_per_layer'] / 1e6:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
