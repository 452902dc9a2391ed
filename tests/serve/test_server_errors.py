"""Bad input gets OpenAI error JSON with the right status; auth; shutdown; disconnects free pages; 64 streams."""

import asyncio
import json
import logging

import httpx
import pytest
from live_server import LiveServer
from scripted_engine import ScriptedEngine

from ds4.engine.async_engine import AsyncEngine
from ds4.serve.app import create_app
from ds4.tokenizer import load_tokenizer

USER = [{"role": "user", "content": "hi"}]
KEY = "sk-test-key"
MAX_BODY = 1 << 20
DEEP_ARGUMENTS = "[" * 100_000 + "]" * 100_000  # a string in the body, nested JSON inside it
DEEP_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGUMENTS}}],
}


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(load_tokenizer(), max_model_len=256)


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(
        create_app(AsyncEngine(engine), served_model_names="ds4-test", api_key=KEY, max_body_bytes=MAX_BODY)
    )
    yield live
    live.stop()


def post(server, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if not isinstance(body, (bytes, str)):
        body = json.dumps(body)  # escapes lone surrogates, which httpx's own encoder refuses
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30, **kwargs)


def chat(**fields):
    return {"model": "ds4-test", "messages": USER, "max_tokens": 4, **fields}


def assert_error(response, status, *fragments):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"]
    return error


def test_auth(server):
    assert_error(post(server, "/v1/chat/completions", chat(), key=None), 401, "API key")
    assert_error(post(server, "/v1/chat/completions", chat(), key="wrong"), 401)
    assert_error(post(server, "/tokenize", {"prompt": "x"}, key=None), 401)
    assert post(server, "/v1/chat/completions", chat()).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # open: load balancers probe it
    assert httpx.get(server.url + "/metrics").status_code == 200


@pytest.mark.parametrize(
    "body, status, param, fragment",
    [
        (chat(n=0), 400, "n", "greater than or equal to 1"),
        (chat(best_of=3), 400, "best_of", "best_of=3"),
        (chat(seed=2**64), 400, "seed", "less than or equal"),
        (chat(stop=5), 400, "stop", "valid string or"),
        (chat(temperature="hot"), 400, "temperature", "number"),
        (chat(logit_bias={"999999999": 1}), 400, "logit_bias", "outside the vocabulary"),
        (chat(frobnicate=True), 400, "frobnicate", "unknown field"),
        (chat(user="u-1", metadata={"k": "v"}, frobnicate=1), 400, "frobnicate", "unknown field"),
        (chat(chat_template_kwargs={"thinking": "yes"}), 400, "chat_template_kwargs", "boolean"),
        (chat(messages=[{"role": "user", "content": "\ud800"}]), 400, "messages.0.content", "surrogate"),
        (
            chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
            400,
            "tools.0.function.parameters",
            "dict",
        ),
        (chat(temperature=-1), 400, "temperature", "temperature"),
        (chat(messages=[]), 400, "messages", "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages", "wizard"),
        (chat(tool_choice="required"), 400, None, "tool_choice needs tools"),
        (chat(top_logprobs=2), 400, None, "logprobs"),
        (chat(response_format={"type": "json_schema"}), 400, "response_format", "json_schema"),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}),
            400,
            "response_format",
            "grammar",
        ),
        (chat(max_tokens=0), 400, "max_tokens", "max_tokens"),
        (chat(max_tokens=10_000), 400, "max_tokens", "context length"),
        (chat(messages=[{"role": "user", "content": "word " * 400}]), 400, "messages", "context length"),
        (chat(model="gpt-4"), 404, "model", "gpt-4"),
        ({"model": "ds4-test", "prompt": ["a", 1]}, 400, "prompt", "list of token ids"),
        ({"model": "ds4-test", "prompt": [[]]}, 400, "prompt", "empty"),
        ({"model": "ds4-test", "prompt": [1, 10**30]}, 400, "prompt", "outside the vocabulary"),
        ({"model": "ds4-test", "prompt": "\udfff x"}, 400, "prompt", "surrogate"),
        ({"model": "ds4-test", "prompt": ["a"] * 600, "n": 2}, 400, None, "more than 1024 choices"),
        ({"model": "ds4-test", "prompt": "a", "suffix": "b"}, 400, "suffix", "not supported"),
    ],
)
def test_bad_requests(server, body, status, param, fragment):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    error = assert_error(post(server, path, body), status, fragment)
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "raw, status, fragment",
    [
        (b'{"model": "ds4-test", "messages": [', 422, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 422, "NaN"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "max_tokens": 3}', 400, "twice"),
        (b'{"messages": [{"role": "user", "content": "\xff"}]}', 422, "not valid JSON"),
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 422, "nests deeper"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b'{"a":' * 80 + b"1" + b"}" * 81,
            400,
            "nests",
        ),
        (b'["not", "an", "object"]', 400, "JSON object"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1e999}', 400, "presence_penalty"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": -1e999}', 400, "repetition_penalty"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e999}', 400, "finite"),
    ],
)
def test_malformed_json(server, raw, status, fragment):
    assert_error(post(server, "/v1/chat/completions", raw), status, fragment)


