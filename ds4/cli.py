"""The `ds4` command: serve, generate, make-tiny, bench (serve and bench parse their own flags)."""

from __future__ import annotations

import argparse
import importlib
import sys

from ds4.engine.config import add_engine_args, add_model_args, engine_flags_from_args, model_flags_from_args

_BENCHMARKS = {
    "attention": "ds4.bench.attention",
    "engine": "ds4.bench.engine",
    "kernels": "ds4.bench.kernels",
    "linear": "ds4.bench.linear",
    "model": "ds4.bench.model",
    "moe": "ds4.bench.moe",
    "mtp": "ds4.bench.mtp",
    "needle": "ds4.bench.needle",
    "prefill": "ds4.bench.prefill",
    "serve": "ds4.bench.serve",
    "throughput": "ds4.bench.throughput",
    "traffic": "ds4.bench.traffic",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["serve"]:
        from ds4.serve.server import main as serve

        return serve(argv[1:])
    parser = argparse.ArgumentParser(prog="ds4", description="Serve DeepSeek-V4-family models.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt offline and print the text")
    add_model_args(generate)
    generate.add_argument("--prompt", required=True, help="the prompt text")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat format")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    add_engine_args(generate)

    tiny = commands.add_parser("make-tiny", help="write a tiny random DeepSeek-V4 checkpoint")
    tiny.add_argument("out", help="output directory")
    tiny.add_argument("--format", choices=("official", "hf"), default="official")
    tiny.add_argument("--seed", type=int, default=0)

    commands.add_parser("serve", help="the OpenAI-compatible server: `ds4 serve --help`")
    commands.add_parser("bench", help="benchmarks: `ds4 bench NAME --help`, NAME one of " + ", ".join(_BENCHMARKS))

    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "make-tiny":
        return _make_tiny(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _generate(args: argparse.Namespace) -> int:
    from ds4.engine.llm import LLM
    from ds4.engine.sampling_params import SamplingParams

    llm = LLM(model=args.model, **model_flags_from_args(args), **engine_flags_from_args(args))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    prompt = args.prompt
    if args.chat:
        from ds4.serve.chat_encoding import encode_chat_request

        prompt = encode_chat_request([{"role": "user", "content": args.prompt}]).text
    output = llm.generate([prompt], params)[0]
    print(output.text)
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from ds4.checkpoint.tiny import make_tiny

    make_tiny(args.out, format=args.format, seed=args.seed)
    print(f"wrote a tiny {args.format}-format DeepSeek-V4 checkpoint to {args.out}")
    return 0


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in _BENCHMARKS:
        print(f"usage: ds4 bench {{{','.join(_BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(_BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
