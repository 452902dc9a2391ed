"""`ds4 bench serve`: latency and throughput of any OpenAI-compatible server, as its users see them.

For each concurrency (--concurrency 1,4,8) and trial (--trials), `concurrency` clients each send
--requests-per-client streaming /v1/completions requests back to back: a prompt of --input-len token ids
(drawn from [1000, 20000), ids every current tokenizer has; seeded), --output-len tokens with EOS ignored
(`ignore_eos`, understood by ds4 and vLLM-style servers), greedy. Per request: TTFT (send to first streamed
token), the gaps between streamed chunks (ITL; a chunk may carry several tokens under speculative
decoding) and decode speed (tokens after the first over the time after the first). Per trial: aggregate
output tokens/s over the trial's wall time and the failures (non-200, error events, short outputs). Each level
starts with an untimed round of `concurrency` requests: a server compiling kernels for batch shapes it has not
seen yet would otherwise put its compile time into the first trial's TTFT.

The ceiling printed next to each row is linear scaling of the same run's concurrency-1 speed
(concurrency x per-request tok/s at concurrency 1): `scaling` is the aggregate's share of it.
Prints a table; --json writes every request's figures; --plot draws tok/s against concurrency (matplotlib).

--acceptance-lengths 1.5,2,2.5 adds the per-request tok/s those mean acceptance lengths would give at the
measured median ITL: with speculative decoding on random weights (drafts all rejected) every chunk is one
verify step, so L / median ITL is the speed of the same steps if each kept L tokens on average.

--multi-turn runs the conversation scenario of ds4.bench.multi_turn instead: each concurrency level is that many
clients whose chat conversations grow every turn (a long fixed system prompt and tools, then user and assistant
turns); TTFT per turn and the server's prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ds4.bench.report import write_json

PROMPT_IDS = (1000, 20000)


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft_s: float | None = None
    decode_tokens_per_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str | None = None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds4 bench serve", description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1 is added)")
    parser.add_argument("--model", required=True, help="model name the server serves")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated client counts")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write a PNG of tok/s against concurrency (multi-turn: TTFT against turn)",
    )
    parser.add_argument(
        "--acceptance-lengths", default="", help="e.g. 1.5,2,2.5: tok/s implied at those acceptance lengths"
    )
    multi = parser.add_argument_group("multi-turn (--trials, --requests-per-client, --input-len do not apply)")
    multi.add_argument("--multi-turn", action="store_true", help="growing chat conversations, one per client")
    multi.add_argument("--system-prompt-len", type=int, default=8192, help="words (tokens) of the system prompt")
    multi.add_argument("--num-tools", type=int, default=8, help="tool definitions sent with every turn")
    multi.add_argument("--turns", type=int, default=5, help="user turns per conversation")
    multi.add_argument("--user-turn-len", type=int, default=512, help="words (tokens) of each user message")
    args = parser.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        args.acceptance_lengths = [float(x) for x in args.acceptance_lengths.split(",") if x]
    except ValueError:
        parser.error("--concurrency: comma-separated integers; --acceptance-lengths: comma-separated numbers")
    if min(levels) < 1 or args.trials < 1 or args.requests_per_client < 1 or args.input_len < 1 or args.output_len < 1:
        parser.error("--concurrency, --trials, --requests-per-client, --input-len and --output-len must be positive")
    if args.multi_turn:
        from ds4.bench import multi_turn

        if min(args.system_prompt_len, args.turns, args.user_turn_len) < 1 or args.num_tools < 0:
            parser.error("--system-prompt-len, --turns and --user-turn-len must be positive, --num-tools >= 0")
        result, show, draw = multi_turn.run(args, levels), multi_turn.table, multi_turn.plot
    else:
        result, show, draw = run(args, levels), table, plot
    print(show(result))
    write_json(args.json, result)
    if args.plot is not None:
        draw(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def run(args: argparse.Namespace, levels: list[int]) -> dict:
    rng = random.Random(args.seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    send = _Sender(url, args.model, args.api_key, args.output_len, args.timeout)
    trials = []
    for concurrency in levels:
        warm_up = [[rng.randrange(*PROMPT_IDS) for _ in range(args.input_len)] for _ in range(concurrency)]
        with ThreadPoolExecutor(max_workers=concurrency) as pool:  # the level's batch shapes compile here
            list(pool.map(send, warm_up))
        for trial in range(args.trials):
            n = concurrency * args.requests_per_client
            prompts = [[rng.randrange(*PROMPT_IDS) for _ in range(args.input_len)] for _ in range(n)]
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                requests = list(pool.map(send, prompts))
            wall = time.perf_counter() - start
            trials.append({"concurrency": concurrency, "trial": trial, "wall_s": wall, **_summary(requests, wall)})
            trials[-1]["requests"] = [asdict(r) for r in requests]
    return {
        "benchmark": "serve",
        "base_url": args.base_url,
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "requests_per_client": args.requests_per_client,
        "seed": args.seed,
        "levels": [_level(trials, c, args.acceptance_lengths) for c in levels],
        "trials": trials,
    }


class _Sender:
    """One streaming completion request; never raises (a failure is a result)."""

    def __init__(self, url: str, model: str, api_key: str | None, output_len: int, timeout: float):
        self.url, self.model, self.output_len, self.timeout = url, model, output_len, timeout
        self.headers = headers(api_key)

    def __call__(self, prompt: list[int]) -> RequestResult:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        events, error = post_stream(self.url, body, self.headers, self.timeout)
        if error is not None:
            return RequestResult(False, error=error)
        arrivals = [t for t, event in events if event.get("choices")]
        usage = next((event["usage"] for _, event in reversed(events) if event.get("usage")), None)
        return request_result(start, arrivals, usage["completion_tokens"] if usage else len(arrivals), self.output_len)


def headers(api_key: str | None) -> dict[str, str]:
    out = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        out["Authorization"] = f"Bearer {api_key}"
    return out


def post_stream(url: str, body: dict, headers: dict, timeout: float) -> tuple[list[tuple[float, dict]], str | None]:
    """POST a streaming request: the (arrival time, event) of each server-sent event, or an error (never raises)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    events = []
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return events, json.dumps(event["error"])[:300]
                events.append((time.perf_counter(), event))
    except urllib.error.HTTPError as e:
        return events, f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
    except (OSError, ValueError) as e:
        return events, f"{type(e).__name__}: {e}"
    return events, None