def test_huge_body_is_413_and_the_connection_survives(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
        body = b'{"prompt": "' + b"x" * (MAX_BODY + 1) + b'"}'
        assert_error(client.post("/v1/completions", content=body), 413, "at most")
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200


def test_unknown_path_and_method_get_openai_errors(server):
    assert_error(httpx.get(server.url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404)
    assert_error(httpx.get(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}), 405)


def test_a_server_failure_is_500_and_logged_once(server, engine, monkeypatch):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in ("ds4", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "check_request", broken)
    try:
        assert_error(post(server, "/v1/chat/completions", chat()), 500, "RuntimeError: boom")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert [r.exc_info is not None for r in records] == [True]


def test_shutting_down_is_503(server):
    state = server.server.config.app.state.ds4
    state.shutting_down = True
    try:
        assert_error(post(server, "/v1/chat/completions", chat()), 503, "shutting down")
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        state.shutting_down = False
    assert post(server, "/v1/chat/completions", chat()).status_code == 200


async def _wait_until(condition, timeout_s=10.0):
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


def test_disconnects_abort_and_free_pages(server, engine):
    engine.script = None  # endless noise: only an abort ends these requests
    total = engine.stats().num_pages

    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=30) as client:
            async with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=200, stream=True)) as r:
                lines = r.aiter_lines()
                for _ in range(5):
                    await lines.__anext__()
                assert engine.stats().num_free_pages < total
            assert await _wait_until(lambda: engine.stats().num_free_pages == total, timeout_s=5.0)
            with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
                await client.post("/v1/chat/completions", json=chat(max_tokens=200), timeout=0.3)
            assert await _wait_until(lambda: engine.stats().num_free_pages == total, timeout_s=5.0)

    engine.step_delay_s = 0.1  # 200 tokens take 20 s: only an abort frees the pages within the 5 s waited
    try:
        asyncio.run(run())
    finally:
        engine.step_delay_s = 0.0005
    assert engine.stats().num_running == 0 and server.server.config.app.state.ds4.active_requests == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_64_concurrent_streams_complete_and_memory_stays_flat(server, engine):
    engine.script = None

    async def one(client, i):
        body = chat(max_tokens=12, stream=True, seed=i, stream_options={"include_usage": True})
        events = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

    async def round_of_64():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60, limits=limits
        ) as client:
            await asyncio.gather(*(one(client, i) for i in range(64)))

    asyncio.run(round_of_64())  # warm-up: first-use allocations
    before = _rss_bytes()
    engine.max_running = 0
    for _ in range(2):
        asyncio.run(round_of_64())
    assert engine.max_running > 8  # the streams really ran side by side
    assert engine.stats().num_free_pages == engine.stats().num_pages
    assert server.server.config.app.state.ds4.active_requests == 0
    assert _rss_bytes() - before < 64 << 20
