"""`ds4 bench model`: the whole model through the engine, each figure next to its roofline measured in the same run.

On any config (`--config flash|pro|DIR` with `--load-format dummy`, or a checkpoint), cut to `--layers L`:
  - resident weight GB, total and per layer, next to the checkpoint's bytes for those layers (stored specs);
  - decode ms/step at each `--batch-sizes` with `--context` tokens cached per request, through the engine's
    real path (LLMEngine.step: schedule, CUDA-graph replay, logits, sampling; with async decode the next step
    launched before this one's tokens are read, so steps are timed back to back and a step's time is the
    interval between the steps returned): the requests are prefilled first, then the batch shrinks by aborting
    requests, largest first;
  - prefill tok/s of one prompt of each `--prefill-lengths` (chunks of `--prefill-chunk` tokens);
  - peak device memory; finite logits asserted on every step but the timed and profiled decode steps (whose times
    would hold the check's launches): every prefill and an eager decode step at each batch size.
Rooflines (ds4.bench.roofline): decode = the bytes a step must read over the copy bandwidth; prefill = the FLOPs by
kind over the GEMM rate of that kind (FP8 linears with act_quant'ed inputs and the indexer fp8; bf16 linears, wo_a
(no act_quant in the reference), experts and attention bf16: Hopper has no FP4 tensor cores). The ratio is measured
/ roofline. Decode steps at the smallest and the largest batch (run eagerly) and one prefill (the shortest) are
profiled and summarised by kernel family: its time, the kernels it launched (CPU: ops; many small kernels make a
family launch-bound at decode), its largest kernels by name (printed for families of 5% or more) and its own
roofline where one is counted. "GPU ms" is the decode graph's replay and the logits alone: the step without the
engine's host work (what async decode's overlap of that work with the GPU aims at). The time per layer is
extrapolated to the full model and printed next to published figures. `--compare-transformers` runs transformers'
DeepseekV4 (bf16, eager) on the same shape. `--nsight` runs one more eager decode step a batch size inside a CUDA
profiler range, for Nsight Compute (tools/ncu_decode.sh). `--tensor-parallel-size N [--enable-expert-parallel]` runs
the engine on N ranks (one GPU each; CPU: processes); every decode and prefill row then also gives the bytes rank
0's collectives moved per step, by kind (counted; for decode steps replayed from CUDA graphs, which run no Python to
count, from ds4.distributed.traffic), and the bytes of the step messages rank 0 sent (weights and memory are rank
0's; no profile: it would run one rank).
Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from ds4.bench import ceilings, roofline
from ds4.bench.driver import choose_model, shrink, step, timed_steps
from ds4.bench.profile import FAMILIES, profile_families
from ds4.bench.report import environment, int_list, progress, sync, write_json
from ds4.kernels import _device as device_facts
from ds4.model import side_stream

GB = 1e9
LARGEST_SHOWN_SHARE = 0.05  # families of at least this share of a profiled step list their largest kernels
LARGEST_SHOWN = 4  # kernels a family lists in the table

# Published figures (shared/docs/anchors.md), by model: what, value, unit, setup, source.
PUBLISHED = {
    "flash": [
        ("decode TPOT, concurrency 1", 3.28, "ms", "4x H200, SGLang 0.5.15, TP4, EAGLE", "SGLang DSv4 benchmark docs"),
        ("decode, batch 1, 30K prompt", 266, "tok/s", "4x H200, SGLang, EAGLE (AL ~2.5)", "LMSYS blog, 2026-04-25"),
        ("decode, concurrency 1", 169, "tok/s", "4x B200, vLLM 0.20, TP4+EP, MTP n=2", "vLLM PR #41044"),
        ("prefill", 10000, "tok/s", "2x RTX PRO 6000, vLLM SM120 branch, TP2", "user report, 2026-06"),
        ("prefill, one 650K prompt", 2870, "tok/s", "4x RTX PRO 6000, SGLang 0.5.16", "SGLang issue #33422"),
        ("checkpoint", 160, "GB", "FP8 linears + MXFP4 experts, 46 shards", "anchors.md (hub)"),
    ],
    "pro": [
        ("decode, batch 1, 30K prompt", 199, "tok/s", "8x B200, SGLang, EAGLE (AL ~2.5)", "LMSYS blog, 2026-04-25"),
        ("checkpoint", 865, "GB", "FP8 linears + MXFP4 experts", "anchors.md (hub)"),
    ],
}


def main(argv: list[str]) -> int:
    from ds4.engine.config import add_model_args

    parser = argparse.ArgumentParser(prog="ds4 bench model", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--context", type=int, default=4096, help="tokens cached per request before decoding")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32, 64], help="decode batches, e.g. 1,8,32,64")
    parser.add_argument("--prefill-lengths", type=int_list, default=[8192, 65536], help="prompt lengths, e.g. 8192")
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="prefill tokens per engine step")
    parser.add_argument("--decode-steps", type=int, default=10, help="timed decode steps per batch size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="cache bytes (CPU default: 1 GiB)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model is split across")
    parser.add_argument(
        "--enable-expert-parallel", action="store_true", help="whole routed experts per rank (with N > 1)"
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler summaries")
    parser.add_argument(
        "--serial",
        action="store_true",
        help="run the side stream's work (the shared expert, a layer's compressor) on the main stream: the step "
        "without those overlaps, to time what they give",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="every kernel starts after the one before it ends (no programmatic dependent launch, sm_90+): the step "
        "without those overlaps, to time what they give",
    )
    parser.add_argument(
        "--nsight",
        action="store_true",
        help="also run one eager decode step a batch size between cudaProfilerStart and Stop, for Nsight Compute "
        "(`ncu --profile-from-start off`, tools/ncu_decode.sh)",
    )
    parser.add_argument("--compare-transformers", action="store_true", help="also time transformers' DeepseekV4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot", type=Path, default=None, help="write step time against batch size here (SVG)")
    args = parser.parse_args(argv)
    if args.serial:  # before the model is built (its side stream reads it once); ranks' processes inherit it
        os.environ["DS4_SIDE_STREAM"] = "0"
        side_stream.OVERLAP = False
    if args.no_pdl:  # read at launch; ranks' processes inherit it
        os.environ["DS4_PDL"] = "0"
        device_facts.DEPENDENT_LAUNCH = False
    if min(args.batch_sizes) < 1 or min(args.prefill_lengths) < 1 or args.context < 1 or args.decode_steps < 1:
        parser.error("--batch-sizes, --prefill-lengths, --context and --decode-steps must be positive")
    result = run(args)
    print(table(result))
    _write(args, result)
    if args.compare_transformers:
        cfg = choose_model(args).cfg
        result["transformers"] = _transformers(cfg, args, torch.device(result["device_type"]), random.Random(args.seed))
        print(_transformers_lines(result["transformers"]))
        _write(args, result)
    return 0


def _write(args: argparse.Namespace, result: dict) -> None:
    write_json(args.json, result)
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        args.plot.write_text(plot_svg(result))
        print(f"wrote {args.plot}")


def run(args: argparse.Namespace) -> dict:
    from ds4.engine.config import EngineConfig
    from ds4.engine.engine import LLMEngine
    from ds4.engine.loader import ModelSource
    from ds4.engine.workers import start_ranks
    from ds4.kernels.indexer import ENTRY_BYTES
    from ds4.model.cache import kv_entry_size, packed_index_keys

    choice = choose_model(args)
    device, dtype, model_dir, cfg, full_cfg = choice.device, choice.dtype, choice.model_dir, choice.cfg, choice.full_cfg
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    progress("measuring ceilings: copy bandwidth, bf16 and fp8 GEMM rates")
    big = device.type == "cuda"
    rates = {
        "copy_bytes_per_s": ceilings.copy_bandwidth(device, (1 << 30) if big else (16 << 20)),
        "bf16_flop_per_s": ceilings.gemm_rate(device, torch.bfloat16, 8192 if big else 256),
        "fp8_flop_per_s": ceilings.gemm_rate(device, torch.float8_e4m3fn, 8192 if big else 256),
    }

    max_batch = max(args.batch_sizes)
    # Every request decodes during the prefill steps of the others, then through each batch size's steps.
    prefill_steps = math.ceil(max_batch * args.context / args.prefill_chunk) + 1
    max_tokens = prefill_steps + len(args.batch_sizes) * (args.decode_steps + 3) + 8
    engine_config = EngineConfig(
        max_num_seqs=max_batch,
        max_num_batched_tokens=args.prefill_chunk + max_batch,
        long_prefill_token_threshold=args.prefill_chunk,
        max_num_partial_prefills=max_batch,
        max_long_partial_prefills=max_batch,
        max_model_len=max(args.context + max_tokens + 1, max(args.prefill_lengths) + 1),
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager,
        max_cuda_graph_batch_size=max_batch,
        # Random prompts share no prefix: the cache's page-end snapshots would only cost memory and copies.
        enable_prefix_caching=False,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    source = ModelSource(cfg, model_dir, args.load_format, dtype, args.kv_cache_dtype, seed=args.seed)
    ranks = start_ranks(cfg, engine_config, source, device, None)
    if ranks is not None:
        device = ranks.placement.device(device.type)
        args.no_profile = True
    progress(f"building the model ({args.load_format} weights, {cfg.num_hidden_layers} layers) on {device}")
    start = time.perf_counter()
    model = source.load(device, ranks.parallel if ranks is not None else None)
    load_s = time.perf_counter() - start
    finite = _FiniteLogits(model)
    progress("starting the engine (cache plan, CUDA-graph capture)")
    with finite.paused():  # the decode graphs compute logits: a check captured in them would run in timed steps
        engine = LLMEngine(model, engine_config, tokenizer=None, seed=args.seed, workers=ranks)
    needed = max_batch * (args.context + max_tokens)
    if engine.allocator.capacity_tokens < needed:
        raise SystemExit(
            f"the cache holds {engine.allocator.capacity_tokens} tokens; {max_batch} requests of "
            f"{args.context + max_tokens} need {needed}: lower --context or --batch-sizes, or give more memory"
        )

    item = dtype.itemsize
    kv_entry = kv_entry_size(cfg, model.kv_cache_dtype, dtype)
    index_entry = ENTRY_BYTES if packed_index_keys(cfg, model.kv_cache_dtype) else cfg.index_head_dim * item
    rng = random.Random(args.seed)
    decode = _decode(engine, args, cfg, rates, kv_entry, index_entry, rng, max_tokens, finite)
    prefill = _prefill(engine, args, cfg, rates, rng)
    engine.close()
    if not finite.ok():
        raise SystemExit("non-finite logits: the dummy weights' scaling (or the model) is broken")

    weights = _weights(model, cfg)
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    result = {
        "benchmark": "model",
        "config": str(args.config or args.model or "tiny (built-in)"),
        "load_format": args.load_format,
        "layers": cfg.num_hidden_layers,
        "full_layers": full_cfg.num_hidden_layers,
        "layer_kinds": list(cfg.layer_kinds[: cfg.num_hidden_layers]),
        "tensor_parallel_size": args.tensor_parallel_size,
        "expert_parallel": args.enable_expert_parallel,
        "side_stream": side_stream.OVERLAP,
        "dependent_launch": device_facts.DEPENDENT_LAUNCH,
        "context": args.context,
        "dtype": str(dtype),
        "kv_cache_dtype": model.kv_cache_dtype,
        "kv_entry_bytes": kv_entry,
        "index_entry_bytes": index_entry,
        "load_s": load_s,
        "ceilings": rates,
        "weights": weights,
        "decode": decode,
        "prefill": prefill,
        "peak_memory_gb": peak,
        "extrapolated": _extrapolate(cfg, full_cfg, decode, prefill),
        "published": _published(args, full_cfg),
        "device_type": device.type,
        **environment(device),
    }
    del engine, model, finite
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


class _FiniteLogits:
    """Wraps model.compute_logits to AND up, on the device (no sync per step), whether every logit was finite,
    except while paused."""

    def __init__(self, model):
        self.flag = torch.ones((), dtype=torch.bool, device=model.embed.weight.device)
        self.checking = True
        compute = model.compute_logits

        def checked(hidden):
            logits = compute(hidden)
            if self.checking:
                self.flag &= torch.isfinite(logits).all()
            return logits

        model.compute_logits = checked

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.checking = False
        try:
            yield
        finally:
            self.checking = True

    def ok(self) -> bool:
        return bool(self.flag)


class _Traffic:
    """What rank 0's collectives and step messages moved since it was made (nothing with one rank)."""

    def __init__(self, engine):
        self.ranks = engine.workers
        if self.ranks is not None:
            self.ranks.parallel.reset_counters()
            self.sent = self.ranks.channel.bytes_sent

    def per_step(self, steps: int, replayed=None) -> dict:
        """`replayed`: the Traffic of a step that replays a CUDA graph (no Python runs to count it), from the
        config; it then stands for the counters."""
        if self.ranks is None:
            return {}
        moved = {kind: n / steps for kind, n in self.ranks.parallel.bytes_moved.items()}
        return {
            "collective_bytes_per_step": dict(replayed.payload) if replayed is not None else moved,
            "collective_bytes_from": "ds4.distributed.traffic" if replayed is not None else "counters",
            "step_message_bytes_per_step": (self.ranks.channel.bytes_sent - self.sent) / steps,
        }


