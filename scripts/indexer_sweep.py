"""GPU sweep of the indexer logits kernel's launch shapes (and trial kernels), checked, then timed.

    PYTHONPATH=$PWD python3 scripts/indexer_sweep.py [--json PATH] [--budget-s 180] [--variants ...]

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
import triton.language as tl

from ds4.bench import kernels as bench
from ds4.kernels import indexer as ix
from ds4.kernels._device import interpreting

# (keys, query rows, warps, stages) per program; kernel "base" is ix._indexer_logits_kernel, "pair" the trial below
PREFILL_VARIANTS = [
    ("base", (256, 64, 4, 3)), ("base", (256, 64, 4, 2)), ("base", (256, 64, 4, 4)), ("base", (256, 128, 4, 3)),
    ("base", (128, 64, 4, 3)), ("base", (128, 64, 4, 4)), ("base", (256, 64, 8, 3)), ("pair", (128, 64, 4, 3)),
    ("pair", (256, 64, 8, 3)),
]
# stream: ix._launch_decode, (keys, key tiles per program, warps, stages)
DECODE_VARIANTS = [("base", (256, 8, 4, 2)), ("base", (128, 8, 4, 2)), ("base", (256, 8, 4, 3)),
                   ("stream", (128, 8, 4, 3)), ("stream", (128, 16, 4, 3)), ("stream", (128, 8, 4, 4)),
                   ("stream", (256, 4, 8, 3)), ("stream", (64, 16, 4, 4)), ("stream", (128, 4, 4, 3))]
DECODE_CASES = [(64, 2, 65536), (256, 1, 16384)]


@triton.jit(do_not_specialize=["q_row16", "q_head16", "w_row4", "stride_bt", "rows_per_request",
                               "query_blocks", "key_tiles", "n_heads", "max_keys", "stride_out"])
def _pair_kernel(q_ptr, q_row16, q_head16, w_ptr, w_row4, vec_ptr, scale_ptr, bt_ptr, stride_bt,
                 key_end_ptr, rows_per_request, query_blocks, key_tiles, n_heads, max_keys, out_ptr,
                 stride_out, H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr,
                 PAGE_: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr):
    # Trial: two query rows per MMA (N = 2H), head sums split by a reshape.
    tile = tl.program_id(0) % key_tiles
    block = tl.program_id(0) // key_tiles
    request = block // query_blocks
    first = (block % query_blocks) * BLOCK_Q
    last = tl.minimum(first + BLOCK_Q, rows_per_request)
    row0 = request.to(tl.int64) * rows_per_request
    key_start = tile * BLOCK_S
    keys = key_start + tl.arange(0, BLOCK_S)
    key_in = keys < max_keys
    out_row = out_ptr + row0 * stride_out + keys
    local = first + tl.arange(0, BLOCK_Q)
    ends = tl.load(key_end_ptr + row0 + local, mask=local < last, other=0)
    sees = (local < last) & (ends > key_start)
    lo = tl.min(tl.where(sees, local, last), axis=0)
    hi = tl.maximum(tl.max(tl.where(sees, local + 1, 0), axis=0), lo)
    for i in range(first, lo):
        tl.store(out_row + i * stride_out, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=key_in)
    for i in range(hi, last):
        tl.store(out_row + i * stride_out, tl.full([BLOCK_S], float("-inf"), tl.float32), mask=key_in)
    key_live = key_in & (keys < tl.max(ends, axis=0))
    page = tl.load(bt_ptr + request.to(tl.int64) * stride_bt + keys // PAGE_, mask=key_in, other=0).to(tl.int64)
    slot = keys % PAGE_
    dims = tl.arange(0, D)
    k = tl.load(vec_ptr + (page * (PAGE_ * (D + 4)) + slot * D)[:, None] + dims[None, :],
                mask=key_live[:, None], other=0.0)
    k_scale = tl.load(scale_ptr + page * (PAGE_ * (D + 4) // 4) + PAGE_ * D // 4 + slot, mask=key_live, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
    cols = tl.arange(0, 2 * H)
    head = cols % H
    which = cols // H
    for i in range(lo, hi, 2):
        live = (head < n_heads) & (i + which < hi)
        row = row0 + i + which
        q = tl.load(q_ptr + (row * q_row16 * 16 + head * q_head16 * 16)[:, None] + dims[None, :],
                    mask=live[:, None], other=0.0)
        w = tl.load(w_ptr + row * w_row4 * 4 + head, mask=live, other=0.0)
        end_a = tl.load(key_end_ptr + row0 + i)
        end_b = tl.load(key_end_ptr + row0 + i + 1, mask=i + 1 < hi, other=0)
        if DOT_F32:
            q = q.to(tl.float32)
        dots = tl.dot(k, tl.trans(q))
        sums = tl.sum(tl.reshape(tl.maximum(dots, 0.0) * w[None, :], [BLOCK_S, 2, H]), axis=2)
        a, b = tl.split(sums)
        tl.store(out_row + i * stride_out, tl.where(keys < end_a, a * k_scale, float("-inf")), mask=key_in)
        tl.store(out_row + (i + 1) * stride_out, tl.where(keys < end_b, b * k_scale, float("-inf")),
                 mask=key_in & (i + 1 < hi))


def launch(kind, q, w, cache, table, key_end, rows_per_request, max_keys, out, tile):
    if kind == "base":
        return ix._launch(q, w, cache, table, key_end, rows_per_request, max_keys, out, tile)
    if kind == "stream":
        return ix._launch_decode(q, w, cache, table, key_end, rows_per_request, max_keys, out, tile)
    rows, n_heads, _ = q.shape
    q, w = ix._wide_operands(q, w)
    block_s, block_q, warps, stages = tile
    block_q = min(block_q, triton.next_power_of_2(rows_per_request))
    query_blocks = triton.cdiv(rows_per_request, block_q)
    key_tiles = triton.cdiv(max_keys, block_s)
    grid = (rows // rows_per_request * query_blocks * key_tiles,)
    return _pair_kernel[grid](
        q, q.stride(0) // 16, q.stride(1) // 16, w, w.stride(0) // 4, cache.view(torch.float8_e4m3fn), cache.view(torch.float32),
        table, table.stride(0), key_end.to(torch.int32), rows_per_request, query_blocks, key_tiles, n_heads, max_keys,
        out, out.stride(0), H=max(16, triton.next_power_of_2(n_heads)), BLOCK_Q=block_q, BLOCK_S=block_s, PAGE_=ix.PAGE,
        D=ix.HEAD_DIM, DOT_F32=interpreting(), num_warps=warps, num_stages=stages)


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
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "bandwidth_tbps": bench.copy_bandwidth() / 1e12, "fp8_gemm_tflops": bench.fp8_gemm_rate() / 1e12,
              "prefill": [], "decode": []}
    print(f"{report['device']} copy {report['bandwidth_tbps']:.2f} TB/s fp8 gemm {report['fp8_gemm_tflops']:.0f} "
          "TFLOP/s", flush=True)

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
            ms = bench._median_ms(lambda: launch(kind, q, w, cache, table, key_end, 8192, max_keys, out, tile))
            entry.update(ms=ms, tflops=flops / ms / 1e9, gemm_pct=100 * flops / ms / 1e9 / report["fp8_gemm_tflops"],
                         regs_spills=resources(compiled), shared=compiled.metadata.shared)
            if args.asm and kind == "base" and tile == ix._PREFILL_TILE:
                with open(os.path.join(args.asm, "prefill.ttgir"), "w") as f:
                    f.write(compiled.asm["ttgir"])
            print(f"prefill {kind} {tile}: {ms:.3f} ms {entry['tflops']:.0f} TFLOP/s {entry['gemm_pct']:.1f}% gemm "
                  f"regs/spills {entry['regs_spills']} smem {entry['shared']} err {entry['rel_err']:.1e}", flush=True)
        except Exception as err:  # a variant that fails to compile or check is reported, not fatal
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"prefill {kind} {tile}: {entry['error']}", flush=True)
        report["prefill"].append(entry)
        save()
    del out, cases

    for requests, per_request, n_keys in ([] if args.skip_decode else DECODE_CASES):
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
            entry = {"kernel": kind, "tile": list(tile), "requests": requests, "rows_per_request": per_request,
                     "keys": n_keys}
            try:
                entry["rel_err"] = check(kind, tile, [(q, w, cache, table, ends, per_request, max_keys, want)])

                def fn():
                    return launch(kind, q, w, cache, table, key_end, per_request, max_keys, out, tile)

                compiled = fn()
                if args.asm and kind == "stream" and tile == DECODE_VARIANTS[3][1]:
                    with open(os.path.join(args.asm, f"stream{per_request}.ttgir"), "w") as f:
                        f.write(compiled.asm["ttgir"])
                ms, graph_ms = bench._median_ms(fn), bench._graph_ms(fn)
                entry.update(ms=ms, graph_ms=graph_ms, bw_pct=100 * moved / graph_ms / 1e9 / report["bandwidth_tbps"],
                             regs_spills=resources(compiled))
                print(f"decode {requests}x{per_request}x{n_keys} {kind} {tile}: {ms:.4f} ms, graph {graph_ms:.4f} ms "
                      f"{entry['bw_pct']:.1f}% copy bw regs/spills {entry['regs_spills']} err {entry['rel_err']:.1e}",
                      flush=True)
            except Exception as err:
                entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"decode {requests}x{per_request}x{n_keys} {kind} {tile}: {entry['error']}", flush=True)
            report["decode"].append(entry)
            save()
    print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
