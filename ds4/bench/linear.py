"""`ds4 bench linear`: the FP8 block-scaled linear at DeepSeek-V4-Flash shapes against its rooflines.

Ceilings measured in the same run: device copy bandwidth (bytes read + written) and the fp8 GEMM rate of
torch._scaled_mm at 8192^3. A shape's roofline is the larger of its bytes (fp8 weight + scales, activations in,
output out) over the bandwidth and its FLOPs over the fp8 rate. Every timing is a CUDA-graph replay (median,
L2 flushed before each), so decode-sized calls are not measured as Python launch overhead. Beside ds4's choice
(`auto`) the table shows the Triton kernel and cuBLAS at every M either takes, and bf16 F.linear on the
dequantised weight. A second table times fp32_product at decode sizes (bf16 weights, fp32 output: the router's,
the compressors' and the head's shapes): its Triton GEMV against cuBLAS (what GEMV_TOKENS in fp32_product.py
follows). `--sweep` times the Triton kernel under other tile settings per M family and prints the
settings with the least summed time over the shapes (what TILE_TABLE in fp8_linear.py holds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from ds4.bench.ceilings import copy_bandwidth, fp8_or_bf16_rate, graph_ms
from ds4.checkpoint.quant import fp8_block_quantize
from ds4.kernels import fp8_linear as fl
from ds4.kernels import fp32_product as fp
from ds4.kernels._device import has_blockwise_fp8_gemm, num_sms

# name: (N, K, groups, act_quant): DeepSeek-V4-Flash's FP8 linears as the model runs them (hidden 4096, q rank
# 1024, 64 heads x 512, o: 8 groups of 1024 rows, shared expert 2048, indexer 64 heads x 128), the linears of one
# input stacked (StackedLinears: wq_a with wkv, the shared expert's w1 with w3, a CSA layer's wq_b with its
# indexer's; 4096 x 4096 is also the MTP's e_proj / h_proj).
SHAPES = {
    "wq_a+wkv": (1024 + 512, 4096, 1, True),
    "wq_b": (32768, 1024, 1, True),
    "wq_b+idx_wq_b": (32768 + 8192, 1024, 1, True),
    "wo_a": (8 * 1024, 4096, 8, False),
    "wo_b": (4096, 8192, 1, True),
    "shared_w1+w3": (2 * 2048, 4096, 1, True),
    "shared_w2": (4096, 2048, 1, True),
    "idx_wq_b": (8192, 1024, 1, True),
}
MS = (1, 4, 16, 64, 128, 8192)
# name: (N, K) of DeepSeek-V4-Flash's fp32 products of bf16 weights: the router, a layer's compressors' wkv and
# wgate stacked (HCA 2 x 512 rows; CSA's overlapping windows 2 x 2 x 512 with its indexer's 2 x 2 x 128), the head.
FP32_SHAPES = {
    "router": (256, 4096),
    "hca_wkv+wgate": (1024, 4096),
    "csa+idx_wkv+wgate": (2048 + 512, 4096),
    "head": (129280, 4096),
}
FP32_MS = (1, 2, 4, 8)
TRITON_BENCH_MAX_M = 256
SWEEP_SHAPES = ("wq_a+wkv", "wq_b", "wo_a", "wo_b", "shared_w1+w3")
SWEEP_REP_MS = 50
# Candidate tile settings (block_n, block_k, programs_per_sm, max_stages, num_warps[, prefetch]) per family.
FMA_CANDIDATES = [
    fl.TileSettings(*t)
    for t in (
        (64, 256, 3, 3, 4),
        (64, 256, 3, 1, 4),
        (64, 256, 4, 2, 4),
        (32, 256, 4, 3, 4),
        (32, 256, 8, 1, 4),
        (64, 512, 3, 2, 4),
        (32, 512, 4, 3, 4),
        (128, 256, 2, 3, 8),
        (16, 256, 4, 3, 4),
        (64, 256, 3, 1, 4, True),  # the next chunk's weights loaded ahead into registers (sm_90: 203 registers)
        (64, 256, 3, 1, 8, True),  # (127)
        (32, 256, 4, 1, 4, True),  # (128)
        (32, 256, 8, 1, 4, True),
        (16, 256, 4, 1, 4, True),  # (72)
    )
]
DOT_CANDIDATES = [
    fl.TileSettings(*t)
    for t in (
        (64, 256, 4, 3, 4),
        (128, 128, 4, 4, 4),
        (64, 128, 4, 4, 4),
        (128, 128, 4, 4, 8),
        (64, 256, 4, 3, 8),
        (32, 256, 4, 3, 4),
        (64, 128, 8, 4, 4),
        (128, 256, 2, 2, 8),
        (64, 128, 4, 4, 8),  # the chosen tiles, 8 warps: no spills at M = 16 (sm_90 ptxas), 168 B at 64 (712 at 4)
    )
]
# family: (M, tl.dot, candidates)
SWEEPS = {
    "fma_m1": (1, False, FMA_CANDIDATES),
    "dot_m1": (1, True, DOT_CANDIDATES),
    "dot_m4": (4, True, DOT_CANDIDATES),
    "dot_m16": (16, True, DOT_CANDIDATES),
    "dot_m64": (64, True, DOT_CANDIDATES),
}


def _inputs(n: int, k: int, groups: int, m: int):
    g = torch.Generator(device="cuda").manual_seed(m + n)
    w, s = fp8_block_quantize(torch.randn(n, k, device="cuda", generator=g) * k**-0.5, (128, 128))
    x = torch.randn(m, groups * k, device="cuda", generator=g).to(torch.bfloat16)
    return x, w, s.float()


def bench_shape(name: str, m: int, bandwidth: float, rate: float, rep: int = 200) -> dict:
    n, k, groups, quantize_x = SHAPES[name]
    x, w, s = _inputs(n, k, groups, m)
    bytes_moved = n * k + s.numel() * 4 + x.numel() * 2 + m * n * 2
    flops = 2 * m * n * k
    roofline = max(bytes_moved / bandwidth, flops / rate) * 1e3
    row = {"shape": name, "m": m, "n": n, "k": k, "groups": groups, "roofline_ms": roofline}
    if m <= TRITON_BENCH_MAX_M:
        row["triton_ms"] = graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x, impl="triton"), rep)
        row["plan"] = dataclasses.asdict(
            fl.linear_plan(m, n // groups, groups, k, 2, num_sms(x.device), fl.shared_memory_per_block(x.device))
        )
    if fl.cublas_fits(10**9, n, k, groups, quantize_x):
        row["cublas_ms"] = graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x, impl="cublas"), rep)
    blockwise = has_blockwise_fp8_gemm(x.device)
    auto_key = "triton_ms" if fl.prefers_triton(m, n, k, groups, quantize_x, blockwise) else "cublas_ms"
    row["auto_ms"] = row.get(auto_key) or graph_ms(lambda: fl.fp8_linear(x, w, s, groups, quantize_x), rep)
    dense = fl.dequantize_weight(w, s).to(torch.bfloat16)
    if groups == 1:
        row["bf16_ms"] = graph_ms(lambda: F.linear(x, dense), rep)
    row["fraction_of_roofline"] = roofline / row["auto_ms"]
    return row


def bench_fp32_product(name: str, m: int, bandwidth: float, rep: int = 200) -> dict:
    n, k = FP32_SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(n + m)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    row = {"shape": name, "m": m, "n": n, "k": k, "roofline_ms": (n * k * 2 + m * k * 2 + m * n * 4) / bandwidth * 1e3}
    row["gemv_ms"] = graph_ms(lambda: fp.fp32_gemv(x, w), rep)
    row["cublas_ms"] = graph_ms(lambda: torch.mm(x, w.t(), out_dtype=torch.float32), rep)
    row["auto_ms"] = row["gemv_ms"] if m <= fp.GEMV_TOKENS else row["cublas_ms"]
    row["fraction_of_roofline"] = row["roofline_ms"] / row["auto_ms"]
    return row


def sweep(family: str, shapes: list[str], rep: int = SWEEP_REP_MS) -> list[dict]:
    """The Triton kernel under each candidate tile setting of `family` at every shape (a plan the device cannot
    run is reported, not fatal). rep=0 runs each plan once without timing it (compiles it)."""
    m, use_dot, candidates = SWEEPS[family]
    out = []
    for name in shapes:
        n, k, groups, quantize_x = SHAPES[name]
        x, w, s = _inputs(n, k, groups, m)
        for tiles in candidates:
            plan = fl.linear_plan(
                m, n // groups, groups, k, 2, num_sms(x.device), fl.shared_memory_per_block(x.device), tiles, use_dot
            )
            row = {"shape": name, "m": m, "tiles": dataclasses.asdict(tiles), "plan": dataclasses.asdict(plan)}

            def run(plan=plan):
                return fl.fp8_linear(x, w, s, groups, quantize_x, impl="triton", plan=plan)

            try:
                if rep:
                    row["ms"] = graph_ms(run, rep)
                else:
                    run()
            except Exception as e:  # e.g. out of shared memory on this device: reported, not fatal
                row["error"] = str(e)[:160]
            out.append(row)
        print(f"sweep {family} {name} done", file=sys.stderr)
    return out


def fixed_and_marginal(rows: list[dict], m: int = 1) -> tuple[float, float] | None:
    """Least-squares fit of the Triton kernel's times at M = m over the shapes: (fixed ms a launch, marginal bytes
    per ms), from time = fixed + weight bytes / rate; None with fewer than two shapes. A launch's fixed cost is
    what a decode step pays once per linear, whatever its size."""
    points = [(r["n"] * r["k"], r["triton_ms"]) for r in rows if r["m"] == m and "triton_ms" in r]
    if len({b for b, _ in points}) < 2:
        return None
    mean_b = sum(b for b, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    return mean_t - slope * mean_b, 1 / slope if slope > 0 else float("inf")


def best_settings(rows: list[dict]) -> list[tuple[float, dict]]:
    """Candidates that ran at every shape, by their summed time (a decode step runs each shape once)."""
    totals: dict[str, list] = {}
    for r in rows:
        key = json.dumps(r["tiles"])
        totals.setdefault(key, []).append(r.get("ms"))
    ranked = [(sum(v), json.loads(key)) for key, v in totals.items() if None not in v]
    return sorted(ranked, key=lambda t: t[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench linear", description=__doc__)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=list(MS))
    parser.add_argument(
        "--sweep",
        nargs="*",
        choices=list(SWEEPS),
        help="time other tile settings (M = 1, 4, 16 and 64): the families named, or all without names",
    )
    parser.add_argument("--rep", type=int, default=200, help="milliseconds of replays a timing repeats for")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ds4 bench linear needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth, (rate, kind) = copy_bandwidth(device), fp8_or_bf16_rate(device)
    print(f"copy {bandwidth / 1e12:.2f} TB/s, {kind} GEMM {rate / 1e12:.0f} TFLOP/s", file=sys.stderr)
    rows = []
    for name in args.shapes:
        for m in args.m:
            rows.append(bench_shape(name, m, bandwidth, rate, args.rep))
            print(f"{name} M={m} done", file=sys.stderr)
    products = [bench_fp32_product(name, m, bandwidth, args.rep) for name in FP32_SHAPES for m in FP32_MS]
    sweeps = {}
    if args.sweep is not None:
        shapes = [s for s in SWEEP_SHAPES if s in args.shapes]
        sweeps = {family: sweep(family, shapes) for family in args.sweep or SWEEPS}
    head = f"{'shape':>13} {'M':>5} {'auto ms':>9} {'triton':>9} {'cuBLAS':>9} {'bf16':>9} {'roofline':>9} {'frac':>6}"
    print(head)
    for r in rows:
        cells = [f"{r[c]:9.4f}" if c in r else f"{'-':>9}" for c in ("auto_ms", "triton_ms", "cublas_ms", "bf16_ms")]
        print(
            f"{r['shape']:>13} {r['m']:>5} {' '.join(cells)} {r['roofline_ms']:9.4f} {r['fraction_of_roofline']:6.2f}"
        )
    fit = fixed_and_marginal(rows)
    if fit is not None:
        print(f"M = 1, fit over the shapes: {fit[0] * 1e3:.1f} us a launch + weight bytes at {fit[1] / 1e9:.2f} TB/s")
    print(f"{'fp32 product':>13} {'M':>5} {'auto ms':>9} {'GEMV':>9} {'cuBLAS':>9} {'roofline':>9} {'frac':>6}")
    for r in products:
        cells = " ".join(f"{r[c]:9.4f}" for c in ("auto_ms", "gemv_ms", "cublas_ms", "roofline_ms"))
        print(f"{r['shape']:>13} {r['m']:>5} {cells} {r['fraction_of_roofline']:6.2f}")
    for family, sweep_rows in sweeps.items():
        ranked = best_settings(sweep_rows)
        for total, tiles in ranked[:3]:
            print(f"sweep {family}: {total:.4f} ms summed over the shapes, {tiles}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bandwidth": bandwidth,
                    "fp8_rate": rate if kind == "fp8" else None,
                    "roofline_gemm": kind,
                    "rows": rows,
                    "m1_fixed_ms_and_bytes_per_ms": fit,
                    "fp32_products": products,
                    "sweeps": sweeps,
                },
                f,
                indent=1,
            )
    return 0
