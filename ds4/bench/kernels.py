"""`ds4 bench kernels`: top-k, indexer and layer kernels (mHC, RMSNorm, RoPE, gated pooling) against torch and
against the measured rooflines.

Ceilings are measured in the same run: device-to-device copy bandwidth (bytes read + written) and the
fp8 e4m3 GEMM rate of torch._scaled_mm at 8192^3. A kernel's roofline time is its bytes read over the
copy bandwidth (top-k, decode, the layer kernels) or its useful FLOPs over the fp8 rate (prefill logits).
The layer kernels are timed at DeepSeek-V4 Flash shapes against their torch references (the path they replace).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import triton

from ds4.bench.ceilings import copy_bandwidth, fp8_or_bf16_rate, graph_ms, kernel_ms
from ds4.kernels import gated_pool, norm_rope, rmsnorm, rope, topk_triton
from ds4.kernels import hyper_connections as mhc
from ds4.kernels import indexer as ix
from ds4.kernels import topk as tk
from ds4.kernels._device import num_sms, shared_memory_per_block

TOPK_CASES = [(64, 131072, 512), (1, 1048576, 512), (2048, 65536, 512), (64, 131072, 1024), (128, 32768, 512)]
ROTATE_BYTES = 256 << 20  # inputs smaller than this are rotated so timings do not come from L2


def bench_topk(rows: int, cols: int, k: int, bandwidth: float) -> dict:
    sets = max(1, ROTATE_BYTES // (rows * cols * 4))
    inputs = [torch.randn(rows, cols, device="cuda") for _ in range(sets)]
    lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)

    def ours():
        for x in inputs:
            tk.topk_indices(x, lengths, k)

    def theirs():
        for x in inputs:
            torch.topk(x, k, dim=1)

    got = tk.topk_indices(inputs[0], lengths, k)
    exact = bool(torch.equal(got, tk.topk_indices_reference(inputs[0], lengths, k)))
    ds4_ms = kernel_ms(ours) / sets
    ds4_graph_ms = graph_ms(ours) / sets
    torch_ms = kernel_ms(theirs) / sets
    torch_graph_ms = graph_ms(theirs) / sets
    roof_ms = rows * cols * 4 / bandwidth * 1e3
    return {
        "rows": rows,
        "cols": cols,
        "k": k,
        "exact": exact,
        "ds4_ms": ds4_ms,
        "ds4_graph_ms": ds4_graph_ms,
        "torch_topk_ms": torch_ms,
        "torch_topk_graph_ms": torch_graph_ms,
        "speedup_vs_torch": torch_ms / ds4_ms,
        "speedup_vs_torch_graph": torch_graph_ms / ds4_graph_ms,
        "roofline_ms": roof_ms,
        "roofline_fraction": roof_ms / ds4_ms,
        "roofline_fraction_graph": roof_ms / ds4_graph_ms,
    }


# Changes to the chosen top-k settings that --all-tiles times: a field of topk_triton.Settings, or one of its
# row layouts ("split", "one_program") with changes to the layout's fields.
TOPK_VARIANTS = {
    "chosen": {},
    "split rows: radix tau": {"split": {"tau_linear": False}},
    "split rows: 8192-entry tiles": {"split": {"tile": 8192}},
    "one-program rows: linear tau": {"one_program": {"tau_linear": True}},
    "one-program rows: no coarse listing": {"one_program": {"coarse_list": False}},
    "one-program rows: prefetch": {"one_program": {"prefetch": True}},
    "one-program rows: 4 warps, 128 registers": {"one_program": {"warps": 4, "max_registers": 128}},
    "one scan split per count program": {"count_merge": 1},
    "no early count launch": {"early_count_launch": False},
    "no staggered first wave": {"stagger_ns_per_byte": 0.0},
}
TOPK_SWEEP_CASES = [(64, 131072, 512), (1, 1048576, 512), (2048, 65536, 512), (128, 32768, 512)]


def vary(settings: topk_triton.Settings, changes: dict) -> topk_triton.Settings:
    """`settings` with `changes` (see TOPK_VARIANTS)."""
    fields = {
        name: dataclasses.replace(getattr(settings, name), **value) if isinstance(value, dict) else value
        for name, value in changes.items()
    }
    return dataclasses.replace(settings, **fields)


def sweep_topk(rows: int, cols: int, k: int, variants: dict = TOPK_VARIANTS) -> list[dict]:
    """Graph-replay time of each variant of the Triton path's settings (checked exact on the first input)."""
    sets = max(1, ROTATE_BYTES // (rows * cols * 4))
    inputs = [torch.randn(rows, cols, device="cuda") for _ in range(sets)]
    lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)
    want = tk.topk_indices_reference(inputs[0], lengths, k)
    chosen = topk_triton.settings_for(inputs[0].device)
    runs = []
    for name, changes in variants.items():
        settings = vary(chosen, changes)

        def ours():
            for x in inputs:
                topk_triton.launch(x, lengths, k, settings)

        exact = bool(torch.equal(topk_triton.launch(inputs[0], lengths, k, settings), want))
        runs.append({"variant": name, "exact": exact, "ms": kernel_ms(ours) / sets, "graph_ms": graph_ms(ours) / sets})
    return runs


