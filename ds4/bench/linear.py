"""`ds4 bench linear`: the FP8 block-scaled linear at DeepSeek-V4-Flash shapes against its rooflines.

Ceilings measured in the same run: device copy bandwidth (bytes read + written) and the fp8 GEMM rate of
torch._scaled_mm at 8192^3. A shape's roofline is the larger of its bytes (fp8 weight + scales, activations in,
output out) over the bandwidth and its FLOPs over the fp8 rate. Every timing is a CUDA-graph replay (median),
so decode-sized calls are not measured as Python launch overhead. Beside ds4's choice (`auto`) the table shows
the split-K kernel and cuBLAS at every M either takes, and bf16 F.linear on the dequantised weight.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from ds4.bench.ceilings import copy_bandwidth, gemm_rate, graph_ms
from ds4.checkpoint.quant import fp8_block_quantize
from ds4.kernels import fp8_linear as fl
from ds4.kernels._device import num_sms

# name: (N, K, groups, act_quant) of DeepSeek-V4-Flash (hidden 4096, 64 heads x 512, q/o rank 1024, 8 groups).
SHAPES = {
    "4096x4096": (4096, 4096, 1, True),
    "wq_a": (1024, 4096, 1, True),
    "wq_b": (32768, 1024, 1, True),
    "wo_a": (8 * 1024, 4096, 8, False),
    "wo_b": (4096, 8192, 1, True),
    "shared_w2": (4096, 2048, 1, True),
}
MS = (1, 8, 16, 64, 128, 8192)
SPLIT_K_MAX_M = 256


def _inputs(n: int, k: int, groups: int, m: int):
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w, s = fp8_block_quantize(torch.randn(n, k, device="cuda", generator=g) * k**-0.5, (128, 128))
    x = torch.randn(m, groups * k, device="cuda", generator=g).to(torch.bfloat16)
    return x, w, s.float()


def bench_shape(name: str, m: int, bandwidth: float, rate: float) -> dict:
    n, k, groups, quantize_x = SHAPES[name]
    x, w, s = _inputs(n, k, groups, m)
    bytes_moved = n * k + s.numel() * 4 + x.numel() * 2 + m * n * 2
    flops = 2 * m * n * k
    roofline = max(bytes_moved / bandwidth, flops / rate) * 1e3
    row = {"shape": name, "m": m, "n": n, "k": k, "groups": groups, "roofline_ms": roofline}
    row["auto_ms"] = graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x))
    if m <= SPLIT_K_MAX_M:
        row["split_k_ms"] = graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x, impl="triton"))
    if fl.cublas_fits(10**9, n, k, groups, quantize_x):
        row["cublas_ms"] = graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x, impl="cublas"))
    dense = fl.dequantize_weight(w, s).to(torch.bfloat16)
    if groups == 1:
        row["bf16_ms"] = graph_ms(lambda: F.linear(x, dense))
    row["fraction_of_roofline"] = roofline / row["auto_ms"]
    return row


def sweep_split_k(name: str, m: int) -> list[dict]:
    """The split-K kernel under other plans (programs per SM, output tile, stages) for tuning."""
    n, k, groups, quantize_x = SHAPES[name]
    x, w, s = _inputs(n, k, groups, m)
    base = fl.gemv_plan(m, n // groups, groups, k, 2, num_sms(x.device), fl.shared_memory_per_block(x.device))
    out = []
    for waves in (2, 4, 8):
        for block_n in (64, 128):
            for stages in (2, 4):
                tiles = -(-(n // groups) // block_n) * groups
                k_blocks = -(-k // 128)
                splits = max(1, min(-(-waves * num_sms(x.device) // tiles), k_blocks))
                per = -(-k_blocks // splits)
                plan = dataclasses.replace(
                    base, block_n=block_n, splits=-(-k_blocks // per), k_blocks_per_split=per, num_stages=stages
                )
                try:
                    ms = graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x, impl="triton", plan=plan))
                except Exception as e:  # a plan the device cannot run (shared memory) is reported, not fatal
                    out.append({"shape": name, "m": m, "plan": dataclasses.asdict(plan), "error": str(e)[:120]})
                    continue
                out.append({"shape": name, "m": m, "waves": waves, "plan": dataclasses.asdict(plan), "ms": ms})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench linear", description=__doc__)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=list(MS))
    parser.add_argument("--sweep", action="store_true", help="time other split-K plans (first shape, M = 1 and 64)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ds4 bench linear needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth, rate = copy_bandwidth(device), gemm_rate(device, torch.float8_e4m3fn)
    print(f"copy {bandwidth / 1e12:.2f} TB/s, fp8 GEMM {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)
    rows = []
    for name in args.shapes:
        for m in args.m:
            rows.append(bench_shape(name, m, bandwidth, rate))
            print(f"{name} M={m} done", file=sys.stderr)
    sweep = []
    if args.sweep:
        for name in args.shapes[:1]:
            for m in (1, 64):
                sweep.extend(sweep_split_k(name, m))
    head = f"{'shape':>10} {'M':>5} {'auto ms':>9} {'split-K':>9} {'cuBLAS':>9} {'bf16':>9} {'roofline':>9} {'frac':>6}"
    print(head)
    for r in rows:
        cells = [f"{r[c]:9.4f}" if c in r else f"{'-':>9}" for c in ("auto_ms", "split_k_ms", "cublas_ms", "bf16_ms")]
        print(
            f"{r['shape']:>10} {r['m']:>5} {' '.join(cells)} {r['roofline_ms']:9.4f} {r['fraction_of_roofline']:6.2f}"
        )
    if sweep:
        best = {}
        for r in sweep:
            key = (r["shape"], r["m"])
            if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
                best[key] = r
        for (name, m), r in sorted(best.items()):
            print(f"best split-K plan {name} M={m}: {r['ms']:.4f} ms waves={r['waves']} {r['plan']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "fp8_rate": rate, "rows": rows, "sweep": sweep}, f, indent=1)
    return 0
