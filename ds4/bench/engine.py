"""`ds4 bench engine`: the engine's own time per decode step, next to the model's time in the same steps.

R requests (each of `--batch-sizes`, default 64) of `--input-len` random prompt tokens are prefilled, then
decode together (greedy, or `--temperature`; EOS ignored) through `LLMEngine.step`; the batch shrinks by
aborting requests, largest first. The `--steps` steps of a measurement run back to back, the device synchronised
only before the first, as a server runs them. Per batch size, medians over those steps:
  - step ms: one `LLMEngine.step` call, which returns one step's tokens on the host (schedule, batch upload,
    forward or CUDA-graph replay, logits, sampling, detokenisation and stop checks). With async decode (on by
    default with CUDA graphs) a call launches the next step before it waits for this one's tokens, so the host
    work of one step runs while the device computes the next: step ms is then the time between two returned
    steps, what a request waits per token; `ahead` is the share of the timed steps that were launched so.
  - model ms: the model's forward and logits (a CUDA graph's replay computes both) of one
    step, timed on the device by CUDA events around them (wall time on CPU): the ceiling, a step can be no
    faster.
  - host ms: the same steps with the forward and logits replaced by stubs that return ready tensors (logits
    over a 256-token vocabulary, so the sampler's device work is ~0 too): the engine's own work per step.
  - launch ms: the host's time inside those same model calls (on CUDA a graph replay's launch; the logits' launches
    of steps that replay no graph): host work the host-only figure leaves out; "of which logits" the time inside
    the logits' calls.
  - exposed ms = step - model: what the engine adds to the model's time. Host work that overlaps the
    device's work costs nothing here: with async decode, exposed ~ max(host - model, 0) plus the launch gap;
    with none overlapped (--no-async-decode), exposed ~ host.
`--cprofile N` prints the N functions with the most own time in the host-only steps (stderr); `--api-profile N` the N
host calls (torch ops; on CUDA the runtime and driver calls: graph launches, kernel launches, copies, the waits for
the device) with the most own time in as many real steps, under torch.profiler (stderr).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

from ds4.bench.driver import shrink, step, timed_steps
from ds4.bench.report import environment, int_list, progress, write_json

STUB_VOCAB = 256


def main(argv: list[str]) -> int:
    from ds4.engine.config import add_engine_args, add_model_args, engine_flags_from_args, model_flags_from_args

    parser = argparse.ArgumentParser(prog="ds4 bench engine", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--batch-sizes", type=int_list, default=[64], help="running requests per step, e.g. 1,64")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size (and mode)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N costliest host functions")
    parser.add_argument(
        "--api-profile", type=int, default=0, metavar="N", help="print the N costliest host calls of real steps"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.input_len < 1 or args.steps < 1:
        parser.error("--batch-sizes, --input-len and --steps must be positive")
    result = run(args, model_flags_from_args(args), engine_flags_from_args(args))
    print(table(result))
    write_json(args.json, result)
    return 0


def run(args: argparse.Namespace, model_flags: dict, engine_flags: dict) -> dict:
    from ds4.engine.engine import LLMEngine
    from ds4.engine.sampling_params import SamplingParams

    batches = sorted(set(args.batch_sizes), reverse=True)
    # Every request decodes through the prefill of the others, then through each batch size's steps: timed,
    # API-profiled, stubbed and profiled.
    max_tokens = batches[0] + len(batches) * (4 * args.steps + 8) + 16
    engine_flags = dict(
        engine_flags,
        max_num_seqs=batches[0],
        max_num_partial_prefills=batches[0],
        max_num_batched_tokens=max(engine_flags["max_num_batched_tokens"], batches[0]),
        max_model_len=engine_flags["max_model_len"] or args.input_len + max_tokens + 1,
    )
    progress("starting the engine (weights, cache plan, CUDA-graph capture)")
    engine = LLMEngine.from_pretrained(args.model, seed=args.seed, **model_flags, **engine_flags)
    try:
        # Every request must run at once: none finishes, so one left waiting would never start.
        needed = batches[0] * (args.input_len + max_tokens)
        if engine.allocator.capacity_tokens < needed:
            raise SystemExit(
                f"the cache holds {engine.allocator.capacity_tokens} tokens; {batches[0]} requests of "
                f"{args.input_len + max_tokens} need {needed}: lower --input-len or --batch-sizes, or give more memory"
            )
        rng = random.Random(args.seed)
        vocab = engine.model.cfg.vocab_size
        params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True)
        ids = [f"bench-{i}" for i in range(batches[0])]
        for request_id in ids:
            engine.add_request(request_id, [rng.randrange(2, vocab) for _ in range(args.input_len)], params)
        progress(f"prefilling {len(ids)} requests of {args.input_len} tokens")
        while any(not engine.requests[i].output_token_ids for i in ids):
            step(engine)
        timer = _ModelTimer(engine)
        rows = []
        for batch in batches:
            progress(f"decode batch {batch}: {args.steps} steps, then as many with the model stubbed")
            ids = shrink(engine, ids, batch)
            timer.read()
            steps_ahead = engine.stats().num_steps_ahead
            step_ms = timed_steps(engine, args.steps, timer.end_step)
            model_ms, launch_ms, logits_ms = timer.read()
            ahead = (engine.stats().num_steps_ahead - steps_ahead) / args.steps
            if args.api_profile and batch == batches[0]:
                _print_api_profile(engine, args.steps, args.api_profile)
            with _stubbed(engine):
                step(engine)
                host_ms = timed_steps(engine, args.steps)
                if args.cprofile and batch == batches[0]:
                    _print_profile(engine, args.steps, args.cprofile)
            if any(i not in engine.requests for i in ids):
                raise SystemExit(f"batch {batch}: a request finished early (max_tokens {max_tokens} too small)")
            step_med, model_med, host_med = _median(step_ms), _median(model_ms), _median(host_ms)
            launch_med, logits_med = _median(launch_ms), _median(logits_ms)
            rows.append(
                {
                    "batch": batch,
                    "step_ms": step_med,
                    "model_ms": model_med,
                    "host_ms": host_med,
                    "launch_ms": launch_med,
                    "logits_launch_ms": logits_med,
                    "exposed_ms": step_med - model_med,
                    "ahead": ahead,
                }
            )
        return {
            "benchmark": "engine",
            "rows": sorted(rows, key=lambda r: r["batch"]),
            "input_len": args.input_len,
            "steps": args.steps,
            "temperature": args.temperature,
            "cuda_graphs": engine.runner.graphs is not None,
            "async_decode": engine.config.async_decode,
            "prefix_caching": engine.prefix_cache is not None,
            "detokenizing": engine.tokenizer is not None,
            "engine": engine_flags,
            "model": str(args.model or "tiny (built-in)"),
            "dtype": str(engine.model.dtype),
            **environment(engine.device),
        }
    finally:
        engine.close()


def table(result: dict) -> str:
    lines = [
        f"engine decode step, {result['model']} on {result['device']}, input {result['input_len']} tokens, "
        f"temperature {result['temperature']}, CUDA graphs {result['cuda_graphs']}, "
        f"async decode {result['async_decode']}, "
        f"prefix caching {result['prefix_caching']}, detokenizing {result['detokenizing']}; "
        f"medians of {result['steps']} steps",
        "batch | step ms | model ms | exposed ms (step - model) | host ms (model stubbed) | launch ms (host) | "
        "of which logits | ahead",
        "---|---|---|---|---|---|---|---",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['batch']} | {r['step_ms']:.3f} | {r['model_ms']:.3f} | {r['exposed_ms']:.3f} | {r['host_ms']:.3f} | "
            f"{r['launch_ms']:.3f} | {r['logits_launch_ms']:.3f} | {r['ahead']:.0%}"
        )
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


class _ModelTimer:
    """Times the model's forward (eager or graph replay) and logits inside engine steps, without syncing:
    CUDA events around each call, read once the measurement is over, and the host's wall time inside the call.
    Only the outermost call counts (an eager graph run calls the forward). With async decode, the calls made in
    one engine step are those of the step it launches ahead: the same work, one step later."""

    def __init__(self, engine):
        self.cuda = engine.device.type == "cuda"
        self.spans: list = []
        self.steps: list[list] = []
        self.host_spans: list[tuple[str, float]] = []  # (call, host ms)
        self.host_steps: list[list[tuple[str, float]]] = []
        self._depth = 0
        model, graphs = engine.model, engine.runner.graphs
        self._wrap(model, "forward")
        self._wrap(model, "compute_logits")
        if graphs is not None:
            self._wrap(graphs, "run")

    def _wrap(self, owner, name: str) -> None:
        call = getattr(owner, name)

        def timed(*args, **kwargs):
            if self._depth:
                return call(*args, **kwargs)
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            host_start = time.perf_counter()
            self._depth += 1
            try:
                out = call(*args, **kwargs)
            finally:
                self._depth -= 1
            host_ms = (time.perf_counter() - host_start) * 1e3
            self.host_spans.append((name, host_ms))
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.spans.append((start, end))
            else:
                self.spans.append(host_ms)
            return out

        setattr(owner, name, timed)

    def end_step(self) -> None:
        """The calls since the last end_step belong to one engine step."""
        self.steps.append(self.spans)
        self.host_steps.append(self.host_spans)
        self.spans, self.host_spans = [], []

    def read(self) -> tuple[list[float], list[float], list[float]]:
        """For each step ended since the last reading (the calls of no step are dropped): the device's time of its
        calls, the host's time inside them, and the host's time inside its logits' calls."""
        steps, host_steps = self.steps, self.host_steps
        self.steps, self.spans, self.host_steps, self.host_spans = [], [], [], []
        host_ms = [sum(ms for _, ms in spans) for spans in host_steps]
        logits_ms = [sum(ms for name, ms in spans if name == "compute_logits") for spans in host_steps]
        if self.cuda:
            torch.cuda.synchronize()
            return [sum(start.elapsed_time(end) for start, end in spans) for spans in steps], host_ms, logits_ms
        return [sum(spans) for spans in steps], host_ms, logits_ms


