"""`ds4 bench attention`: the sparse attention kernel at a model's shapes against its roofline.

One layer's attention of a batch over the FP8 (or bf16) cache, as the model calls it: the window (128 entries),
then CSA's top-k or every HCA entry; the projection's queries finished (norm, RoPE) in the launch and the output
turned back (RotaryQueries). Decode: `batch` requests of one token at `context`; prefill: one request's
chunk of `tokens` from position 0. Decode is timed as a CUDA-graph replay (a captured step's cost), prefill
eagerly. The roofline is the larger of the bytes a step must read (the query, each distinct attended entry
once, the index lists, the output) over the measured copy bandwidth and its FLOPs (QK and PV) over the
measured bf16 GEMM rate; both ceilings are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

from ds4.bench.ceilings import copy_bandwidth, gemm_rate, median_ms
from ds4.config import load_config
from ds4.configs import config_dict
from ds4.kernels.fp8_kv import kv_entry_bytes, quantize_kv
from ds4.kernels.norm_rope import EntryForm
from ds4.kernels.rope import rope_inv_freq
from ds4.kernels.sparse_attention import AttentionPlan, RotaryQueries, attention_plan, sparse_attention

DECODE = [(b, c) for b in (1, 8, 16, 64) for c in (4096, 16384, 65536)]
PREFILL = [8192]
# Candidate plans of the sweep: (heads, keys a tile, warps, key tiles in flight, probabilities exchanged).
PLANS = [
    AttentionPlan(*p)
    for p in (
        (64, 32, 8, 2, False),
        (64, 32, 8, 1, False),
        (64, 32, 8, 3, False),
        (64, 16, 8, 2, False),
        (64, 32, 8, 1, True),
        (64, 64, 8, 1, True),
        # 16 warps: twice the warps an SM (still one program), the accumulator at 64 registers a thread (offline, sm_90,
        # the 8K CSA prefill's kernel: 128 registers and 432 / 128 bytes of spill stack at 64 / 32 keys, against
        # 255 and 296 at 8 warps and 64 keys)
        (64, 64, 16, 1, True),
        (64, 32, 16, 1, True),
        (32, 16, 4, 2, False),
        (16, 32, 4, 2, False),
        (16, 32, 4, 1, False),
        (16, 32, 4, 3, False),
    )
]
# Key splits tried in the sweep for decode at batch 1 and 64 (None: the kernel's own choice).
SPLITS = {1: (None, 1, 5, 10, 20, 40), 64: (None, 1, 2, 4)}


def _inputs(cfg, kind: str, positions: torch.Tensor, decode: bool, fp8: bool, device, gen: torch.Generator):
    """q, key sets and sink for tokens at `positions` (decode: each its own request; else one request's chunk
    from 0), pools sized to what they attend; index lists as the model builds them."""
    t, heads, dim, rope = positions.numel(), cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
    window, ratio = cfg.sliding_window, 4 if kind == "csa" else 128
    ar = torch.arange(window, device=device)
    win = positions[:, None] - window + 1 + ar[None, :]
    if decode:  # the window from each request's ring (the step's own key is the ring's last row here)
        ring = torch.arange(t, device=device)[:, None] * window + win % window
        sets = [(t * window, torch.where(win >= 0, ring, -1))]
    else:  # a chunk from position 0: its window keys are the step's own
        sets = [(t, torch.where(win >= 0, win, -1))]
    visible = (positions + 1) // ratio
    entries = int(visible.max())
    if kind == "csa":
        k = min(cfg.index_topk, entries)
        picks = (torch.rand(t, k, device=device, generator=gen) * visible[:, None]).long()
        picks = torch.where(torch.arange(k, device=device)[None, :] < visible[:, None], picks, -1)
        sets.append((t * entries if decode else entries, picks))
    elif kind == "hca":
        picks = torch.arange(entries, device=device)[None, :].expand(t, -1)
        sets.append((t * entries if decode else entries, torch.where(picks < visible[:, None], picks, -1)))
    if decode and kind != "window":  # each request's entries in its own rows
        pool_rows, picks = sets[-1]
        sets[-1] = (pool_rows, torch.where(picks >= 0, picks + torch.arange(t, device=device)[:, None] * entries, -1))
    key_sets = []
    for rows, idx in sets:
        kv = torch.randn(rows, dim, device=device, generator=gen, dtype=torch.bfloat16)
        key_sets.append((quantize_kv(kv, rope) if fp8 else kv, idx.contiguous()))
    q = torch.randn(t, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
    sink = torch.randn(heads, device=device, generator=gen)
    return q, key_sets, sink


def _cost(cfg, q, key_sets, fp8: bool) -> tuple[int, int]:
    """(bytes, FLOPs) of one call: each distinct attended entry read once (a chunk's tokens share most of theirs),
    the index lists, q and the output; QK and PV over every (token, attended entry) pair."""
    heads, dim = cfg.num_attention_heads, cfg.head_dim
    entry = kv_entry_bytes(dim, cfg.qk_rope_head_dim) if fp8 else dim * 2
    attended = sum(int((idx >= 0).sum()) for _, idx in key_sets)
    distinct = sum(int(idx[idx >= 0].unique().numel()) for _, idx in key_sets)
    index_bytes = sum(idx.numel() * idx.element_size() for _, idx in key_sets)
    nbytes = distinct * entry + index_bytes + 2 * q.numel() * q.element_size()
    return nbytes, 4 * heads * dim * attended


def _graph_ms(fn, device) -> float:
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, device, reps=50, warmup=5)


def _call(cfg, kind, positions, decode: bool, fp8, plan, device, splits=None):
    """The model's attention call (rotary queries) on a case's inputs, and those inputs (q, key sets)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, key_sets, sink = _inputs(cfg, kind, positions, decode, fp8, device, gen)
    rope = cfg.qk_rope_head_dim if fp8 else None
    inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta).to(device)
    rotary = RotaryQueries(EntryForm(None, inv_freq, cfg.rms_norm_eps, q.dtype), positions)

    def call():
        return sparse_attention(
            q, key_sets, sink, cfg.head_dim**-0.5, rope, impl="triton", plan=plan, splits=splits, rotary=rotary
        )

    return call, q, key_sets


