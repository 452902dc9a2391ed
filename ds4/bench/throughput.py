"""`ds4 bench throughput`: offline throughput of the engine on random requests.

N requests with input and output lengths drawn uniformly from [L/2, 3L/2] around --input-len and
--output-len (seeded), random prompt tokens, sampled at temperature 1 with EOS ignored so every
request produces exactly its output length. All requests are queued at once; the clock runs from the
first step to the last finished request, after one warm-up request. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from ds4.bench.report import environment, sync, write_json


def main(argv: list[str]) -> int:
    from ds4.engine.config import add_engine_args, add_model_args, engine_flags_from_args, model_flags_from_args

    parser = argparse.ArgumentParser(prog="ds4 bench throughput", description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--num-prompts, --input-len and --output-len must be positive")
    result = run(args, model_flags_from_args(args), engine_flags_from_args(args))
    print(table(result))
    write_json(args.json, result)
    return 0


def random_requests(num: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)

    def around(n: int) -> int:
        return rng.randint(max(1, n // 2), max(1, n + n // 2))

    # Ids from 2 up: 0 and 1 are BOS and EOS.
    return [([rng.randrange(2, vocab) for _ in range(around(input_len))], around(output_len)) for _ in range(num)]


def run(args: argparse.Namespace, model_flags: dict, engine_flags: dict) -> dict:
    from ds4.engine.engine import LLMEngine
    from ds4.engine.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(args.model, seed=args.seed, **model_flags, **engine_flags)
    try:
        vocab = engine.model.cfg.vocab_size
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
        # Keep every request within max_model_len, where it would stop early.
        limit = engine.max_model_len
        requests = [(prompt[: limit - 1], min(out, limit - len(prompt[: limit - 1]))) for prompt, out in requests]

        def params(max_tokens: int) -> SamplingParams:
            return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)

        engine.add_request("warm-up", requests[0][0], params(2))
        while engine.has_unfinished_requests():
            engine.step()
        for i, (prompt, out_len) in enumerate(requests):
            engine.add_request(f"bench-{i}", prompt, params(out_len))
        sync(engine.device)
        start = time.perf_counter()
        output_tokens = 0
        while engine.has_unfinished_requests():
            output_tokens += sum(len(o.new_token_ids) for o in engine.step())
        sync(engine.device)
        elapsed = time.perf_counter() - start
        input_tokens = sum(len(p) for p, _ in requests)
        stats = engine.stats()
        return {
            "benchmark": "throughput",
            "num_prompts": len(requests),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "elapsed_s": elapsed,
            "requests_per_s": len(requests) / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "num_steps": stats.num_steps,
            "num_preemptions": stats.num_preemptions,
            "capacity_tokens": stats.capacity_tokens,
            "max_model_len": engine.max_model_len,
            "engine": engine_flags,
            "model": str(args.model or "tiny (built-in)"),
            "dtype": str(engine.model.dtype),
            **environment(engine.device),
        }
    finally:
        engine.close()


def table(result: dict) -> str:
    rows = [
        ("requests", f"{result['num_prompts']}"),
        ("input / output tokens", f"{result['input_tokens']} / {result['output_tokens']}"),
        ("elapsed", f"{result['elapsed_s']:.2f} s"),
        ("requests/s", f"{result['requests_per_s']:.2f}"),
        ("output tok/s", f"{result['output_tokens_per_s']:.1f}"),
        ("total tok/s", f"{result['total_tokens_per_s']:.1f}"),
        ("steps / preemptions", f"{result['num_steps']} / {result['num_preemptions']}"),
        ("device", result["device"]),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