def topk_kernel_breakdown(rows: int, cols: int, k: int) -> dict:
    """Device microseconds per kernel of one top-k call (torch profiler, mean of 5 calls)."""
    x = torch.randn(rows, cols, device="cuda")
    lengths = torch.full((rows,), cols, device="cuda", dtype=torch.int32)
    tk.topk_indices(x, lengths, k)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            tk.topk_indices(x, lengths, k)
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / 5 for e in prof.key_averages() if e.device_time_total > 0}


def _indexer_inputs(requests: int, rows_per_request: int, n_keys: int, context_end: int | None):
    pages = triton.cdiv(n_keys, ix.PAGE)
    cache = ix.new_indexer_cache(requests * pages, device="cuda")
    vectors, scales = ix.cache_views(cache)
    vectors.copy_(torch.randn(vectors.shape, device="cuda").to(torch.float8_e4m3fn))
    scales.copy_(torch.rand(scales.shape, device="cuda") + 0.5)
    table = torch.randperm(requests * pages, device="cuda").view(requests, pages).to(torch.int32)
    rows = requests * rows_per_request
    q = torch.randn(rows, 64, 128, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(rows, 64, device="cuda")
    if context_end is None:
        key_end = torch.full((rows,), n_keys, device="cuda", dtype=torch.int32)
    else:  # causal prefill chunk ending at token context_end: key_end = (t + 1) // 4
        t = torch.arange(context_end - rows, context_end, device="cuda")
        key_end = ((t + 1) // 4).clamp(max=n_keys).to(torch.int32)
    return q, w, cache, table, key_end, pages * ix.PAGE


PREFILL_TILES = [(256, 64, 4, 3), (256, 128, 4, 3), (256, 64, 8, 3), (128, 64, 4, 3)]  # keys, rows, warps, stages


def bench_indexer_prefill(queries: int, n_keys: int, gemm_rate: float, tiles) -> dict:
    q, w, cache, table, key_end, max_keys = _indexer_inputs(1, queries, n_keys, 4 * n_keys)
    flops = float(key_end.double().sum()) * 64 * 128 * 2
    out = torch.empty(queries, max_keys, device="cuda")
    runs = []
    for tile in tiles:

        def fn(tile=tile):
            return ix._launch(q, w, cache, table, key_end, queries, max_keys, out, tile)

        try:
            compiled = fn()
            ms = kernel_ms(fn)
        except Exception as err:  # a tile that does not fit (shared memory) is reported, not fatal
            runs.append({"tile": list(tile), "error": str(err)[:200]})
            continue
        runs.append(
            {
                "tile": list(tile),
                "ms": ms,
                "tflops": flops / (ms * 1e-3) / 1e12,
                "gemm_fraction": flops / (ms * 1e-3) / gemm_rate,
                "regs": getattr(compiled, "n_regs", None),
                "spills": getattr(compiled, "n_spills", None),
            }
        )
    sample = slice(0, 256)
    ref = ix.indexer_logits_reference(q[sample], w[sample], cache, table, key_end[sample], 256, max_keys)
    got = ix.indexer_logits(q[sample], w[sample], cache, table, key_end[sample], 256, max_keys)
    finite = torch.isfinite(ref)
    err = float((got[finite] - ref[finite]).norm() / ref[finite].norm())
    fused_ms = kernel_ms(lambda: ix.indexer_topk(q, w, cache, table, key_end, queries, max_keys, 512))
    return {
        "queries": queries,
        "keys": n_keys,
        "useful_flops": flops,
        "rel_err_vs_fp32": err,
        "tiles": runs,
        "indexer_topk_ms_k512": fused_ms,
    }


def bench_indexer_decode(requests: int, rows_per_request: int, n_keys: int, bandwidth: float) -> dict:
    q, w, cache, table, key_end, max_keys = _indexer_inputs(requests, rows_per_request, n_keys, None)
    out = torch.empty(requests * rows_per_request, max_keys, device="cuda")

    def fn():
        return ix.indexer_logits(q, w, cache, table, key_end, rows_per_request, max_keys, out=out)

    ms, replay_ms = kernel_ms(fn), graph_ms(fn)
    rows = requests * rows_per_request
    moved = requests * n_keys * ix.ENTRY_BYTES + rows * max_keys * 4 + q.numel()
    return {
        "requests": requests,
        "rows_per_request": rows_per_request,
        "keys": n_keys,
        "ms": ms,
        "graph_ms": replay_ms,
        "bytes_moved": moved,
        "bandwidth_fraction": moved / (ms * 1e-3) / bandwidth,
        "bandwidth_fraction_graph": moved / (replay_ms * 1e-3) / bandwidth,
    }


MHC_TOKENS = (1, 64, 8192)
MHC_HC, MHC_HIDDEN, MHC_ITERS, MHC_HEADS, MHC_HEAD_DIM = 4, 4096, 20, 64, 512  # DeepSeek-V4 Flash


def _mhc_ops(tokens: int, g: torch.Generator) -> list[tuple[str, int, object, object]]:
    """(op, bytes it must move, ds4 call, torch reference call) at Flash shapes with bf16 streams; "hc_post+pre" is an
    hc_post, the next hc_pre and its RMSNorm (one launch at decode sizes); "rope q" is the
    rotation of the attention queries [T, heads, head_dim], "kv entry" the kv's norm, rotation and FP8 entry, "pool
    csa" CSA's compressor entries (pooled, finished, FP8) from its rings and fresh rows."""
    hc, d, e, dev = MHC_HC, MHC_HIDDEN, 2, g.device
    mix = (2 + hc) * hc
    h = torch.randn(tokens, hc, d, device=dev, generator=g).to(torch.bfloat16)
    out = torch.randn(tokens, d, device=dev, generator=g).to(torch.bfloat16)
    fn = torch.randn(mix, hc * d, device=dev, generator=g) * (hc * d) ** -0.5
    head_fn = fn[:hc].contiguous()
    scale, base = torch.rand(3, device=dev, generator=g) + 0.5, torch.randn(mix, device=dev, generator=g)
    norm_weight = torch.ones(d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(tokens, MHC_HEADS, MHC_HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
    positions = torch.randint(0, 1 << 16, (tokens,), device=dev, generator=g)
    inv_freq = rope.rope_inv_freq(64, 10000.0).to(dev)
    kv = torch.randn(tokens, MHC_HEAD_DIM, device=dev, generator=g).to(torch.bfloat16)
    entry = norm_rope.EntryForm(norm_weight.float()[:MHC_HEAD_DIM], inv_freq, 1e-6, torch.bfloat16, fp8=True)
    q_form = norm_rope.EntryForm(None, inv_freq, 1e-6, torch.bfloat16)
    # CSA's compressor: every token pools its overlapping window of 8 rows (decode), fp32 kv and score of 2 x 512
    pool_kv, pool_score = torch.randn(2, tokens * 4 + 8, 1024, device=dev, generator=g)
    ring, fresh = (pool_kv, pool_score), (pool_kv[:tokens], pool_score[:tokens])
    ape = torch.zeros(4, 1024, device=dev)
    pool_rows = torch.randint(0, tokens * 5 + 8, (tokens, 8), device=dev, generator=g)
    pool_args = (ring, fresh, ape, pool_rows, positions // 4, entry)
    _, post, comb = mhc.hc_pre_reference(h, fn, scale, base, hc, MHC_ITERS, 1e-6, 1e-6)
    gates = tokens * (hc + hc * hc) * 4
    streams, one = tokens * hc * d * e, tokens * d * e
    pre_args = (h, fn, scale, base, hc, MHC_ITERS, 1e-6, 1e-6)
    head_args = (h, head_fn, scale[:1], base[:hc], 1e-6, 1e-6)
    post_pre_args = (fn, scale, base, norm_weight.float(), hc, MHC_ITERS, 1e-6, 1e-6)
    return [
        ("hc_pre", streams + fn.numel() * 4 + one + gates, lambda: mhc.hc_pre(*pre_args),
         lambda: mhc.hc_pre_reference(*pre_args)),
        ("hc_post", 2 * streams + one + gates, lambda: mhc.hc_post(out, h, post, comb),
         lambda: mhc.hc_post_reference(out, h, post, comb)),
        ("hc_post+pre", 3 * streams + fn.numel() * 4 + 2 * one + 2 * gates,
         lambda: mhc.hc_post_pre(out, h, post, comb, *post_pre_args),
         lambda: _post_pre_reference(out, h, post, comb, *post_pre_args)),
        ("hc_head", streams + head_fn.numel() * 4 + one, lambda: mhc.hc_head(*head_args),
         lambda: mhc.hc_head_reference(*head_args)),
        ("rms_norm", 2 * one + d * 2, lambda: rmsnorm.rms_norm(out, norm_weight, 1e-6),
         lambda: rmsnorm.rms_norm_reference(out, norm_weight, 1e-6)),
        ("rope q", 2 * q.numel() * e, lambda: rope.apply_rope(q, positions, inv_freq),
         lambda: rope.apply_rope_reference(q, positions, inv_freq)),
        ("q norm_rope", 2 * q.numel() * e, lambda: norm_rope.norm_rope(q, positions, q_form),
         lambda: q_form.reference(q, positions)),
        ("kv entry", tokens * (MHC_HEAD_DIM * e + 584), lambda: norm_rope.norm_rope(kv, positions, entry),
         lambda: entry.reference(kv, positions)),
        ("pool csa", tokens * (8 * 512 * 2 * 4 + 584 + 8 * 8), lambda: gated_pool.pooled_entries(*pool_args),
         lambda: gated_pool.pooled_entries_reference(*pool_args)),
    ]  # fmt: skip


def _post_pre_reference(out, h, post, comb, fn, scale, base, weight, *pre_args):
    new = mhc.hc_post_reference(out, h, post, comb)
    x, post, comb = mhc.hc_pre_reference(new, fn, scale, base, *pre_args)
    return new, rmsnorm.rms_norm_reference(x, weight, pre_args[-1]), post, comb


def _max_diff(got, want) -> float:
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))


def bench_mhc(tokens: int, bandwidth: float, device: str = "cuda") -> list[dict]:
    """Per op: ds4's kernels and the torch reference, eager and graph-replayed, with inputs and weights rotated
    so that a call's bytes come from memory, not L2 (a decode step's 43 layers do not fit in it either)."""
    rows = []
    first = _mhc_ops(tokens, torch.Generator(device=device).manual_seed(0))
    for i, (name, moved, _, _) in enumerate(first):
        sets = [first] + [
            _mhc_ops(tokens, torch.Generator(device=device).manual_seed(s))
            for s in range(1, min(64, max(1, ROTATE_BYTES // moved)))
        ]
        calls = [ops[i] for ops in sets]

        def ours(calls=calls):
            for _, _, fn, _ in calls:
                fn()

        def theirs(calls=calls):
            for _, _, _, fn in calls:
                fn()

        n, roof_ms = len(calls), moved / bandwidth * 1e3
        ds4_ms, ds4_graph_ms = kernel_ms(ours) / n, graph_ms(ours) / n
        rows.append(
            {
                "op": name,
                "tokens": tokens,
                "bytes": moved,
                "torch_ms": kernel_ms(theirs) / n,
                "torch_graph_ms": graph_ms(theirs) / n,
                "ds4_ms": ds4_ms,
                "ds4_graph_ms": ds4_graph_ms,
                "roofline_ms": roof_ms,
                "roofline_fraction_graph": roof_ms / ds4_graph_ms,
                "max_abs_diff": _max_diff(calls[0][2](), calls[0][3]()),
            }
        )
        del sets, calls
    return rows


# (tokens a projection program, flattened channels a step, projection programs per SM) tried by --all-tiles
MHC_PROJECTION_SWEEP = [(t, k, waves) for t in (32, 64) for k in (64, 128) for waves in (1, 2, 4, 8)]


def sweep_mhc_projection(tokens: int, device: str = "cuda") -> list[dict]:
    """hc_pre's launches at Flash shapes with each projection tiling of MHC_PROJECTION_SWEEP (the collapse as
    planned), graph-replayed."""
    hc, d = MHC_HC, MHC_HIDDEN
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hc, d, device=device, generator=g).to(torch.bfloat16)
    fn = torch.randn((2 + hc) * hc, hc * d, device=device, generator=g) * (hc * d) ** -0.5
    scale, base = torch.rand(3, device=device, generator=g) + 0.5, torch.randn((2 + hc) * hc, device=device)
    dev = torch.device(device)
    planned = mhc.plan(tokens, hc * d, d, 32, 2, num_sms(dev), shared_memory_per_block(dev))
    runs = []
    for block_t, block_k, waves in MHC_PROJECTION_SWEEP:
        k_blocks = triton.cdiv(hc * d, block_k)
        splits = max(1, min(k_blocks, triton.cdiv(waves * num_sms(dev), triton.cdiv(tokens, block_t))))
        per_split = triton.cdiv(k_blocks, splits)
        launch = dataclasses.replace(
            planned, block_t=block_t, block_k=block_k, splits=triton.cdiv(k_blocks, per_split),
            k_blocks_per_split=per_split,
        )  # fmt: skip
        row = {"tokens": tokens, "block_t": block_t, "block_k": block_k, "waves": waves}
        try:
            row["ms"] = graph_ms(
                lambda: mhc.hc_pre_triton(h, fn, scale, base, hc, MHC_ITERS, 1e-6, 1e-6, launch=launch)
            )
        except Exception as error:  # a tiling that does not compile or fit is reported, not fatal
            row["error"] = str(error)[:160]
        runs.append(row)
    return runs


# hc_post+pre at decode sizes under --all-tiles: Sinkhorn iterations (20 = the model's; 1 = the serial tail without
# most of its steps), channels a program (None: the plan's) and channels a step of the last program's collapse
MHC_POST_PRE_SWEEP = [(i, b, c) for i in (20, 1) for b in (None, 64, 128) for c in (4096, 1024)]


def sweep_mhc_post_pre(tokens: int, device: str = "cuda") -> list[dict]:
    """The fused decode launch (hc_post, hc_pre, RMSNorm) at Flash shapes for each setting of MHC_POST_PRE_SWEEP,
    graph-replayed over 64 sets of inputs (their bytes from memory, as in a step)."""
    hc, d, mix = MHC_HC, MHC_HIDDEN, (2 + MHC_HC) * MHC_HC
    g = torch.Generator(device=device).manual_seed(0)
    sets = []
    for _ in range(64):
        h = torch.randn(tokens, hc, d, device=device, generator=g).to(torch.bfloat16)
        out = torch.randn(tokens, d, device=device, generator=g).to(torch.bfloat16)
        fn = torch.randn(mix, hc * d, device=device, generator=g) * (hc * d) ** -0.5
        scale, base = torch.rand(3, device=device, generator=g) + 0.5, torch.randn(mix, device=device, generator=g)
        _, post, comb = mhc.hc_pre_reference(h, fn, scale, base, hc, MHC_ITERS, 1e-6, 1e-6)
        sets.append((out, h, post, comb, fn, scale, base, torch.ones(d, device=device)))
    runs = []
    for iters, block_d, collapse_d in MHC_POST_PRE_SWEEP:

        def calls(iters=iters, block_d=block_d, collapse_d=collapse_d):
            for args in sets:
                mhc.hc_post_pre_triton(*args, hc, iters, 1e-6, 1e-6, block_d=block_d, collapse_d=collapse_d)

        row = {"tokens": tokens, "iters": iters, "block_d": block_d, "collapse_d": collapse_d}
        row["ms"] = graph_ms(calls) / len(sets)
        runs.append(row)
    return runs


def compiled_resources(kernels: dict) -> list[dict]:
    """Registers, spills and shared memory of every compiled variant of the given Triton kernels."""
    found = []
    for name, kernel in kernels.items():
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                meta = compiled.metadata
                found.append(
                    {
                        "kernel": name,
                        "warps": meta.num_warps,
                        "stages": meta.num_stages,
                        "regs": getattr(compiled, "n_regs", None),
                        "spills": getattr(compiled, "n_spills", None),
                        "shared": meta.shared,
                    }
                )
    return found


def _print_mhc(rows: list[dict]) -> None:
    print(
        f"{'mHC / norm':>10} {'T':>5} {'torch ms':>9} {'t.graph':>9} {'ds4 ms':>9} {'graph':>9} "
        f"{'x t.graph':>9} {'roof ms':>9} {'roof%g':>6} {'max diff':>9}"
    )
    for r in rows:
        print(
            f"{r['op']:>10} {r['tokens']:>5} {r['torch_ms']:9.4f} {r['torch_graph_ms']:9.4f} {r['ds4_ms']:9.4f} "
            f"{r['ds4_graph_ms']:9.4f} {r['torch_graph_ms'] / r['ds4_graph_ms']:9.2f} {r['roofline_ms']:9.4f} "
            f"{100 * r['roofline_fraction_graph']:6.1f} {r['max_abs_diff']:9.2e}"
        )


def _print_table(report: dict) -> None:
    gemm = f"  fp8 gemm {report['fp8_gemm_tflops']:.0f} TFLOP/s" if "fp8_gemm_tflops" in report else ""
    print(f"\n{report['device']}  copy {report['copy_bandwidth_tbps']:.2f} TB/s{gemm}")
    if "topk" in report:
        _print_topk(report)
    for case in report.get("topk_sweep", []):
        print(f"sweep {case['rows']} x {case['cols']}, {case['k']} (knobs: eager / graph ms):")
        for r in case["runs"]:
            print(f"   {r['variant']:42} {r['ms']:.4f} / {r['graph_ms']:.4f}{'' if r['exact'] else ' INEXACT'}")
    _print_indexer(report)
    if "mhc" in report:
        _print_mhc(report["mhc"])


def _print_topk(report: dict) -> None:
    print("top-k settings:", report["topk_settings"])
    print(
        f"{'top-k rows x cols, k':>26} {'ds4 ms':>8} {'graph':>8} {'torch':>8} {'t.graph':>8} {'x torch':>8} "
        f"{'x(graph)':>8} {'roof%':>6} {'roof%g':>6} exact"
    )
    for r in report["topk"]:
        print(
            f"{r['rows']:>10} x {r['cols']:>8}, {r['k']:>4} {r['ds4_ms']:8.4f} {r['ds4_graph_ms']:8.4f} "
            f"{r['torch_topk_ms']:8.4f} {r['torch_topk_graph_ms']:8.4f} {r['speedup_vs_torch']:8.2f} "
            f"{r['speedup_vs_torch_graph']:8.2f} "
            f"{100 * r['roofline_fraction']:6.1f} {100 * r['roofline_fraction_graph']:6.1f} {r['exact']}"
        )
    for name in ("topk_kernel_us_2048x65536", "topk_kernel_us_64x131072", "topk_kernel_us_1x1048576"):
        print(name, {key[:24]: round(us, 1) for key, us in report[name].items()})


def _print_indexer(report: dict) -> None:
    if "indexer_prefill" in report:
        p = report["indexer_prefill"]
        print(
            f"indexer prefill {p['queries']} x {p['keys']} (rel err {p['rel_err_vs_fp32']:.1e}), "
            f"indexer_topk k=512 {p['indexer_topk_ms_k512']:.2f} ms"
        )
        for t in p["tiles"]:
            if "ms" in t:
                print(
                    f"  tile {t['tile']}: {t['ms']:.3f} ms {t['tflops']:.0f} TFLOP/s "
                    f"{100 * t['gemm_fraction']:.1f}% of fp8 gemm, regs/spills {t['regs']}/{t['spills']}"
                )
            else:
                print(f"  tile {t['tile']}: {t['error']}")
    for d in report.get("indexer_decode", []):
        print(
            f"indexer decode {d['requests']} x {d['rows_per_request']} rows, {d['keys']} keys: {d['ms']:.3f} ms "
            f"(graph {d['graph_ms']:.3f}), {100 * d['bandwidth_fraction']:.1f}% "
            f"({100 * d['bandwidth_fraction_graph']:.1f}%) of copy bandwidth"
        )


GROUPS = ("topk", "indexer", "mhc")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench kernels", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="write the full report here")
    parser.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated kernel groups of {GROUPS}")
    parser.add_argument("--skip-indexer", action="store_true", help="leave out the indexer kernels")
    parser.add_argument(
        "--all-tiles", action="store_true", help="sweep top-k variants, indexer tiles and the mHC launches' settings"
    )
    args = parser.parse_args(argv)
    groups = set(args.only.split(","))
    if not groups <= set(GROUPS):
        parser.error(f"--only: unknown groups {sorted(groups - set(GROUPS))}; choose from {GROUPS}")
    if args.skip_indexer:
        groups.discard("indexer")
    if not torch.cuda.is_available():
        print("ds4 bench kernels needs a CUDA device", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth(torch.device("cuda"))
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_bandwidth_tbps": bandwidth / 1e12,
    }
    sections = []
    if "topk" in groups:
        report["topk_settings"] = dataclasses.asdict(topk_triton.settings_for(torch.device("cuda")))
        sections.append(("topk", lambda: [bench_topk(r, c, k, bandwidth) for r, c, k in TOPK_CASES]))
        sections += [
            (f"topk_kernel_us_{r}x{c}", lambda r=r, c=c: topk_kernel_breakdown(r, c, 512))
            for r, c in ((2048, 65536), (64, 131072), (1, 1048576))
        ]
        if args.all_tiles:
            cases = TOPK_SWEEP_CASES
            sections.append(
                (
                    "topk_sweep",
                    lambda: [{"rows": r, "cols": c, "k": k, "runs": sweep_topk(r, c, k)} for r, c, k in cases],
                )
            )
    if "indexer" in groups:
        gemm, kind = fp8_or_bf16_rate(torch.device("cuda"))
        if kind == "fp8":
            report["fp8_gemm_tflops"] = gemm / 1e12
        tiles = PREFILL_TILES if args.all_tiles else PREFILL_TILES[:1]
        sections.append(("indexer_prefill", lambda: bench_indexer_prefill(8192, 65536, gemm, tiles)))
        sections.append(
            (
                "indexer_decode",
                lambda: [bench_indexer_decode(64, 2, 65536, bandwidth), bench_indexer_decode(256, 1, 16384, bandwidth)],
            )
        )
    if "mhc" in groups:
        sections.append(("mhc", lambda: [row for t in MHC_TOKENS for row in bench_mhc(t, bandwidth)]))
        if args.all_tiles:
            sections.append(("mhc_projection_sweep", lambda: [r for t in (64, 8192) for r in sweep_mhc_projection(t)]))
            sections.append(("mhc_post_pre_sweep", lambda: [r for t in (1, 4) for r in sweep_mhc_post_pre(t)]))
    for name, run in sections:  # each section is printed and saved as it lands, so a timeout keeps the rest
        report[name] = run()
        print(name, json.dumps(report[name]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    report["compiled"] = compiled_resources(
        {
            "scan": topk_triton._scan_kernel,
            "count": topk_triton._count_kernel,
            "indexer": ix._indexer_logits_kernel,
            "mhc projection": mhc._projection_kernel,
            "mhc collapse": mhc._collapse_kernel,
            "mhc expand": mhc._expand_kernel,
            "rms_norm": rmsnorm._rms_norm_kernel,
            "rope": rope._rope_kernel,
            "norm_rope": norm_rope._norm_rope_kernel,
            "pooled_entries": gated_pool._pooled_entries_kernel,
        }
    )
    _print_table(report)
    for entry in report["compiled"]:
        print("compiled", entry)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
