"""`ds4 bench moe`: the MoE layer with MXFP4 routed experts at a config's shapes, against rooflines measured in
the same run.

Decode-sized batches: the bytes of the experts the batch touches (packed weights and scales, each read once)
over the device-to-device copy bandwidth (bytes read + written per second). Prefill-sized batches: the routed
FLOPs (6 x slots x hidden x inter) over the bf16 GEMM rate at 8192^3. Times are medians of eager calls and of
CUDA-graph replays; inputs rotate over several routings so that touched weights do not come from L2.
Weights are random stored-form bytes (any byte is two valid e2m1 codes; scales 2^-9 .. 2^-6).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing
from torch import nn

from ds4.bench.ceilings import copy_bandwidth, gemm_rate, graph_ms, kernel_ms
from ds4.config import ModelConfig, load_config
from ds4.kernels import moe as km
from ds4.model.moe import Gate, MoE, SharedExpert, expert_weights

FLASH_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "deepseek-v4-flash.json"
TOKENS = (1, 8, 32, 64, 8192)
ROTATE_BYTES = 512 << 20  # touched expert bytes per timed call, at least: more than L2 holds


class PackedExperts(nn.Module):
    """Random experts in the checkpoint storage of the Experts module ("mxfp4": w13, w13_scale, w2, w2_scale)."""

    format = "mxfp4"

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        g = torch.Generator(device="cuda").manual_seed(seed)

        def codes(*shape):
            return torch.randint(0, 256, shape, device="cuda", generator=g, dtype=torch.uint8)

        def scales(*shape):
            return torch.randint(118, 122, shape, device="cuda", generator=g, dtype=torch.uint8)

        self.register_buffer("w13", codes(e, 2 * i, d // 2))
        self.register_buffer("w13_scale", scales(e, 2 * i, d // 32))
        self.register_buffer("w2", codes(e, d, i // 2))
        self.register_buffer("w2_scale", scales(e, d, i // 32))

    def bytes_per_expert(self) -> int:
        return sum(t[0].numel() for t in (self.w13, self.w13_scale, self.w2, self.w2_scale))


def moe_layer(cfg: ModelConfig) -> MoE:
    """A score-routed MoE layer with random weights, packed routed experts and a bf16 shared expert."""
    layer = MoE(cfg, hashed=False, dtype=torch.bfloat16, device=torch.device("meta"))
    layer.gate = Gate(cfg, hashed=False, device=torch.device("cuda"), dtype=torch.bfloat16)
    layer.gate.weight.normal_(0.0, cfg.hidden_size**-0.5)
    layer.experts = PackedExperts(cfg)
    if layer.shared_experts is not None:
        layer.shared_experts = SharedExpert(cfg, torch.bfloat16, torch.device("cuda"))
        for p in layer.shared_experts.parameters():
            p.normal_(0.0, p.shape[1] ** -0.5)
    return layer


def inputs(tokens: int, hidden: int, skew: float, g: torch.Generator) -> torch.Tensor:
    """A batch of random bf16 inputs; skew > 0 adds one random direction all its tokens share, skew standard
    deviations long (the tokens of one prompt in a random model share much of their hidden state, which skews the
    routing toward a few experts: 16 dummy Flash layers' 8K prefill gave the largest expert ~7x the mean)."""
    shared = torch.randn(1, hidden, device=g.device, generator=g) * skew
    return (torch.randn(tokens, hidden, device=g.device, generator=g) + shared).bfloat16()


def bench_moe(
    layer: MoE, tokens: int, bandwidth: float, gemm_rate: float, plans=None, whole_layer=True, skew: float = 0.0
) -> dict:
    """One batch size: the routed-experts op and the whole layer (gate, routed, shared), eager and graphed.
    whole_layer False: only the routed op's graph time (tile sweeps). skew: as `inputs`."""
    cfg_d = layer.gate.weight.shape[1]
    per_expert = layer.experts.bytes_per_expert()
    sets = max(1, min(16, ROTATE_BYTES // (per_expert * min(tokens * layer.gate.topk, layer.gate.weight.shape[0]))))
    g = torch.Generator(device="cuda").manual_seed(tokens)
    xs = [inputs(tokens, cfg_d, skew, g) for _ in range(sets)]
    ids = torch.zeros(tokens, dtype=torch.long, device="cuda")
    routes = [layer.gate(x, ids) for x in xs]
    loads = [torch.bincount(r.indices.flatten(), minlength=layer.gate.weight.shape[0]).float() for r in routes]
    largest_over_mean = sum((n.max() / n.mean()).item() for n in loads) / sets
    weights = expert_weights(layer.experts)
    touched = sum(int(r.indices.unique().numel()) for r in routes) / sets
    slots = tokens * layer.gate.topk
    d, i = cfg_d, layer.experts.w2.shape[2] * 2

    def routed():
        for x, r in zip(xs, routes):
            km.routed_experts_triton(x, r.weights, r.indices, weights, layer.limit, plans, (r.order, r.bounds))

    def whole():
        for x in xs:
            layer(x, ids)

    routed_graph_ms = graph_ms(routed) / sets
    if not whole_layer:
        return {"tokens": tokens, "routed_graph_ms": routed_graph_ms, "largest_over_mean": largest_over_mean}
    routed_ms = kernel_ms(routed) / sets
    layer_graph_ms = graph_ms(whole) / sets
    bytes_roof_ms = touched * per_expert / bandwidth * 1e3
    flops = 6 * slots * d * i
    flops_roof_ms = flops / gemm_rate * 1e3
    return {
        "tokens": tokens,
        "experts_touched": touched,
        "largest_over_mean": largest_over_mean,
        "touched_gb": touched * per_expert / 1e9,
        "routed_ms": routed_ms,
        "routed_graph_ms": routed_graph_ms,
        "layer_ms": kernel_ms(whole) / sets,
        "layer_graph_ms": layer_graph_ms,
        "bytes_roofline_ms": bytes_roof_ms,
        "bytes_ratio_graph": routed_graph_ms / bytes_roof_ms,
        "flops_roofline_ms": flops_roof_ms,
        "routed_tflops": flops / (routed_graph_ms * 1e-3) / 1e12,
        "flops_fraction_graph": flops_roof_ms / routed_graph_ms,
    }


def kernel_breakdown(layer: MoE, tokens: int, skew: float = 0.0) -> dict[str, float]:
    """CUDA time per kernel name (us per call) of the whole layer, from the profiler, and under "launches" the
    kernels (and memsets) one call runs."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = inputs(tokens, layer.gate.weight.shape[1], skew, g)
    ids = torch.zeros(tokens, dtype=torch.long, device="cuda")
    layer(x, ids)
    torch.cuda.synchronize()
    calls = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            layer(x, ids)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            times[event.key[:60]] = event.device_time_total / calls
    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / calls
    return {"launches": launches, **dict(sorted(times.items(), key=lambda kv: -kv[1]))}


def _plan(bm, weight_rows, bk, warps, stages, tma=False, rest=None, column_groups=0):
    return km.GemmPlan(
        bm=bm, weight_rows=weight_rows, bk=bk, warps=warps, stages=stages, tma=tma, rest=rest,
        column_groups=column_groups,
    )  # fmt: skip


SWEEP = {
    "decode": [
        _plan(16, 64, 256, 4, 4),
        _plan(16, 128, 256, 4, 4),
        _plan(16, 128, 256, 8, 4),
        _plan(16, 64, 512, 4, 3),
        _plan(16, 64, 128, 4, 6),
        _plan(16, 64, 256, 4, 2),  # fewer stages: more programs an SM, more decoding warps to hide each other
        _plan(16, 64, 256, 4, 3),
        _plan(16, 64, 128, 4, 3),
        _plan(16, 64, 256, 8, 4),
        _plan(16, 32, 256, 4, 4),  # 32 weight rows: mma.sync (no wgmma waits), 72 registers (offline sm_90)
        _plan(16, 32, 512, 4, 3),
        # the e4m3 MMA with 32-groups among its columns (sm_89+; GemmPlan.column_groups)
        _plan(1, 64, 512, 4, 3, column_groups=16),
        _plan(1, 64, 512, 4, 4, column_groups=16),
        _plan(1, 64, 512, 4, 2, column_groups=16),
        _plan(2, 64, 256, 4, 4, column_groups=8),
        _plan(2, 128, 256, 4, 4, column_groups=8),
        _plan(4, 64, 128, 4, 4, column_groups=4),
        _plan(4, 128, 128, 4, 4, column_groups=4),
        _plan(4, 128, 128, 4, 6, column_groups=4),
    ],
    "prefill": [
        _plan(256, 128, 64, 8, 4),
        _plan(256, 128, 128, 8, 3),
        _plan(128, 128, 64, 4, 4),
        _plan(256, 128, 64, 8, 4, tma=True),
        _plan(256, 128, 128, 8, 3, tma=True),
        _plan(128, 128, 64, 4, 4, tma=True),
        # a second launch for the experts' remainders (GemmPlan.rest; this bench's routing is near balanced, so
        # these time that launch's cost where it has little to do)
        _plan(256, 128, 128, 8, 3, tma=True, rest=_plan(128, 128, 128, 4, 3, tma=True)),
        _plan(256, 128, 128, 8, 3, tma=True, rest=_plan(64, 128, 128, 4, 4, tma=True)),
    ],
}


def sweep(layer: MoE, tokens: int, bandwidth: float, gemm_rate: float, skew: float = 0.0) -> list[dict]:
    """Graph time of the routed op with each candidate plan (both passes the same plan)."""
    runs = []
    for plan in SWEEP["decode" if tokens <= 64 else "prefill"]:
        try:
            row = bench_moe(layer, tokens, bandwidth, gemm_rate, plans=(plan, plan), whole_layer=False, skew=skew)
            runs.append({"plan": dataclasses.asdict(plan), **{k: v for k, v in row.items() if k != "tokens"}})
        except Exception as error:  # an over-sized plan (shared memory) is reported, not fatal
            runs.append({"plan": dataclasses.asdict(plan), "error": str(error)[:200]})
    return runs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench moe", description=__doc__)
    parser.add_argument("--config", default=str(FLASH_CONFIG), help="config.json (default: the Flash config)")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--json", metavar="PATH", help="write the full report here")
    parser.add_argument(
        "--sweep", type=int, nargs="*", metavar="TOKENS", help="time candidate tile plans (default at 1, 64, 8192)"
    )
    parser.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="the inputs of a batch share one random direction this many standard deviations long (a skewed "
        "routing, as a random model's prompt gives; the report prints the largest expert's rows over the mean: "
        "0.4 gives Flash's router at 8K tokens ~6-8x, as 16 dummy Flash layers' 8K prefill showed)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ds4 bench moe needs a CUDA device", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    torch.set_grad_enabled(False)
    layer = moe_layer(cfg)
    device = torch.device("cuda")
    bandwidth, gemm = copy_bandwidth(device), gemm_rate(device, torch.bfloat16)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_tbps": bandwidth / 1e12,
        "bf16_gemm_tflops": gemm / 1e12,
        "rows": [],
    }
    for tokens in args.tokens:
        report["rows"].append(bench_moe(layer, tokens, bandwidth, gemm, skew=args.skew))
        print(f"tokens {tokens}: {report['rows'][-1]}", file=sys.stderr)
    report["profile"] = {t: kernel_breakdown(layer, t, args.skew) for t in (1, 64, 8192) if t in args.tokens}
    if args.sweep is not None:
        swept = args.sweep or [t for t in args.tokens if t in (1, 64, 8192)]
        report["sweep"] = {t: sweep(layer, t, bandwidth, gemm, args.skew) for t in swept}
    print(f"copy {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {gemm / 1e12:.0f} TFLOP/s ({report['device']})")
    print(
        "tokens  touched  GB     routed ms  graph ms  layer graph ms  bytes roof ms  ratio  TFLOP/s  of bf16  "
        "largest/mean"
    )
    for r in report["rows"]:
        print(
            f"{r['tokens']:6d}  {r['experts_touched']:7.1f}  {r['touched_gb']:5.2f}  {r['routed_ms']:9.4f}  "
            f"{r['routed_graph_ms']:8.4f}  {r['layer_graph_ms']:14.4f}  {r['bytes_roofline_ms']:13.4f}  "
            f"{r['bytes_ratio_graph']:5.2f}  {r['routed_tflops']:7.1f}  {r['flops_fraction_graph']:6.1%}  "
            f"{r['largest_over_mean']:12.2f}"
        )
    for tokens, kernels in report["profile"].items():
        kernels = dict(kernels)
        launches = kernels.pop("launches")
        top = ", ".join(f"{name[:40]} {us:.1f}" for name, us in list(kernels.items())[:8])
        print(f"profile {tokens} tokens: {launches:.0f} kernels a layer call; us a call: {top}")
    for tokens, runs in report.get("sweep", {}).items():
        for run in runs:
            p = run["plan"]
            tiles = f"bm {p['bm']} weight rows {p['weight_rows']} bk {p['bk']} warps {p['warps']} stages {p['stages']}"
            tiles += (" tma" if p["tma"] else "") + (f" rest bm {p['rest']['bm']}" if p["rest"] else "")
            print(f"sweep {tokens:5d} tokens, {tiles}: {run.get('routed_graph_ms', run.get('error'))}")
    if args.skew:
        print(f"inputs skewed by a shared direction of {args.skew} standard deviations (--skew)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