def _replayed_traffic(engine, args, cfg, batch: int):
    """The decode step's traffic from the config when its steps replay CUDA graphs, else None."""
    if engine.workers is None or engine.runner.graphs is None:
        return None
    from ds4.distributed.parallel import ParallelConfig
    from ds4.distributed.traffic import decode_step_traffic

    layout = ParallelConfig(args.tensor_parallel_size, args.enable_expert_parallel)
    return decode_step_traffic(cfg, layout, batch, act_bytes=engine.model.dtype.itemsize)


def _weights(model, cfg) -> dict:
    """Resident bytes of the model (total, per layer) next to the checkpoint's bytes for those layers."""

    def nbytes(module) -> int:
        tensors = list(module.parameters()) + list(module.buffers())
        return sum(t.numel() * t.element_size() for t in tensors)

    ck = roofline.checkpoint_bytes(cfg)
    per_layer = [nbytes(layer) for layer in model.layers]
    total = nbytes(model)
    return {
        "resident_gb": total / GB,
        "checkpoint_gb": ck.total / GB,
        "resident_per_layer_gb": [b / GB for b in per_layer],
        "checkpoint_per_layer_gb": [b / GB for b in ck.layers],
        "resident_outside_layers_gb": (total - sum(per_layer)) / GB,
        "checkpoint_outside_layers_gb": ck.top / GB,
        "ratio": total / ck.total,
    }


