"""GPU sweep of the indexer kernels' launch shapes (prefill and decode), checked, then timed.

    PYTHONPATH=$PWD python3 tools/indexer_sweep.py [--json PATH] [--budget-s 180] [--variants ...]

Each variant is first checked against ix.indexer_logits_reference on a slice (a causal block and a
shuffled-ends block of rows, output poisoned with NaN), then timed with triton.testing.do_bench (median):
prefill 8192 queries x 65536 keys with causal ends (t + 1) // 4 of a chunk ending at token 262144
(useful FLOPs counted as ds4.bench.kernels does), and the two decode cases of ds4 bench kernels.
One line per variant: ms, TFLOP/s or bandwidth, % of the ceiling measured in the same run, registers/spills.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from ds4.bench import ceilings
from ds4.bench import kernels as bench
from ds4.kernels import indexer as ix

# (keys, query rows, warps, stages) per program of the prefill kernel ("base", ix._launch)
PREFILL_VARIANTS = [
    ("base", (256, 64, 4, 3)),
    ("base", (256, 64, 4, 2)),
    ("base", (256, 64, 4, 4)),
    ("base", (256, 128, 4, 3)),
    ("base", (128, 64, 4, 3)),
    ("base", (128, 64, 4, 4)),
    ("base", (256, 64, 8, 3)),
]
# stream: ix._launch_decode, (keys, key tiles per program, warps, stages)
DECODE_VARIANTS = [
    ("base", (256, 8, 4, 2)),
    ("base", (128, 8, 4, 2)),
    ("base", (256, 8, 4, 3)),
    ("stream", (128, 8, 4, 3)),
    ("stream", (128, 16, 4, 3)),
    ("stream", (128, 8, 4, 4)),
    ("stream", (256, 4, 8, 3)),
    ("stream", (64, 16, 4, 4)),
    ("stream", (128, 4, 4, 3)),
]
DECODE_CASES = [(64, 2, 65536), (256, 1, 16384)]


def launch(kind, q, w, cache, table, key_end, rows_per_request, max_keys, out, tile):
    if kind == "base":
        return ix._launch(q, w, cache, table, key_end, rows_per_request, max_keys, out, tile)
    return ix._launch_decode(q, w, cache, table, key_end, rows_per_request, max_keys, out, tile)


def check(kind, tile, cases) -> float:
    """Largest relative error over the check cases; raises if the -inf pattern or any element is wrong."""
    worst = 0.0
    for q, w, cache, table, key_end, rows_per_request, max_keys, want in cases:
        got = torch.full_like(want, float("nan"))
        launch(kind, q, w, cache, table, key_end, rows_per_request, max_keys, got, tile)
        finite = torch.isfinite(want)
        if not torch.equal(torch.isfinite(got), finite) or not bool((got[~finite] == float("-inf")).all()):
            raise AssertionError("wrong -inf pattern or unwritten output")
        worst = max(worst, float((got[finite] - want[finite]).double().norm() / want[finite].double().norm()))
    return worst


def prefill_checks(q, w, cache, table, key_end, max_keys):
    """200 causal rows from the chunk's start, and 200 rows with shuffled ends (each block a request)."""
    cases = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for ends in (key_end[:200], torch.randint(0, max_keys + 1, (200,), device="cuda", generator=g).int()):
        want = ix.indexer_logits_reference(q[:200], w[:200], cache, table, ends, 200, max_keys)
        cases.append((q[:200], w[:200], cache, table, ends, 200, max_keys, want))
    return cases


