"""`ds4 bench needle`: needle-in-a-haystack recall of any OpenAI-compatible chat server, by context length and depth.

The haystack is English prose: Python's own documentation topics (`pydoc_data`, shipped with CPython), or
--haystack FILE. For each length (--lengths 4k,32k,128k: tokens, estimated as --chars-per-token characters
each; the server's own prompt token count is reported) and depth (--depths 0,0.25,0.5,0.75,1: where in the
haystack, by characters, at a sentence boundary) one sentence "The secret number of <city> is <n>." is
hidden, and the question asks for it; greedy, --max-tokens. A hit: the number appears in the answer's
content (or reasoning, with --count-reasoning). --trials repeats with other cities and numbers (seeded).
Prints recall per length and depth; --json writes every request. For people with real weights: random
weights recall nothing, the plumbing is what the tiny model's test checks.
"""

from __future__ import annotations

import argparse
import json
import random
import urllib.error
import urllib.request
from pathlib import Path

from ds4.bench.lengths import parse_length
from ds4.bench.report import write_json

CITIES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tromso", "Adelaide", "Tbilisi", "Halifax", "Cusco", "Bergen")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench needle", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1 is added)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--lengths", default="4k,32k", help="context lengths in tokens: 4k, 128k, 1m, ...")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle positions, 0 (start) to 1 (end)")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--haystack", type=Path, default=None, help="a text file (default: Python's doc topics)")
    parser.add_argument("--chars-per-token", type=float, default=4.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--count-reasoning", action="store_true", help="a number in reasoning_content counts")
    parser.add_argument(
        "--extra-body",
        default="{}",
        help='JSON merged into each request, e.g. \'{"chat_template_kwargs": {"thinking": false}}\'',
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        lengths = [parse_length(x) for x in args.lengths.split(",") if x]
        depths = [float(x) for x in args.depths.split(",") if x]
        extra = json.loads(args.extra_body)
    except ValueError as e:
        parser.error(str(e))
    if not all(0 <= d <= 1 for d in depths) or args.trials < 1:
        parser.error("--depths must lie in [0, 1] and --trials be positive")
    text = args.haystack.read_text() if args.haystack else default_haystack()
    result = run(args, lengths, depths, text, extra)
    print(table(result))
    write_json(args.json, result)
    return 0


def default_haystack() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def build_prompt(haystack: str, num_chars: int, depth: float, needle: str) -> str:
    """The first num_chars characters of the haystack (repeated if short) with the needle at a sentence boundary
    near depth * num_chars."""
    text = (haystack * (num_chars // max(len(haystack), 1) + 1))[:num_chars]
    at = int(depth * len(text))
    boundary = text.rfind(". ", 0, at)
    at = boundary + 2 if boundary >= 0 and at < len(text) else at
    return text[:at] + needle + " " + text[at:]


def run(args: argparse.Namespace, lengths: list[int], depths: list[float], haystack: str, extra: dict) -> dict:
    rng = random.Random(args.seed)
    url = args.base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    requests = []
    for length in lengths:
        for depth in depths:
            for trial in range(args.trials):
                city, number = rng.choice(CITIES), str(rng.randrange(10000, 100000))
                needle = f"The secret number of {city} is {number}."
                context = build_prompt(haystack, int(length * args.chars_per_token), depth, needle)
                question = f"{context}\n\nWhat is the secret number of {city}? Answer with the number only."
                body = {
                    "model": args.model,
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    **extra,
                }
                entry = {"length": length, "depth": depth, "trial": trial, "number": number}
                entry.update(_ask(url, headers, body, args.timeout))
                answer = entry.get("content", "") + (entry.get("reasoning", "") if args.count_reasoning else "")
                entry["hit"] = entry["ok"] and number in answer
                requests.append(entry)
    return {
        "benchmark": "needle",
        "base_url": args.base_url,
        "model": args.model,
        "lengths": lengths,
        "depths": depths,
        "trials": args.trials,
        "requests": requests,
    }


def _ask(url: str, headers: dict, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.loads(response.read())
    except urllib.error.HTTPError as e:
        return {"ok": False, "error": f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"}
    except (OSError, ValueError) as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    message = reply["choices"][0]["message"]
    return {
        "ok": True,
        "prompt_tokens": (reply.get("usage") or {}).get("prompt_tokens"),
        "content": message.get("content") or "",
        "reasoning": message.get("reasoning_content") or "",
    }


def table(result: dict) -> str:
    depths = result["depths"]
    header = ["length", "prompt tokens"] + [f"depth {d:g}" for d in depths] + ["recall", "failed"]
    rows = []
    for length in result["lengths"]:
        mine = [r for r in result["requests"] if r["length"] == length]
        tokens = [r["prompt_tokens"] for r in mine if r.get("prompt_tokens")]
        cells = [str(length), str(round(sum(tokens) / len(tokens))) if tokens else "-"]
        for depth in depths:
            at = [r for r in mine if r["depth"] == depth]
            cells.append(f"{sum(r['hit'] for r in at)}/{len(at)}")
        cells += [f"{sum(r['hit'] for r in mine) / len(mine):.2f}", str(sum(not r["ok"] for r in mine))]
        rows.append(cells)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join([f"needle recall of {result['model']} at {result['base_url']}", *lines])