def request_result(start: float, arrivals: list[float], tokens: int, output_len: int) -> RequestResult:
    """A request's figures from its send time and the arrival times of the chunks carrying its tokens."""
    result = RequestResult(tokens == output_len, tokens, latency_s=time.perf_counter() - start)
    if not result.ok:
        result.error = f"{tokens} tokens of {output_len}"
    if arrivals:
        result.ttft_s = arrivals[0] - start
        result.itl_s = [b - a for a, b in zip(arrivals, arrivals[1:])]
        if tokens > 1 and arrivals[-1] > arrivals[0]:
            result.decode_tokens_per_s = (tokens - 1) / (arrivals[-1] - arrivals[0])
    return result


def _summary(requests: list[RequestResult], wall: float) -> dict:
    ok = [r for r in requests if r.ok]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    speeds = [r.decode_tokens_per_s for r in ok if r.decode_tokens_per_s is not None]
    gaps = [g for r in ok for g in r.itl_s]
    return {
        "num_requests": len(requests),
        "failed": len(requests) - len(ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "aggregate_tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "per_request_tokens_per_s": statistics.fmean(speeds) if speeds else None,
        "median_itl_ms": 1000 * statistics.median(gaps) if gaps else None,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_ms": 1000 * percentile(ttfts, 99) if ttfts else None,
        "errors": sorted({r.error for r in requests if r.error})[:5],
    }


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks."""
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _level(trials: list[dict], concurrency: int, acceptance_lengths: list[float]) -> dict:
    """Means over a concurrency's trials (of the trials that have the figure); failures summed."""
    mine = [t for t in trials if t["concurrency"] == concurrency]
    keys = ("per_request_tokens_per_s", "median_itl_ms", "ttft_p50_ms", "ttft_p99_ms", "aggregate_tokens_per_s")
    level = {"concurrency": concurrency, "failed": sum(t["failed"] for t in mine)}
    for key in keys:
        values = [t[key] for t in mine if t[key] is not None]
        level[key] = statistics.fmean(values) if values else None
    itl = level["median_itl_ms"]
    level["implied_tokens_per_s"] = {str(a): a * 1000 / itl for a in acceptance_lengths} if itl else {}
    return level


def table(result: dict) -> str:
    levels = result["levels"]
    single = next((lv["per_request_tokens_per_s"] for lv in levels if lv["concurrency"] == 1), None)
    header = ("conc", "per-req tok/s", "median ITL ms", "TTFT p50/p99 ms", "aggregate tok/s", "failed", "scaling")

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    rows = []
    for lv in levels:
        ceiling = single * lv["concurrency"] if single else None
        scaling = lv["aggregate_tokens_per_s"] / ceiling if ceiling and lv["aggregate_tokens_per_s"] else None
        rows.append(
            (
                str(lv["concurrency"]),
                fmt(lv["per_request_tokens_per_s"]),
                fmt(lv["median_itl_ms"], ".2f"),
                f"{fmt(lv['ttft_p50_ms'])}/{fmt(lv['ttft_p99_ms'])}",
                fmt(lv["aggregate_tokens_per_s"]),
                str(lv["failed"]),
                fmt(scaling, ".2f"),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    title = f"{result['model']} at {result['base_url']}: {result['input_len']} in, {result['output_len']} out"
    note = "scaling: aggregate over concurrency x the concurrency-1 per-request tok/s of this run"
    implied = [
        f"conc {lv['concurrency']}: per-request tok/s at acceptance length "
        + ", ".join(f"{a}: {v:.1f}" for a, v in lv["implied_tokens_per_s"].items())
        for lv in levels
        if lv.get("implied_tokens_per_s")
    ]
    return "\n".join([title, *lines, note, *implied])


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    levels = result["levels"]
    conc = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(conc, [lv["aggregate_tokens_per_s"] or 0 for lv in levels], marker="o", label="aggregate tok/s")
    ax.plot(conc, [lv["per_request_tokens_per_s"] or 0 for lv in levels], marker="o", label="per-request tok/s")
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{result['model']}: {result['input_len']} in / {result['output_len']} out")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