def resources(compiled) -> str:
    return f"{getattr(compiled, 'n_regs', '?')}/{getattr(compiled, 'n_spills', '?')}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "indexer_sweep.json"))
    parser.add_argument("--budget-s", type=float, default=180.0, help="start no new variant after this")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--asm", help="folder for the default prefill variant's ttgir and ptx")
    args = parser.parse_args()
    started = time.time()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bandwidth_tbps": ceilings.copy_bandwidth(torch.device("cuda")) / 1e12,
        "fp8_gemm_tflops": ceilings.gemm_rate(torch.device("cuda"), torch.float8_e4m3fn) / 1e12,
        "prefill": [],
        "decode": [],
    }
    print(
        f"{report['device']} copy {report['bandwidth_tbps']:.2f} TB/s fp8 gemm {report['fp8_gemm_tflops']:.0f} TFLOP/s",
        flush=True,
    )

    def save():
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)

    q, w, cache, table, key_end, max_keys = bench._indexer_inputs(1, 8192, 65536, 4 * 65536)
    flops = float(key_end.double().sum()) * 64 * 128 * 2
    cases = prefill_checks(q, w, cache, table, key_end, max_keys)
    out = torch.empty(8192, max_keys, device="cuda")
    for kind, tile in PREFILL_VARIANTS:
        if time.time() - started > args.budget_s:
            print("budget spent, stopping", flush=True)
            break
        entry = {"kernel": kind, "tile": list(tile)}
        try:
            entry["rel_err"] = check(kind, tile, cases)
            compiled = launch(kind, q, w, cache, table, key_end, 8192, max_keys, out, tile)
            ms = ceilings.kernel_ms(lambda: launch(kind, q, w, cache, table, key_end, 8192, max_keys, out, tile))
            entry.update(
                ms=ms,
                tflops=flops / ms / 1e9,
                gemm_pct=100 * flops / ms / 1e9 / report["fp8_gemm_tflops"],
                regs_spills=resources(compiled),
                shared=compiled.metadata.shared,
            )
            if args.asm and kind == "base" and tile == ix._PREFILL_TILE:
                with open(os.path.join(args.asm, "prefill.ttgir"), "w") as f:
                    f.write(compiled.asm["ttgir"])
            print(
                f"prefill {kind} {tile}: {ms:.3f} ms {entry['tflops']:.0f} TFLOP/s {entry['gemm_pct']:.1f}% gemm "
                f"regs/spills {entry['regs_spills']} smem {entry['shared']} err {entry['rel_err']:.1e}",
                flush=True,
            )
        except Exception as err:  # a variant that fails to compile or check is reported, not fatal
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"prefill {kind} {tile}: {entry['error']}", flush=True)
        report["prefill"].append(entry)
        save()
    del out, cases

    for requests, per_request, n_keys in [] if args.skip_decode else DECODE_CASES:
        q, w, cache, table, key_end, max_keys = bench._indexer_inputs(requests, per_request, n_keys, None)
        g = torch.Generator(device="cuda").manual_seed(2)
        ends = torch.randint(0, n_keys + 1, key_end.shape, device="cuda", generator=g).int()
        want = ix.indexer_logits_reference(q, w, cache, table, ends, per_request, max_keys)
        rows = requests * per_request
        moved = requests * n_keys * ix.ENTRY_BYTES + rows * max_keys * 4 + q.numel()
        out = torch.empty(rows, max_keys, device="cuda")
        for kind, tile in DECODE_VARIANTS:
            if time.time() - started > args.budget_s:
                break
            entry = {
                "kernel": kind,
                "tile": list(tile),
                "requests": requests,
                "rows_per_request": per_request,
                "keys": n_keys,
            }
            try:
                entry["rel_err"] = check(kind, tile, [(q, w, cache, table, ends, per_request, max_keys, want)])

                def fn():
                    return launch(kind, q, w, cache, table, key_end, per_request, max_keys, out, tile)

                compiled = fn()
                if args.asm and kind == "stream" and tile == DECODE_VARIANTS[3][1]:
                    with open(os.path.join(args.asm, f"stream{per_request}.ttgir"), "w") as f:
                        f.write(compiled.asm["ttgir"])
                ms, graph_ms = ceilings.kernel_ms(fn), ceilings.graph_ms(fn)
                entry.update(
                    ms=ms,
                    graph_ms=graph_ms,
                    bw_pct=100 * moved / graph_ms / 1e9 / report["bandwidth_tbps"],
                    regs_spills=resources(compiled),
                )
                print(
                    f"decode {requests}x{per_request}x{n_keys} {kind} {tile}: {ms:.4f} ms, graph {graph_ms:.4f} ms "
                    f"{entry['bw_pct']:.1f}% copy bw regs/spills {entry['regs_spills']} err {entry['rel_err']:.1e}",
                    flush=True,
                )
            except Exception as err:
                entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"decode {requests}x{per_request}x{n_keys} {kind} {tile}: {entry['error']}", flush=True)
            report["decode"].append(entry)
            save()
    print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