def _random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(length)]


def _greedy(max_tokens: int):
    from ds4.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _decode(engine, args, cfg, rates, kv_entry, index_entry, rng, max_tokens, finite) -> list[dict]:
    """Prefill max(batch) requests of --context tokens, then time decode steps at each batch size, largest first
    (`finite` paused while they are timed or profiled)."""
    batches = sorted(set(args.batch_sizes), reverse=True)
    ids = [f"decode-{i}" for i in range(batches[0])]
    for request_id in ids:
        engine.add_request(request_id, _random_prompt(rng, args.context, cfg.vocab_size), _greedy(max_tokens))
    with tqdm(total=len(ids) * args.context, desc="prefill the decode batch", unit="tok", file=sys.stderr) as bar:
        started = set()
        while len(started) < len(ids):
            before = engine.stats().prompt_tokens
            for out in step(engine):
                started.add(out.request_id)
            bar.update(engine.stats().prompt_tokens - before)
    rows = []
    for batch in batches:
        ids = shrink(engine, ids, batch)
        traffic = _Traffic(engine)
        # Back to back (async decode launches each step before the previous one's tokens are read): a step's
        # time is the interval between the steps the engine returns.
        with finite.paused(), tqdm(total=args.decode_steps, desc=f"decode batch {batch}", file=sys.stderr) as bar:
            times = timed_steps(engine, args.decode_steps, lambda: bar.update(1))
        times.sort()
        ms = times[len(times) // 2]
        if any(i not in engine.requests for i in ids):
            raise SystemExit(f"decode batch {batch}: a request finished early (max_tokens {max_tokens} too small)")
        context = min(engine.requests[i].num_tokens for i in ids)
        with finite.paused():
            gpu_ms = _replay_ms(engine, ids)
        parts = roofline.decode_bytes(cfg, batch, context, kv_entry, index_entry)
        roof_ms = sum(parts.values()) / rates["copy_bytes_per_s"] * 1e3
        row = {
            "batch": batch,
            "context": context,
            "ms_per_step": ms,
            "tokens_per_s": batch / ms * 1e3,
            "bytes": parts,
            "roofline_ms": roof_ms,
            "ratio": ms / roof_ms,
            "gpu_ms_per_step": gpu_ms,
            "gpu_ratio": gpu_ms / roof_ms if gpu_ms is not None else None,
            "experts_touched_per_layer": roofline.expected_experts_touched(cfg, batch),
            **traffic.per_step(args.decode_steps, _replayed_traffic(engine, args, cfg, batch)),
        }
        row["routing"] = routing_balance(engine.model, lambda: _eager_step(engine))
        if args.nsight and engine.device.type == "cuda":
            with _graphs_eager(engine):
                torch.cuda.profiler.start()
                step(engine)
                torch.cuda.synchronize(engine.device)
                torch.cuda.profiler.stop()
        if not args.no_profile and batch in (batches[0], batches[-1]):
            progress(f"profiling one decode step at batch {batch} (eager)")
            by_kernel, launches, kernel_launches = defaultdict(Counter), Counter(), defaultdict(Counter)
            with finite.paused():  # the check's kernels are the benchmark's, not the step's
                families = _eager_profile(engine, lambda: step(engine), by_kernel, launches, kernel_launches)
            roof = {name: b / rates["copy_bytes_per_s"] * 1e3 for name, b in _decode_family_bytes(parts).items()}
            row["profile"] = _with_rooflines(families, launches, roof)
            row["profile_kernels"] = _largest(by_kernel, kernel_launches)
        rows.append(row)
    for request_id in ids:
        engine.abort(request_id)
    step(engine)
    return sorted(rows, key=lambda r: r["batch"])


def _replay_ms(engine, ids: list[str]) -> float | None:
    """The GPU's part of a decode step: the median ms of replaying the graph the last step ran (its forward and
    logits), alone (no scheduling, batch building or sampling; the graph's inputs are the last step's, so it
    rewrites the same cache rows with the same values). None without CUDA graphs or on more than one rank."""
    graphs = engine.runner.graphs
    if graphs is None or graphs.eager or engine.workers is not None:
        return None
    key = graphs.key([1] * len(ids), max(len(engine.requests[i].page_table) for i in ids))
    if key not in graphs.graphs:
        return None

    return ceilings.kernel_ms(graphs.graphs[key].replay)  # the forward and every row's logits


def _eager_profile(
    engine, step, by_kernel: defaultdict[str, Counter], launches: Counter, kernel_launches: defaultdict[str, Counter]
) -> dict:
    """Profile one engine step with the decode graph's batch run eagerly (the same padded decode_only batch)."""
    with _graphs_eager(engine):
        return profile_families(engine.model, step, engine.device, by_kernel, launches, kernel_launches)


def _eager_step(engine) -> None:
    with _graphs_eager(engine):
        step(engine)


@contextlib.contextmanager
def _graphs_eager(engine) -> Iterator[None]:
    """The engine's decode steps run their graphs' batches eagerly (each kernel a launch of its own)."""
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.eager = True
    try:
        yield
    finally:
        if graphs is not None:
            graphs.eager = False


def _largest(by_kernel: defaultdict[str, Counter], kernel_launches: defaultdict[str, Counter]) -> dict[str, dict]:
    """Each family's kernels by name (ms and launches), largest first: where a family's time goes, for the next
    change to aim at (the JSON keeps them all, the table LARGEST_SHOWN of each)."""
    return {
        family: {
            name[:100]: {"ms": ms, "launches": kernel_launches[family][name]} for name, ms in kernels.most_common()
        }
        for family, kernels in by_kernel.items()
    }


def _decode_family_bytes(parts: dict) -> dict:
    return {
        "GEMMs": parts["dense"] + parts["head"],
        "MoE": parts["experts"],
        "attention": parts["kv_cache"],
        "indexer": parts["index_keys"],
    }


def _with_rooflines(families: dict, launches: Counter, roofline_ms: dict) -> dict:
    """Per family: ms, share of the profiled time, kernels launched and, where counted, roofline ms and the
    ratio."""
    total = families["total"] or 1.0
    out = {}
    for name in (*FAMILIES, "total"):
        kernels = sum(launches.values()) if name == "total" else launches[name]
        entry = {"ms": families[name], "share": families[name] / total, "kernels": kernels}
        if roofline_ms.get(name):
            entry["roofline_ms"] = roofline_ms[name]
            entry["ratio"] = families[name] / entry["roofline_ms"]
        out[name] = entry
    return out


def _prefill_rates(rates: dict) -> dict:
    bf16 = rates["bf16_flop_per_s"]
    fp8 = rates["fp8_flop_per_s"] or bf16
    return {"dense": fp8, "dense_bf16": bf16, "experts": bf16, "attention": bf16, "indexer": fp8}


def _prefill(engine, args, cfg, rates, rng) -> list[dict]:
    """Time the prefill of one prompt of each length (after a warm-up prompt of the longest); profile the shortest."""
    per_kind = _prefill_rates(rates)

    def prefill(length: int, name: str) -> tuple[float, dict]:
        """Seconds, and the collectives' bytes per step of the prompt's steps."""
        engine.add_request(name, _random_prompt(rng, length, cfg.vocab_size), _greedy(1))
        sync(engine.device)
        traffic = _Traffic(engine)
        steps = 0
        t0 = time.perf_counter()
        with tqdm(total=length, desc=f"prefill {length}", unit="tok", file=sys.stderr) as bar:
            while engine.has_unfinished_requests():
                before = engine.stats().prompt_tokens
                step(engine)
                steps += 1
                bar.update(engine.stats().prompt_tokens - before)
        return time.perf_counter() - t0, {"steps": steps, **traffic.per_step(steps)}

    # The longest prompt first: its chunks reach every context length the timed prompts do, so kernels compiled
    # for a new context size are not in the times.
    warm_up = max(args.prefill_lengths)
    seconds, _ = prefill(warm_up, "prefill-warm-up")
    progress(f"warm-up prompt of {warm_up} tokens: {seconds:.1f} s (kernels compiled on first use included)")
    rows = []
    for length in sorted(set(args.prefill_lengths)):
        seconds, traffic = prefill(length, f"prefill-{length}")
        flops = roofline.prefill_flops(cfg, length)
        roof_s = sum(flops[k] / per_kind[k] for k in flops)
        rows.append(
            {
                "tokens": length,
                "seconds": seconds,
                "tokens_per_s": length / seconds,
                "flops": flops,
                "roofline_s": roof_s,
                "ratio": seconds / roof_s,
                **traffic,
            }
        )
    if not args.no_profile:
        length = min(args.prefill_lengths)
        progress(f"profiling the prefill of {length} tokens")
        by_kernel, launches, kernel_launches = defaultdict(Counter), Counter(), defaultdict(Counter)
        families = profile_families(
            engine.model,
            lambda: prefill(length, "prefill-profiled"),
            engine.device,
            by_kernel,
            launches,
            kernel_launches,
        )
        flops = roofline.prefill_flops(cfg, length)
        family_of = {"dense": "GEMMs", "dense_bf16": "GEMMs", "experts": "MoE", "attention": "attention"}
        family_of["indexer"] = "indexer"
        roof = Counter()
        for kind, f in flops.items():
            roof[family_of[kind]] += f / per_kind[kind] * 1e3
        rows[0]["profile"] = _with_rooflines(families, launches, roof)
        rows[0]["profile_kernels"] = _largest(by_kernel, kernel_launches)
    length = min(args.prefill_lengths)
    rows[0]["routing"] = routing_balance(engine.model, lambda: prefill(length, "prefill-routing"))
    return rows


def routing_balance(model, run) -> dict | None:
    """The score layers' routing over what `run` computes (a prompt's prefill, an eager decode step): rows an
    expert (token, slot pairs), their largest against the mean, their spread against a balanced (uniform
    multinomial) draw's, and the experts touched (a layer's mean). The routed experts' time follows it: the
    grouped GEMM's row tiles fill less the more a few experts take, and a decode step reads the experts touched.
    None where the model is not in this process (ranks' workers), holds only some experts (expert parallel: the
    others' slots route to expert 0) or routes by hash only."""
    from ds4.model.moe import Gate

    if not isinstance(model, torch.nn.Module):
        return None
    gates = [m for m in model.modules() if isinstance(m, Gate) and m.tid2eid is None]
    counts = {id(g): None for g in gates}
    some_experts = []

    def record(gate, inputs, routes):
        if len(inputs) > 2 and inputs[2] is not None:  # this rank's experts only
            some_experts.append(gate)
            return
        found = torch.bincount(routes.indices.flatten(), minlength=gate.weight.shape[0])
        counts[id(gate)] = found if counts[id(gate)] is None else counts[id(gate)] + found

    hooks = [g.register_forward_hook(record) for g in gates]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    layers = [c.double().cpu() for c in counts.values() if c is not None]
    if some_experts or not layers:
        return None
    rows = torch.stack(layers)  # [score layers, experts]
    experts, mean = rows.shape[1], rows.mean(dim=1)
    balanced_std = (rows.sum(dim=1) * (1 / experts) * (1 - 1 / experts)).sqrt()
    return {
        "score_layers": rows.shape[0],
        "rows_per_expert": mean.mean().item(),
        "max_over_mean": (rows.max(dim=1).values / mean).mean().item(),
        "spread_over_balanced": (rows.std(dim=1) / balanced_std).mean().item(),
        "experts_touched": (rows > 0).sum(dim=1).double().mean().item(),
    }


def _extrapolate(cfg, full_cfg, decode: list[dict], prefill: list[dict]) -> dict:
    """Per-layer time scaled to the full model's layer count (head and host overhead scale too: an upper bound)."""
    scale = full_cfg.num_hidden_layers / cfg.num_hidden_layers
    ck = roofline.checkpoint_bytes(full_cfg)
    return {
        "layers": full_cfg.num_hidden_layers,
        "checkpoint_gb": ck.total / GB,
        "decode_ms_per_step": {r["batch"]: r["ms_per_step"] * scale for r in decode},
        "decode_tokens_per_s_per_user": {r["batch"]: 1e3 / (r["ms_per_step"] * scale) for r in decode},
        "prefill_tokens_per_s": {r["tokens"]: r["tokens_per_s"] / scale for r in prefill},
    }


def _published(args, full_cfg) -> list[dict]:
    from ds4.config import load_config
    from ds4.configs import SHIPPED, config_dict

    for name in SHIPPED:
        if full_cfg == load_config(config_dict(name)):
            fields = ("what", "value", "unit", "setup", "source")
            return [{"model": name, **dict(zip(fields, entry))} for entry in PUBLISHED[name]]
    return []


def _transformers(cfg, args, device: torch.device, rng: random.Random) -> dict:
    """transformers' DeepseekV4ForCausalLM (bf16, eager, its own random init) on the same shape, when it fits."""
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as e:
        return {"skipped": f"transformers with DeepseekV4 is not importable: {e}"}
    from ds4.checkpoint.weights_spec import expected_parameter_shapes

    params = sum(torch.Size(s.shape).numel() for s in expected_parameter_shapes(cfg).values())
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if 2 * params > 0.8 * free:
            return {"skipped": f"{2 * params / GB:.1f} GB of bf16 weights do not fit {free / GB:.1f} GB free"}
    progress("building transformers' DeepseekV4 (bf16, eager)")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg.to_hf_dict(), attn_implementation="eager")).eval()
    finally:
        torch.set_default_dtype(default)
    out: dict = {"weights_gb": sum(p.numel() * p.element_size() for p in model.parameters()) / GB, "decode": []}

    def prompt(batch: int, length: int) -> torch.Tensor:
        return torch.tensor([_random_prompt(rng, length, cfg.vocab_size) for _ in range(batch)], device=device)

    with torch.inference_mode():
        for batch in sorted(set(args.batch_sizes)):
            try:
                cache = model(prompt(batch, args.context), use_cache=True, logits_to_keep=1).past_key_values
                token = prompt(batch, 1)
                times = []
                for _ in tqdm(range(args.decode_steps + 2), desc=f"transformers decode {batch}", file=sys.stderr):
                    sync(device)
                    t0 = time.perf_counter()
                    cache = model(token, past_key_values=cache, use_cache=True).past_key_values
                    sync(device)
                    times.append((time.perf_counter() - t0) * 1e3)
                times = sorted(times[2:])
                out["decode"].append({"batch": batch, "ms_per_step": times[len(times) // 2]})
            except torch.OutOfMemoryError:
                out["decode"].append({"batch": batch, "error": "out of memory"})
            finally:
                cache = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        out["prefill"] = []
        model(prompt(1, min(args.prefill_lengths)), use_cache=False, logits_to_keep=1)  # warm-up
        for length in sorted(set(args.prefill_lengths)):
            try:
                ids = prompt(1, length)
                sync(device)
                t0 = time.perf_counter()
                model(ids, use_cache=False, logits_to_keep=1)
                sync(device)
                out["prefill"].append({"tokens": length, "tokens_per_s": length / (time.perf_counter() - t0)})
            except torch.OutOfMemoryError:
                out["prefill"].append({"tokens": length, "error": "out of memory"})
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def table(result: dict) -> str:
    w = result["weights"]
    lines = [
        f"ds4 bench model: {result['config']}, {result['layers']} of {result['full_layers']} layers "
        f"({', '.join(result['layer_kinds'])}), {result['load_format']} weights, {result['dtype']}, "
        f"context {result['context']}, on {result['device']}"
        + ("" if result.get("side_stream", True) else " (--serial: no side-stream overlaps)")
        + ("" if result.get("dependent_launch", True) else " (--no-pdl: no programmatic dependent launch)"),
        _ceilings_line(result["ceilings"]),
        f"weights: resident {w['resident_gb']:.2f} GB, checkpoint {w['checkpoint_gb']:.2f} GB "
        f"({w['ratio']:.2f}x); per layer resident / checkpoint GB: "
        + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(w["resident_per_layer_gb"], w["checkpoint_per_layer_gb"])),
        _parallel_line(result),
        "",
        _rows(
            ("batch", "context", "ms/step", "tok/s", "roofline ms", "x roofline", "GPU ms", "GPU x roofline")
            + ("experts/layer",),
            [
                (r["batch"], r["context"], f"{r['ms_per_step']:.3f}", f"{r['tokens_per_s']:.1f}")
                + (f"{r['roofline_ms']:.3f}", f"{r['ratio']:.1f}", *_gpu_cells(r))
                + (f"{r['experts_touched_per_layer']:.1f}",)
                for r in result["decode"]
            ],
        ),
        "",
        _rows(
            ("prefill tokens", "seconds", "tok/s", "roofline s", "x roofline"),
            [
                (r["tokens"], f"{r['seconds']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['roofline_s']:.4f}")
                + (f"{r['ratio']:.1f}",)
                for r in result["prefill"]
            ],
        ),
    ]
    touched = [(r["batch"], r["routing"]["experts_touched"]) for r in result["decode"] if r.get("routing")]
    if touched:
        lines.append(
            "experts a score layer touched in one decode step (eager, measured; the table's experts/layer assume "
            "uniform routing): " + ", ".join(f"batch {b} {n:.1f}" for b, n in touched)
        )
    routing = result["prefill"][0].get("routing")
    if routing:
        lines.append(
            f"routing of the {result['prefill'][0]['tokens']}-token prefill ({routing['score_layers']} score layers, "
            f"means): {routing['rows_per_expert']:.0f} rows an expert, the largest {routing['max_over_mean']:.2f}x "
            f"that, spread {routing['spread_over_balanced']:.1f}x a balanced draw's"
        )
    if result["tensor_parallel_size"] > 1:
        lines += ["", _traffic_rows(result)]
    if result["peak_memory_gb"] is not None:
        lines.append(f"peak memory {result['peak_memory_gb']:.2f} GB")
    profiled = [("decode step", row) for row in sorted(result["decode"], key=lambda r: r["batch"])]
    for title, row in (*profiled, ("prefill", result["prefill"][0])):
        if "profile" in row:
            lines += ["", f"profile of one {title} ({row.get('batch', row.get('tokens'))}) by family:"]
            lines.append(_profile_rows(row["profile"]))
            for family, top in row.get("profile_kernels", {}).items():
                if row["profile"][family]["share"] >= LARGEST_SHOWN_SHARE or family == "other":
                    shown = list(top.items())[:LARGEST_SHOWN]
                    lines.append(
                        f"largest in {family}: "
                        + "; ".join(f"{n} {k['ms']:.3f} ms / {k['launches']}" for n, k in shown)
                    )
    lines += ["", _extrapolation_lines(result)]
    return "\n".join(lines)


def _gpu_cells(row: dict) -> tuple[str, str]:
    if row.get("gpu_ms_per_step") is None:
        return ("", "")
    return (f"{row['gpu_ms_per_step']:.3f}", f"{row['gpu_ratio']:.1f}")


def _parallel_line(result: dict) -> str:
    n = result["tensor_parallel_size"]
    if n == 1:
        return "one rank"
    return f"{n} ranks, {'expert' if result['expert_parallel'] else 'tensor'} parallel (weights and memory: rank 0's)"


def _traffic_rows(result: dict) -> str:
    """Bytes per step moved by rank 0's collectives (by kind) and its step messages."""
    kinds = sorted(result["decode"][0]["collective_bytes_per_step"])
    rows = []
    for r in result["decode"]:
        rows.append(
            (f"decode batch {r['batch']}", *(f"{r['collective_bytes_per_step'][k] / 1e3:.1f}" for k in kinds))
            + (f"{r['step_message_bytes_per_step'] / 1e3:.2f}",)
        )
    for r in result["prefill"]:
        rows.append(
            (f"prefill {r['tokens']} ({r['steps']} steps)",)
            + tuple(f"{r['collective_bytes_per_step'][k] / 1e3:.1f}" for k in kinds)
            + (f"{r['step_message_bytes_per_step'] / 1e3:.2f}",)
        )
    return _rows(("KB per step", *kinds, "step message"), rows)


def _ceilings_line(c: dict) -> str:
    fp8 = f"{c['fp8_flop_per_s'] / 1e12:.0f}" if c["fp8_flop_per_s"] else "n/a"
    return (
        f"ceilings (this run): copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
        f"bf16 GEMM {c['bf16_flop_per_s'] / 1e12:.1f} TFLOP/s, fp8 GEMM {fp8} TFLOP/s"
    )


def _profile_rows(profile: dict) -> str:
    rows = []
    for name, e in profile.items():
        roof = f"{e['roofline_ms']:.3f}" if "roofline_ms" in e else ""
        ratio = f"{e['ratio']:.1f}" if e.get("ratio") else ""
        rows.append((name, f"{e['ms']:.3f}", f"{100 * e['share']:.1f}%", str(e.get("kernels", "")), roof, ratio))
    return _rows(("family", "ms", "share", "kernels", "roofline ms", "x roofline"), rows)


def _extrapolation_lines(result: dict) -> str:
    x = result["extrapolated"]
    lines = [
        f"extrapolated per layer to {x['layers']} layers (checkpoint {x['checkpoint_gb']:.1f} GB): decode "
        + ", ".join(f"b{b} {ms:.2f} ms/step" for b, ms in x["decode_ms_per_step"].items())
        + "; prefill "
        + ", ".join(f"{n} tok {t:.0f} tok/s" for n, t in x["prefill_tokens_per_s"].items())
    ]
    if result["published"]:
        lines.append("published (shared/docs/anchors.md):")
        lines += [f"  {p['what']}: {p['value']} {p['unit']} ({p['setup']}; {p['source']})" for p in result["published"]]
    return "\n".join(lines)


def _transformers_lines(t: dict) -> str:
    if "skipped" in t:
        return f"transformers: skipped ({t['skipped']})"
    decode = ", ".join(
        f"b{r['batch']} {r['ms_per_step']:.2f} ms/step" if "ms_per_step" in r else f"b{r['batch']} {r['error']}"
        for r in t["decode"]
    )
    prefill = ", ".join(
        f"{r['tokens']} tok {r['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in r else f"{r['tokens']} {r['error']}"
        for r in t["prefill"]
    )
    weights = f"weights {t['weights_gb']:.2f} GB"
    return f"transformers DeepseekV4 (bf16, eager): {weights}; decode {decode}; prefill {prefill}"


def _rows(header: tuple, rows: list[tuple]) -> str:
    cells = [tuple(str(c) for c in header)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)


def plot_svg(result: dict, width: int = 560, height: int = 360) -> str:
    """Decode ms/step against batch size (log2 x axis), measured and roofline, as a standalone SVG."""
    rows = result["decode"]
    left, right, top, bottom = 60, 20, 30, 40
    batches = [r["batch"] for r in rows]
    y_max = max(max(r["ms_per_step"] for r in rows), max(r["roofline_ms"] for r in rows)) * 1.1
    lo, hi = min(batches), max(batches)
    span = max(hi / lo, 2)

    def x(b: float) -> float:
        return left + (width - left - right) * math.log(b / lo) / math.log(span)

    def y(ms: float) -> float:
        return height - bottom - (height - top - bottom) * ms / y_max

    def line(key: str, color: str) -> str:
        points = " ".join(f"{x(r['batch']):.1f},{y(r[key]):.1f}" for r in rows)
        dots = "".join(f'<circle cx="{x(r["batch"]):.1f}" cy="{y(r[key]):.1f}" r="3" fill="{color}"/>' for r in rows)
        return f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>{dots}'

    ticks = "".join(
        f'<text x="{x(b):.1f}" y="{height - bottom + 16}" text-anchor="middle">{b}</text>' for b in batches
    ) + "".join(
        f'<text x="{left - 6}" y="{y(v):.1f}" text-anchor="end">{v:.2g}</text>'
        for v in (y_max * i / 4 for i in range(5))
    )
    title = f"decode, {result['config']}, {result['layers']} layers, context {result['context']}, {result['device']}"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11"><rect width="100%" height="100%" fill="white"/>'
        f'<text x="{left}" y="18" font-size="12">{title}</text>'
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>{ticks}'
        f'<text x="{(left + width) / 2}" y="{height - 6}" text-anchor="middle">batch size</text>'
        f'<text x="14" y="{(top + height) / 2}" transform="rotate(-90 14 {(top + height) / 2})" '
        f'text-anchor="middle">ms / step</text>'
        f"{line('ms_per_step', '#c0392b')}{line('roofline_ms', '#2471a3')}"
        f'<text x="{width - right - 150}" y="{top + 12}" fill="#c0392b">measured</text>'
        f'<text x="{width - right - 150}" y="{top + 26}" fill="#2471a3">roofline (bytes / copy rate)</text></svg>\n'
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
