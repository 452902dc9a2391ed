"""A mutation fuzz of the live server on the built-in tiny model: well over 1000 malformed and odd chat and
completion requests, streaming and not, get no 5xx and no dropped connection; every error is OpenAI's error
JSON; afterwards the server is healthy, idle, and every cache page is free.

Mutations: a field set to a value of the wrong type or an extreme one, a field dropped, an unknown field, a
string with a lone surrogate or control tokens, a nested value replaced, and raw-text damage (cut JSON, a
duplicated key, NaN, deep nesting, invalid UTF-8, a body over the size limit).
"""

import asyncio
import collections
import json
import logging
import random

import httpx
import pytest
from live_server import LiveServer

from ds4.engine.async_engine import AsyncEngine
from ds4.engine.engine import LLMEngine
from ds4.serve.app import create_app

NUM_REQUESTS = 1000
CONCURRENCY = 16
MAX_BODY = 64 << 10
# Short, so that a request whose max_tokens a mutation removed still ends soon.
MAX_MODEL_LEN = 96
TOOL = {
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {"loud": {"type": "boolean"}}}},
}
BASES = [
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3}),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Ping?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "ping", "arguments": '{"loud": true}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "pong"},
            ],
            "tools": [TOOL],  # checked, but with tool_choice none not rendered: the tools section is long
            "tool_choice": "none",
            "max_tokens": 2,
            "temperature": 0.7,
            "seed": 3,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "JSON please"}],
            "response_format": {"type": "json_object"},
            "chat_template_kwargs": {"thinking": False},
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "n": 2,
        },
    ),
    ("/v1/completions", {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 3, "stop": ["\n"]}),
    (
        "/v1/completions",
        {"prompt": [[0, 5, 9, 13], [0, 7]], "n": 2, "echo": True, "logprobs": 2, "max_tokens": 1, "seed": 11},
    ),
    ("/v1/completions", {"prompt": ["a b c", "d e"], "max_tokens": 0, "echo": True, "logprobs": 0, "top_k": 5}),
]
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "logprobs",
    "top_logprobs", "echo", "suffix", "best_of", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "reasoning_effort", "chat_template_kwargs", "continue_final_message", "user",
    "skip_special_tokens", "include_stop_str_in_output", "frobnicate", "functions",
]  # fmt: skip
VALUES = [
    None, True, False, 0, 1, 2, 3, -1, 20, 21, 1024, 1025, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30,
    0.5, 1.5, 2.0000001, -0.0, 1e-300, 1e308, -1e308, "", "x", "auto", "required", "none", "\ud800",
    "a" * 3000, "[" * 3000 + "]" * 3000, [], [1], [[]], [None], ["a", 1], [0, 5], ["stop"], {}, {"a": 1},
    {"type": "text"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}},
    {"type": "function", "function": {"name": "ping"}}, {"thinking": "no"}, {"include_usage": True},
    {"1": 100}, {"-5": 1}, [{"role": "user"}], [{"role": "tool", "content": "x"}], [TOOL, TOOL],
    [{"type": "function", "function": {"name": "bad", "parameters": {"type": "nope"}}}],
]  # fmt: skip
STRINGS = ["\ud800", "\udfff", "\x00", "<｜end▁of▁sentence｜>", "</think>", "｜DSML｜", "\u202e", "🙂", "\\", '"']


def _leaves(value, path=()):
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _leaves(child, (*path, key))


def _replace(payload, path, new):
    if not path:
        return new
    parent = payload
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return payload


