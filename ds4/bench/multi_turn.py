"""`ds4 bench serve --multi-turn`: agent-style conversations that grow every turn, and what the prefix cache saves.

For each --concurrency level, that many clients each hold one conversation through /v1/chat/completions: a
fixed system prompt of --system-prompt-len words and --num-tools tool definitions (the same for every client
of a level, as for one agent serving many users; a new one per level, so levels share nothing), then --turns
user turns of --user-turn-len words. Every turn resends the whole conversation so far, the model's own
answers included as the server returned them (reasoning, content, tool calls; a tool call gets a one-word
tool result), plus a new user message, and streams --output-len tokens with EOS ignored, greedy. The words
come from a list the DeepSeek-V4 tokenizer reads as one token each (a word is a token there); the table
shows the real prompt sizes from the server's usage figures.

Per turn, across clients: prompt tokens (p50), TTFT p50/p99 (send to the first streamed token; requests ask
for logprobs so that every token streams a chunk even while the output parser holds text back), decode tok/s.
Per level: the prefix-cache hit rate, the server's own count read from /metrics before and after the level
(ds4_prefix_cache_hits_total / ds4_prefix_cache_queries_total, or vLLM's vllm:prefix_cache_*: prompt tokens
taken from the cache over prompt tokens looked up), next to its reference from the same run, the history
share: the share of prompt tokens the conversation itself had sent or received on its earlier turns (what a
cache of each conversation reuses at token granularity; a system prompt shared across clients adds to it,
page granularity and re-tokenised answers take from it).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from ds4.bench.serve import RequestResult, headers, percentile, post_stream, request_result

# Common English words the DeepSeek-V4 tokenizer encodes as one token each (with the space before them).
WORDS = tuple(
    """the of and to in is that for it as with was on be by this are or from at an not have has but which they
    you we can more all will one their there been were when if so what about would some into other time only new
    use also any these two may first then do could such like over most after where very through just well should
    make because each work many those how between state must system data file code read write test run value list
    table user model cache page token request server client step build check error output input line function
    result return call method class type name path field option number text string key order start end level
    layer window block batch queue record report update change create delete open close send""".split()
)

# Prefix-cache counters (prompt tokens looked up, prompt tokens taken from the cache) by the servers that export them.
PREFIX_CACHE_METRICS = (
    ("ds4_prefix_cache_queries_total", "ds4_prefix_cache_hits_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)


@dataclass
class TurnResult(RequestResult):
    turn: int = 0
    prompt_tokens: int | None = None


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def agent(rng: random.Random, system_len: int, num_tools: int) -> tuple[str, list[dict]]:
    """The fixed part every conversation of a level starts with: a system prompt and tool definitions."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": words(rng, 24),
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": words(rng, 8)},
                        "count": {"type": "integer", "description": words(rng, 8)},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(num_tools)
    ]
    return words(rng, system_len), tools


def run(args: argparse.Namespace, levels: list[int]) -> dict:
    base = args.base_url.rstrip("/")
    client = _ChatClient(base + "/v1/chat/completions", args.model, args.api_key, args.output_len, args.timeout)
    rng = random.Random(args.seed)
    # Warm-up: one first turn of full size on its own system prompt, so that a server compiling kernels for
    # shapes it has not seen does so here rather than in the first level's TTFT.
    system, tools = agent(rng, args.system_prompt_len, args.num_tools)
    client([{"role": "system", "content": system}, {"role": "user", "content": words(rng, args.user_turn_len)}], tools)
    results = []
    for clients in levels:
        system, tools = agent(rng, args.system_prompt_len, args.num_tools)
        seeds = [rng.randrange(2**32) for _ in range(clients)]
        before = scrape_prefix_cache(base, args.api_key, args.timeout)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            conversations = list(
                pool.map(lambda seed: _converse(client, system, tools, random.Random(seed), args), seeds)
            )
        wall = time.perf_counter() - start
        after = scrape_prefix_cache(base, args.api_key, args.timeout)
        results.append(_level(clients, conversations, wall, before, after, args.turns))
    return {
        "benchmark": "serve-multi-turn",
        "base_url": args.base_url,
        "model": args.model,
        "system_prompt_len": args.system_prompt_len,
        "num_tools": args.num_tools,
        "turns": args.turns,
        "user_turn_len": args.user_turn_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "levels": results,
    }