class _stubbed:
    """Within: the model's forward and logits return ready tensors (zeros; small random logits)."""

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        engine, cfg = self.engine, self.engine.model.cfg
        rows = engine.config.max_num_batched_tokens
        hidden = torch.zeros(rows, cfg.hc_mult, cfg.hidden_size, dtype=engine.model.dtype, device=engine.device)
        logits = torch.randn(rows, STUB_VOCAB, generator=torch.Generator().manual_seed(0)).to(engine.device)
        model, graphs = engine.model, engine.runner.graphs
        self.saved = [(model, "forward"), (model, "compute_logits")] + ([(graphs, "run")] if graphs else [])
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.saved]
        model.forward = lambda batch, cache: hidden[: batch.num_tokens]
        model.compute_logits = lambda h: logits[: h.shape[0]]
        if graphs is not None:
            # the runner loaded the graph's inputs
            graphs.run = lambda batch, key: (hidden[: batch.num_tokens], logits[: batch.num_tokens])
        return self

    def __exit__(self, *exc):
        for owner, name, call in self.saved:
            setattr(owner, name, call)


def _print_api_profile(engine, steps: int, top: int) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        start = time.perf_counter()
        for _ in range(steps):
            step(engine)
        wall_ms = (time.perf_counter() - start) * 1e3
    print(f"real steps under torch.profiler ({steps} steps, {wall_ms:.1f} ms), by own host time:", file=sys.stderr)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), file=sys.stderr)


def _print_profile(engine, steps: int, top: int) -> None:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step(engine)
    profile.disable()
    print(f"host-only steps under cProfile ({steps} steps), by own time:", file=sys.stderr)
    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