def bench_case(cfg, kind, positions, decode: bool, fp8, bandwidth, rate, plan, device, splits=None) -> dict:
    """Decode is timed as a CUDA-graph replay, prefill eagerly."""
    call, q, key_sets = _call(cfg, kind, positions, decode, fp8, plan, device, splits)
    ms = _graph_ms(call, device) if decode else median_ms(call, device)
    nbytes, flops = _cost(cfg, q, key_sets, fp8)
    roof = max(nbytes / bandwidth, flops / rate) * 1e3
    return {"ms": ms, "bytes": nbytes, "flops": flops, "roofline_ms": roof, "of_roofline": roof / ms}


def _nsight_prefill(cfg, fp8: bool, device, plans: list[AttentionPlan]) -> list[dict]:
    """One 8K CSA prefill call a plan between cudaProfilerStart and Stop (each compiled and run once before), in
    this order: an `ncu --profile-from-start off` report's launches are these calls, one a plan."""
    positions = torch.arange(PREFILL[0], device=device)
    runs = []
    for plan in plans:
        try:
            call = _call(cfg, "csa", positions, False, fp8, plan, device)[0]
            call()
            torch.cuda.synchronize(device)
            torch.cuda.profiler.start()
            call()
            torch.cuda.synchronize(device)
            torch.cuda.profiler.stop()
            runs.append({"plan": plan.__dict__, "profiled": True})
        except Exception as e:  # a plan that does not compile or fit is reported, not fatal
            runs.append({"plan": plan.__dict__, "error": f"{type(e).__name__}: {str(e)[:120]}"})
        print(f"nsight launch {len(runs)}: {plan} {runs[-1].get('error', '')}")
    return runs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench attention", description=__doc__)
    parser.add_argument("--config", default="flash", help="flash, pro or a config.json (default: flash)")
    parser.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "bf16"))
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the table: key splits of CSA decode at batch 1 and 64, candidate launch plans",
    )
    parser.add_argument(
        "--nsight",
        action="store_true",
        help="instead of the table: the 8K CSA prefill once a plan (the chosen one, then the sweep's 64-head "
        "candidates) between cudaProfilerStart and Stop, for Nsight Compute (tools/ncu_attention.sh)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ds4 bench attention needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg = load_config(config_dict(args.config))
    fp8 = args.kv_cache_dtype == "fp8"
    bandwidth, rate = copy_bandwidth(device), gemm_rate(device, torch.bfloat16)
    plan = attention_plan(device, cfg.num_attention_heads, cfg.head_dim)
    small = attention_plan(device, cfg.num_attention_heads, cfg.head_dim, tokens=1)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": args.config,
        "kv_cache_dtype": args.kv_cache_dtype,
        "plan": plan.__dict__,
        "small_batch_plan": small.__dict__,
        "copy_bandwidth_tbps": bandwidth / 1e12,
        "bf16_gemm_tflops": rate / 1e12,
        "rows": [],
    }
    print(f"{report['device']}: copy {bandwidth / 1e12:.2f} TB/s, bf16 GEMM {rate / 1e12:.0f} TFLOP/s")
    print(f"plan {plan}, for small batches {small}")
    print(f"{'case':34} {'ms':>9} {'roof ms':>9} {'of roof':>8} {'MB':>9} {'GFLOP':>8}")
    cases = [("decode", kind, b, c) for kind in ("csa", "hca") for b, c in DECODE]
    cases += [("prefill", kind, 1, n) for kind in ("csa", "hca", "window") for n in PREFILL]
    if args.sweep or args.nsight:
        cases = []
    if args.nsight:
        report["nsight_plans"] = _nsight_prefill(cfg, fp8, device, [plan, *(p for p in PLANS if p.block_h == 64)])
    for mode, kind, batch, n in cases:
        if mode == "decode":
            positions = torch.full((batch,), n - 1, device=device)
        else:
            positions = torch.arange(n, device=device)
        row = bench_case(cfg, kind, positions, mode == "decode", fp8, bandwidth, rate, None, device)
        row.update(mode=mode, kind=kind, batch=batch, tokens=n)
        report["rows"].append(row)
        name = f"{mode} {kind} " + (f"batch {batch} ctx {n}" if mode == "decode" else f"{n} tokens")
        print(
            f"{name:34} {row['ms']:9.4f} {row['roofline_ms']:9.4f} {row['of_roofline']:8.1%} "
            f"{row['bytes'] / 1e6:9.2f} {row['flops'] / 1e9:8.2f}"
        )
    if args.sweep:
        report["sweep"] = []
        for batch, choices in SPLITS.items():  # decode at 64K with each token's keys split over programs or not
            positions = torch.full((batch,), 65535, device=device)
            for splits in choices:
                row = bench_case(cfg, "csa", positions, True, fp8, bandwidth, rate, None, device, splits)
                row.update(mode=f"decode batch {batch}", splits=splits or "auto")
                report["sweep"].append(row)
                print(f"sweep decode batch {batch} ctx 65536, splits {splits or 'auto'}: {row['ms']:.4f} ms")
        shapes = {
            "decode b1": torch.full((1,), 65535, device=device),
            "decode b8": torch.full((8,), 65535, device=device),
            "decode b16": torch.full((16,), 65535, device=device),
            "decode b64": torch.full((64,), 65535, device=device),
            "prefill": torch.arange(8192, device=device),
        }
        for candidate in PLANS:
            for mode, positions in shapes.items():
                decode = mode != "prefill"
                try:
                    row = bench_case(cfg, "csa", positions, decode, fp8, bandwidth, rate, candidate, device)
                except Exception as e:  # a plan that does not compile or fit is reported, not fatal
                    row = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
                row.update(plan=candidate.__dict__, mode=mode)
                report["sweep"].append(row)
                result = f"{row['ms']:.4f} ms, {row['of_roofline']:.1%} of roofline" if "ms" in row else row["error"]
                print(f"sweep {mode:10} {candidate}: {result}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