class _ChatClient:
    """One streaming chat request; returns its figures and the assistant message to append (never raises)."""

    def __init__(self, url: str, model: str, api_key: str | None, output_len: int, timeout: float):
        self.url, self.model, self.output_len, self.timeout = url, model, output_len, timeout
        self.headers = headers(api_key)

    def __call__(self, messages: list[dict], tools: list[dict]) -> tuple[TurnResult, dict]:
        body = {
            "model": self.model,
            "messages": messages,
            **({"tools": tools} if tools else {}),
            "max_tokens": self.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        events, error = post_stream(self.url, body, self.headers, self.timeout)
        message = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": {}}
        if error is not None:
            return TurnResult(False, error=error), message
        arrivals, usage = [], None
        for arrival, event in events:
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if choice.get("logprobs") or any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
                    arrivals.append(arrival)
                _add_delta(message, delta)
        tokens = usage["completion_tokens"] if usage else len(arrivals)
        result = TurnResult(**asdict(request_result(start, arrivals, tokens, self.output_len)))
        result.prompt_tokens = usage["prompt_tokens"] if usage else None
        return result, message


def _add_delta(message: dict, delta: dict) -> None:
    """Assemble a streamed assistant message (tool calls by index, their arguments in pieces)."""
    for key in ("content", "reasoning_content"):
        message[key] += delta.get(key) or ""
    for call in delta.get("tool_calls") or []:
        mine = message["tool_calls"].setdefault(call["index"], {"type": "function", "function": {"arguments": ""}})
        mine["id"] = call.get("id") or mine.get("id")
        function = call.get("function") or {}
        mine["function"]["name"] = function.get("name") or mine["function"].get("name")
        mine["function"]["arguments"] += function.get("arguments") or ""


def _converse(client: _ChatClient, system: str, tools: list[dict], rng: random.Random, args) -> list[dict]:
    """One client's conversation: its turns' figures, up to the first failed turn (the rest cannot be sent)."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": words(rng, args.user_turn_len)})
        result, answer = client(messages, tools)
        result.turn = turn
        turns.append(asdict(result))
        if not result.ok:
            break
        calls = list(answer.pop("tool_calls").values())
        if not answer["reasoning_content"]:
            del answer["reasoning_content"]
        messages.append(answer | ({"tool_calls": calls} if calls else {}))
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": "done"} for call in calls]
    return turns


def scrape_prefix_cache(base_url: str, api_key: str | None, timeout: float) -> dict | None:
    """The server's prefix-cache counters from /metrics ({"queries", "hits", "metric"}), None if it has none."""
    request = urllib.request.Request(base_url + "/metrics", headers=headers(api_key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode("utf-8")
    except (OSError, ValueError):
        return None
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            totals[name] = totals.get(name, 0.0) + float(value)  # summed over label sets
    for queries, hits in PREFIX_CACHE_METRICS:
        if queries in totals and hits in totals:
            return {"queries": totals[queries], "hits": totals[hits], "metric": hits.removesuffix("_hits_total")}
    return None


def _level(clients: int, conversations: list[list[dict]], wall: float, before, after, num_turns: int) -> dict:
    requests = [r for conversation in conversations for r in conversation]
    turns = []
    for turn in range(1, num_turns + 1):
        sent = [r for r in requests if r["turn"] == turn]
        ok = [r for r in sent if r["ok"]]
        ttfts = sorted(r["ttft_s"] for r in ok if r["ttft_s"] is not None)
        prompts = sorted(r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None)
        speeds = [r["decode_tokens_per_s"] for r in ok if r["decode_tokens_per_s"] is not None]
        turns.append(
            {
                "turn": turn,
                "num_requests": len(sent),
                "failed": clients - len(ok),  # a conversation that failed earlier never sent this turn
                "prompt_tokens_p50": percentile(prompts, 50) if prompts else None,
                "ttft_p50_ms": 1000 * percentile(ttfts, 50) if ttfts else None,
                "ttft_p99_ms": 1000 * percentile(ttfts, 99) if ttfts else None,
                "decode_tokens_per_s": statistics.fmean(speeds) if speeds else None,
            }
        )
    prefix_cache = None
    if before is not None and after is not None:
        queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
        prefix_cache = {"metric": after["metric"], "queried_tokens": queries, "hit_tokens": hits}
        prefix_cache["hit_rate"] = hits / queries if queries else 0.0
    return {
        "clients": clients,
        "wall_s": wall,
        "failed": sum(t["failed"] for t in turns),
        "errors": sorted({r["error"] for r in requests if r["error"]})[:5],
        "prefix_cache": prefix_cache,
        "history_share": _history_share(conversations),
        "turns": turns,
        "conversations": conversations,
    }


def _history_share(conversations: list[list[dict]]) -> float | None:
    """Prompt tokens the conversation had already sent or received (previous prompt + answer) over all prompt
    tokens, over the successful turns."""
    prompt = history = 0
    for conversation in conversations:
        previous = 0
        for r in conversation:
            if not r["ok"] or r["prompt_tokens"] is None:
                break
            prompt += r["prompt_tokens"]
            history += min(previous, r["prompt_tokens"])
            previous = r["prompt_tokens"] + r["output_tokens"]
    return history / prompt if prompt else None


def table(result: dict) -> str:
    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    header = ("turn", "prompt tokens p50", "TTFT p50/p99 ms", "decode tok/s", "failed")
    blocks = []
    for level in result["levels"]:
        rows = [
            (
                str(t["turn"]),
                fmt(t["prompt_tokens_p50"], ".0f"),
                f"{fmt(t['ttft_p50_ms'])}/{fmt(t['ttft_p99_ms'])}",
                fmt(t["decode_tokens_per_s"]),
                str(t["failed"]),
            )
            for t in level["turns"]
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *rows]]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        cache = level["prefix_cache"]
        if cache is None:
            hits = "prefix-cache hit rate: - (no prefix-cache counters at /metrics)"
        elif not cache["queried_tokens"]:
            hits = f"prefix-cache hit rate 0 (no prompt token looked up: caching off?, {cache['metric']}_*)"
        else:
            hits = (
                f"prefix-cache hit rate {cache['hit_rate']:.3f} ({cache['hit_tokens']:.0f} of "
                f"{cache['queried_tokens']:.0f} prompt tokens, {cache['metric']}_*)"
            )
        blocks.append(
            "\n".join(
                [
                    f"{level['clients']} clients, {level['wall_s']:.1f} s:",
                    *lines,
                    f"{hits}; history share {fmt(level['history_share'], '.3f')}",
                    *(f"error: {e}" for e in level["errors"]),
                ]
            )
        )
    title = (
        f"{result['model']} at {result['base_url']}, multi-turn: system prompt {result['system_prompt_len']} words "
        f"+ {result['num_tools']} tools, {result['turns']} turns of {result['user_turn_len']} words, "
        f"{result['output_len']} out"
    )
    note = "history share: prompt tokens the conversation had sent or received before (a per-conversation cache)"
    return "\n".join([title, *blocks, note])


def plot(result: dict, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for level in result["levels"]:
        turns = [t for t in level["turns"] if t["ttft_p50_ms"] is not None]
        ax.plot(
            [t["turn"] for t in turns],
            [t["ttft_p50_ms"] for t in turns],
            marker="o",
            label=f"{level['clients']} clients",
        )
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 ms")
    ax.set_title(f"{result['model']}: multi-turn, system prompt {result['system_prompt_len']} words")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
