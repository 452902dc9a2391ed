"""`ds4 bench prefill`: time to first token of one request against its context length, and where it goes.

For each of --lengths (e.g. 8k,32k,128k,512k,1m; lengths that do not fit max_model_len are skipped and said
so) one request of random prompt ids and max_tokens 1 runs alone through the engine (chunked as the engine
flags say), after an untimed request of the same length (kernels compile for the shapes they first see, and a
longer prompt reaches new ones: longer top-k rows, more compressed entries). TTFT is add_request to the
sampled token. The ceiling next to each row is linear cost at the shortest length's speed (its prefill
tok/s): `scaling` is the share of it a longer prompt keeps; attention and indexer work growing with the
context shows as scaling < 1.

--profile runs each length once more (on a new prompt: the first is in the prefix cache now) under
torch.profiler and splits its device time (CPU time on CPU) by kernel family (ds4.bench.profile: GEMMs, MoE,
attention, indexer, top-k, mHC, compressor, norms, other), as percentages: the question "where does a long
prefill spend its time" answered without nsys.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from ds4.bench.lengths import parse_length
from ds4.bench.profile import FAMILIES, profile_families
from ds4.bench.report import environment, sync, write_json


def main(argv: list[str]) -> int:
    from ds4.engine.config import add_engine_args, add_model_args, engine_flags_from_args, model_flags_from_args

    parser = argparse.ArgumentParser(prog="ds4 bench prefill", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--lengths", default="8k,32k,128k,512k,1m", help="prompt lengths: 512, 8k, 1m, ...")
    parser.add_argument("--profile", action="store_true", help="device time per kernel family (torch.profiler)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    try:
        lengths = sorted({parse_length(x) for x in args.lengths.split(",") if x})
    except ValueError as e:
        parser.error(f"--lengths: {e}")
    result = run(args, lengths, model_flags_from_args(args), engine_flags_from_args(args))
    print(table(result))
    write_json(args.json, result)
    return 0


def run(args: argparse.Namespace, lengths: list[int], model_flags: dict, engine_flags: dict) -> dict:
    from ds4.engine.engine import LLMEngine

    engine = LLMEngine.from_pretrained(args.model, seed=args.seed, **model_flags, **engine_flags)
    try:
        fit = [n for n in lengths if n < engine.max_model_len]
        skipped = [n for n in lengths if n >= engine.max_model_len]
        rng = random.Random(args.seed)
        vocab = engine.model.cfg.vocab_size
        rows = []
        for n in fit:
            ttft(engine, [rng.randrange(2, vocab) for _ in range(n)])  # warm-up
            prompt = [rng.randrange(2, vocab) for _ in range(n)]
            seconds = ttft(engine, prompt)
            row = {"length": n, "ttft_s": seconds, "prefill_tokens_per_s": n / seconds}
            if args.profile:  # on a new prompt: the timed one is in the prefix cache now
                row["profile"] = profile(engine, [rng.randrange(2, vocab) for _ in range(n)])
            rows.append(row)
        return {
            "benchmark": "prefill",
            "rows": rows,
            "skipped_lengths": skipped,
            "max_model_len": engine.max_model_len,
            "engine": {k: str(v) for k, v in engine_flags.items()},
            "model": str(args.model or args.config or "tiny (built-in)"),
            "layers": engine.model.cfg.num_hidden_layers,
            "dtype": str(engine.model.dtype),
            **environment(engine.device),
        }
    finally:
        engine.close()


def ttft(engine, prompt: list[int]) -> float:
    from ds4.engine.sampling_params import SamplingParams

    sync(engine.device)
    start = time.perf_counter()
    engine.add_request("prefill", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        if any(out.new_token_ids for out in engine.step()):
            break
    sync(engine.device)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def profile(engine, prompt: list[int]) -> dict[str, float]:
    """Percent of device time (CPU time without CUDA) per kernel family, for one more TTFT run of `prompt`."""
    ms = profile_families(engine.model, lambda: ttft(engine, prompt), engine.device)
    total = ms.pop("total") or 1.0
    return {family: 100 * value / total for family, value in ms.items()}


def table(result: dict) -> str:
    rows = result["rows"]
    if not rows:
        return f"no length fits max_model_len {result['max_model_len']} (skipped: {result['skipped_lengths']})"
    base = rows[0]["prefill_tokens_per_s"]
    profiled = "profile" in rows[0]
    header = ["length", "TTFT ms", "prefill tok/s", "scaling"] + (list(FAMILIES) if profiled else [])
    lines = []
    for row in rows:
        cells = [str(row["length"]), f"{1000 * row['ttft_s']:.1f}", f"{row['prefill_tokens_per_s']:.0f}"]
        cells.append(f"{row['prefill_tokens_per_s'] / base:.2f}")
        if profiled:
            cells += [f"{row['profile'][f]:.1f}%" for f in FAMILIES]
        lines.append(cells)
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    out = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *lines]]
    out.insert(1, "-+-".join("-" * w for w in widths))
    model = f"{result['model']} ({result['layers']} layers) on {result['device']}"
    out.append(f"{model}; scaling: tok/s over the {rows[0]['length']}-token speed")
    if result["skipped_lengths"]:
        out.append(f"skipped (>= max_model_len {result['max_model_len']}): {result['skipped_lengths']}")
    return "\n".join(out)
