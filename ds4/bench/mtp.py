"""`ds4 bench mtp`: the time of one speculative decode step per k (k 0: plain decode) and the tokens/s it implies.

On any config (`--config flash --load-format dummy --layers L`, or a checkpoint), loaded once with its MTP layer:
for each k of `--ks` an engine with `{"method": "mtp", "num_speculative_tokens": k}` (k 0: without) decodes
`--batch-sizes` requests of `--context` cached tokens through its real path (LLMEngine.step: the CUDA-graph
replays of the verify step and of the MTP layer's drafting, logits, verification, host work). Random weights
accept almost nothing, so every step verifies k drafts and yields about one token: the table gives the median
ms a step, the acceptance measured, and the tok/s per request that step time gives at each
`--acceptance-lengths` a (a / step time; only a <= k + 1), also with the step time extrapolated per layer to
the full model's layer count (head, MTP layer and host scale too: a pessimistic bound), next to the published
figures. The ceiling, measured in the same run: the bytes a verification must read (weights in checkpoint
precision, the experts its batch x (k + 1) tokens touch, each request's cache entries once; the MTP layer not
counted) over the copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ds4.bench import ceilings, roofline
from ds4.bench.driver import choose_model, shrink, step
from ds4.bench.model import _greedy, _published, _random_prompt, _rows
from ds4.bench.report import environment, float_list, int_list, progress, sync, write_json


def main(argv: list[str]) -> int:
    from ds4.engine.config import add_model_args

    parser = argparse.ArgumentParser(prog="ds4 bench mtp", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--ks", type=int_list, default=[0, 1, 2, 3], help="draft tokens per step, 0: no speculation")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8], help="decode batches, e.g. 1,8")
    parser.add_argument("--context", type=int, default=1024, help="tokens cached per request before decoding")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per k and batch size")
    parser.add_argument("--acceptance-lengths", type=float_list, default=[1.5, 2.0, 2.5], help="e.g. 1.5,2,2.5")
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="prefill tokens per engine step")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="cache bytes (CPU default: 1 GiB)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.ks) < 0 or min(args.batch_sizes) < 1 or args.context < 1 or args.steps < 1:
        parser.error("--ks must be >= 0; --batch-sizes, --context and --steps positive")
    result = run(args)
    print(table(result))
    write_json(args.json, result)
    return 0


def run(args: argparse.Namespace) -> dict:
    from ds4.engine.loader import load_model
    from ds4.kernels.indexer import ENTRY_BYTES
    from ds4.model.cache import kv_entry_size, packed_index_keys

    choice = choose_model(args)
    device, dtype, model_dir, cfg, full_cfg = choice.device, choice.dtype, choice.model_dir, choice.cfg, choice.full_cfg
    progress("measuring the ceiling: copy bandwidth")
    copy_rate = ceilings.copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (16 << 20))
    progress(f"building the model ({args.load_format} weights, {cfg.num_hidden_layers} layers + MTP) on {device}")
    model = load_model(
        cfg,
        model_dir,
        args.load_format,
        device=device,
        dtype=dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed,
        with_mtp=True,
    )
    kv_cache_dtype = model.kv_cache_dtype  # what "auto" resolved to
    kv_entry = kv_entry_size(cfg, kv_cache_dtype, dtype)
    index_entry = ENTRY_BYTES if packed_index_keys(cfg, kv_cache_dtype) else cfg.index_head_dim * dtype.itemsize
    rows = []
    for k in args.ks:
        for row in _steps(model, k, args, random.Random(args.seed)):
            parts = verify_bytes(cfg, row["batch"], k, row["context"], kv_entry, index_entry)
            row["roofline_ms"] = sum(parts.values()) / copy_rate * 1e3
            rows.append(row)
    scale = full_cfg.num_hidden_layers / cfg.num_hidden_layers
    for row in rows:
        ms, full_ms = row["ms_per_step"], row["ms_per_step"] * scale
        reachable = [a for a in args.acceptance_lengths if a <= row["k"] + 1] if row["k"] else []
        row["tokens_per_s_per_request"] = row["tokens_per_step"] * 1e3 / ms
        row["implied_tokens_per_s_per_request"] = {str(a): a * 1e3 / ms for a in reachable}
        row["full_model_ms_per_step"] = full_ms
        row["full_model_tokens_per_s_per_request"] = row["tokens_per_step"] * 1e3 / full_ms
        row["full_model_implied_tokens_per_s_per_request"] = {str(a): a * 1e3 / full_ms for a in reachable}
    del model
    gc.collect()
    return {
        "benchmark": "mtp",
        "config": str(args.config or args.model or "tiny (built-in)"),
        "load_format": args.load_format,
        "layers": cfg.num_hidden_layers,
        "full_layers": full_cfg.num_hidden_layers,
        "context": args.context,
        "dtype": str(dtype),
        "kv_cache_dtype": kv_cache_dtype,
        "cuda_graphs": device.type == "cuda" and not args.enforce_eager,
        "acceptance_lengths": args.acceptance_lengths,
        "ceilings": {"copy_bytes_per_s": copy_rate},
        "steps": rows,
        "published": _published(args, full_cfg),
        **environment(device),
    }


def verify_bytes(cfg, batch: int, k: int, context: int, kv_entry: int, index_entry: int) -> dict[str, float]:
    """Bytes a verification of k drafts must read: roofline.decode_bytes for batch x (k + 1) tokens, except that
    each request's cache entries are read once."""
    tokens = roofline.decode_bytes(cfg, batch * (k + 1), context, kv_entry, index_entry)
    requests = roofline.decode_bytes(cfg, batch, context, kv_entry, index_entry)
    return {**tokens, "kv_cache": requests["kv_cache"], "index_keys": requests["index_keys"]}