def _mutate(rng: random.Random, payload: dict):
    """One mutation: a new payload (dict or other JSON value) or raw bytes."""
    kind = rng.randrange(10)
    if kind == 0:
        payload[rng.choice(FIELDS)] = rng.choice(VALUES)
    elif kind == 1 and payload:
        del payload[rng.choice(list(payload))]
    elif kind == 2:
        path = rng.choice(list(_leaves(payload)))
        return _replace(payload, path, rng.choice(VALUES))
    elif kind == 3:
        strings = [p for p in _leaves(payload) if p and isinstance(_get(payload, p), str)]
        if strings:
            path = rng.choice(strings)
            text = _get(payload, path)
            cut = rng.randrange(len(text) + 1)
            return _replace(payload, path, text[:cut] + rng.choice(STRINGS) + text[cut:])
    elif kind == 4:
        raw = json.dumps(payload).encode()
        damage = rng.randrange(7)
        if damage == 0:
            return raw[: rng.randrange(len(raw))]
        if damage == 1:
            return raw[:-1] + b', "max_tokens": 2, "max_tokens": 2}'
        if damage == 2:
            return raw[:-1] + b', "temperature": NaN}'
        if damage == 3:
            return raw[:-1] + b', "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        if damage == 4:
            cut = rng.randrange(len(raw))
            return raw[:cut] + b"\xff\xfe" + raw[cut:]
        if damage == 5:
            return raw[:-1] + b', "user": "' + b"x" * MAX_BODY + b'"}'
        return raw[:-1] + b', "top_p": 1e999}'
    return payload


def _get(payload, path):
    for key in path:
        payload = payload[key]
    return payload


def _requests(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        path, base = rng.choice(BASES)
        payload = json.loads(json.dumps(base))
        payload["stream"] = rng.random() < 0.5
        if payload["stream"] and rng.random() < 0.5:
            payload["stream_options"] = {"include_usage": True}
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            if not isinstance(payload, dict):
                break
            payload = _mutate(rng, payload)
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        yield path, body


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_pretrained(
        device="cpu",
        seed=0,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        kv_cache_memory=64 << 20,
        max_model_len=MAX_MODEL_LEN,
    )
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="tiny", max_body_bytes=MAX_BODY))
    yield live
    live.stop()


async def _send(client, path, body, statuses, problems):
    try:
        async with client.stream("POST", path, content=body) as response:
            raw = await response.aread()
    except httpx.HTTPError as e:
        statuses["dropped"] += 1
        problems.append(f"{path} {body[:200]!r}: {e!r}")
        return
    statuses[response.status_code] += 1
    text = raw.decode()
    if response.status_code >= 500:
        problems.append(f"{path} {body[:200]!r}: {response.status_code} {text[:300]}")
    elif response.status_code >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], text
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if events[-1] != "[DONE]" or any("error" in json.loads(e) for e in events[:-1]):
            problems.append(f"{path} {body[:200]!r}: stream {text[-300:]}")
    else:
        assert json.loads(text)["choices"], text


def test_fuzz_gets_no_5xx_and_leaves_the_server_clean(server):
    statuses: collections.Counter = collections.Counter()
    problems: list[str] = []
    errors = []  # anything logged at ERROR: an exception escaped somewhere, even if the client saw a 4xx
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    loggers = [logging.getLogger(name) for name in ("ds4", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)

    async def run():
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(path, body):
                async with gate:
                    await _send(client, path, body, statuses, problems)

            await asyncio.gather(*(one(path, body) for path, body in _requests(23, NUM_REQUESTS)))

    try:
        asyncio.run(run())
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    print(f"\nfuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items(), key=str))}")
    assert not problems, "\n".join(problems[:10])
    assert not errors, [record.getMessage() for record in errors[:5]]
    assert sum(statuses.values()) == NUM_REQUESTS >= 1000
    ok = statuses[200]
    assert ok >= NUM_REQUESTS // 5 and NUM_REQUESTS - ok >= NUM_REQUESTS // 5  # both paths were exercised
    state = server.server.config.app.state.ds4
    for _ in range(100):
        stats = state.engine.stats()
        if state.active_requests == 0 and stats.num_free_pages == stats.num_pages and stats.num_running == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert state.active_requests == 0
    assert stats.num_free_pages == stats.num_pages and stats.num_running == stats.num_waiting == 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "still fine", "max_tokens": 2}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