def _steps(model, k: int, args, rng: random.Random) -> list[dict]:
    """An engine drafting k tokens a step: prefill max(batch) requests, then time steps at each batch size."""
    from ds4.engine.config import EngineConfig
    from ds4.engine.engine import LLMEngine

    batches = sorted(set(args.batch_sizes), reverse=True)
    max_batch = batches[0]
    prefill_steps = math.ceil(max_batch * args.context / args.prefill_chunk) + 1
    # Each step yields 1 to k + 1 tokens.
    max_tokens = (prefill_steps + len(batches) * (args.steps + 3) + 8) * (k + 1)
    config = EngineConfig(
        max_num_seqs=max_batch,
        max_num_batched_tokens=args.prefill_chunk + max_batch * (k + 1),
        long_prefill_token_threshold=args.prefill_chunk,
        max_num_partial_prefills=max_batch,
        max_long_partial_prefills=max_batch,
        max_model_len=args.context + max_tokens + k + 1,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager,
        max_cuda_graph_batch_size=max_batch,
        enable_prefix_caching=False,  # random prompts share no prefix
        speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
    )
    progress(f"k = {k}: starting the engine (cache plan, CUDA-graph capture)")
    start = time.perf_counter()
    engine = LLMEngine(model, config, tokenizer=None, seed=args.seed)
    startup_s = time.perf_counter() - start
    ids = [f"k{k}-{i}" for i in range(max_batch)]
    vocab = model.cfg.vocab_size
    for request_id in ids:
        engine.add_request(request_id, _random_prompt(rng, args.context, vocab), _greedy(max_tokens))
    started: set[str] = set()
    while len(started) < len(ids):
        started |= {out.request_id for out in step(engine)}
    rows = []
    for batch in batches:
        ids = shrink(engine, ids, batch)
        before = engine.stats()
        times = []
        for _ in tqdm(range(args.steps), desc=f"k {k}, batch {batch}", file=sys.stderr):
            sync(engine.device)
            t0 = time.perf_counter()
            step(engine)  # returns after verification, which waits for the step's tokens
            times.append((time.perf_counter() - t0) * 1e3)
        after = engine.stats()
        if any(i not in engine.requests for i in ids):
            raise SystemExit(f"k {k}, batch {batch}: a request finished early (max_tokens {max_tokens} too small)")
        times.sort()
        drafts = after.spec_decode.num_drafts - before.spec_decode.num_drafts if k else 0
        accepted = after.spec_decode.num_accepted_tokens - before.spec_decode.num_accepted_tokens if k else 0
        rows.append(
            {
                "k": k,
                "batch": batch,
                "context": min(engine.requests[i].num_tokens for i in ids),
                "ms_per_step": times[len(times) // 2],
                "tokens_per_step": (after.generation_tokens - before.generation_tokens) / (args.steps * batch),
                "measured_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
                "engine_startup_s": startup_s,
            }
        )
    del engine
    gc.collect()
    if model.embed.weight.is_cuda:
        torch.cuda.empty_cache()
    return rows


def table(result: dict) -> str:
    lengths, full = result["acceptance_lengths"], result["full_layers"]
    header = ("k", "batch", "context", "ms/step", "roofline ms", "AL", "tok/s/req")
    header += tuple(f"@AL {a:g}" for a in lengths)
    header += (f"{full}L ms/step", f"{full}L tok/s/req") + tuple(f"{full}L @AL {a:g}" for a in lengths)
    rows = []
    for r in result["steps"]:

        def at(rates: dict) -> tuple[str, ...]:
            return tuple(f"{rates[str(a)]:.0f}" if str(a) in rates else "-" for a in lengths)

        rows.append(
            (r["k"], r["batch"], r["context"], f"{r['ms_per_step']:.2f}", f"{r['roofline_ms']:.2f}")
            + (f"{r['measured_acceptance_length']:.2f}", f"{r['tokens_per_s_per_request']:.0f}")
            + at(r["implied_tokens_per_s_per_request"])
            + (f"{r['full_model_ms_per_step']:.2f}", f"{r['full_model_tokens_per_s_per_request']:.0f}")
            + at(r["full_model_implied_tokens_per_s_per_request"])
        )
    lines = [
        f"ds4 bench mtp: {result['config']}, {result['layers']} of {result['full_layers']} layers + MTP, "
        f"{result['load_format']} weights, {result['dtype']}, "
        f"{'CUDA graphs' if result['cuda_graphs'] else 'eager'}, on {result['device']} ({result['commit']})",
        f"ceiling (this run): copy {result['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write)",
        "AL: acceptance length measured (tokens a step); tok/s/req: measured; @AL a: a / step time "
        f"('-': a > k + 1); {full}L: the step time scaled per layer to {full} layers",
        "",
        _rows(header, rows),
    ]
    if result["published"]:
        lines += ["", "published (shared/docs/anchors.md):"]
        lines += [
            f"  {p['what']}: {p['value']:g} {p['unit']} ({p['setup']}; {p['source']})" for p in result["published"]
        ]
    return "\n".join(lines)
