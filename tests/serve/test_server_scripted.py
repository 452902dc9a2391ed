"""The live server over a scripted token source (real AsyncEngine, grammar hook, detokenizer, parser), with the
official openai client: chat streaming and not, reasoning, DSML tool calls, strict grammars, tokenize, metrics."""

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer
from scripted_engine import ScriptedEngine
from tool_schemas import BOUNDED, NOOP, PAINT

from ds4.engine.async_engine import AsyncEngine
from ds4.serve.app import create_app
from ds4.serve.chat_encoding import encode_chat_request
from ds4.tokenizer import load_tokenizer

VECTORS = Path(__file__).resolve().parents[1] / "data" / "encoding"
THINK_END = "</think>"
CHAT = {"chat_template_kwargs": {"thinking": False}}
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return ScriptedEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="ds4-test"))
    yield live
    live.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def script(engine, tokenizer, text, eos=True):
    engine.script = tokenizer.encode(text) + ([1] if eos else [])


def test_chat_thinking_splits_reasoning_and_content(client, engine, tokenizer):
    script(engine, tokenizer, f"Let me think.{THINK_END}Hello there!")
    reply = client.chat.completions.create(model="ds4-test", messages=USER, max_tokens=40)
    message = reply.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra["reasoning_content"] == "Let me think."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(engine.script)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(encode_chat_request(USER).text))


def test_chat_stream_equals_non_stream_and_reports_usage(client, engine, tokenizer):
    script(engine, tokenizer, f"Plan: answer.{THINK_END}Paris is the capital.")
    chunks = list(
        client.chat.completions.create(
            model="ds4-test", messages=USER, max_tokens=40, stream=True, stream_options={"include_usage": True}
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("Plan: answer.", "Paris is the capital.")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(engine.script)


def test_dsml_tool_calls_become_tool_calls_and_never_content(client, engine, tokenizer):
    text = (VECTORS / "test_output_1.txt").read_text()
    start = text.index("</think>\n\n<｜DSML｜tool_calls>")
    end = text.index("</｜DSML｜tool_calls>", start) + len("</｜DSML｜tool_calls>")
    tools = json.loads((VECTORS / "test_input_1.json").read_text())["tools"]
    script(engine, tokenizer, "Weather needed." + text[start:end])
    for stream in (False, True):
        kwargs = dict(model="ds4-test", messages=USER, tools=tools, max_tokens=200)
        if stream:
            calls, content = {}, ""
            for c in client.chat.completions.create(stream=True, **kwargs):
                content += c.choices[0].delta.content or ""
                for call in c.choices[0].delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                finish = c.choices[0].finish_reason or "none"
            got = [(v["name"], json.loads(v["arguments"])) for v in calls.values()]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
            assert choice.message.tool_calls[0].id.startswith("call_")
        assert got == [("get_weather", {"location": "Beijing", "unit": "celsius"})]
        assert "DSML" not in content and finish == "tool_calls"


def _tool_calls(choice):
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "noop"}}])
def test_strict_tool_choice_over_noise_gives_valid_calls(client, engine, tool_choice):
    engine.script = None  # free-running noise: only the grammar can make this a tool call
    choice = client.chat.completions.create(
        model="ds4-test", messages=USER, tools=[PAINT, NOOP], tool_choice=tool_choice, max_tokens=400, extra_body=CHAT
    ).choices[0]
    calls = _tool_calls(choice)
    assert calls and choice.finish_reason == "tool_calls" and not choice.message.content
    schemas = {"paint": BOUNDED, "noop": NOOP["function"]["parameters"]}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    if isinstance(tool_choice, dict):
        assert {name for name, _ in calls} == {"noop"}


def test_parallel_tool_calls_false_gives_one_call(client, engine):
    engine.script = None
    for seed in range(3):
        choice = client.chat.completions.create(
            model="ds4-test",
            messages=USER,
            tools=[NOOP],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
            extra_body=CHAT,
        ).choices[0]
        assert len(_tool_calls(choice)) == 1


def test_json_schema_over_noise_validates(client, engine):
    engine.script = None
    response_format = {"type": "json_schema", "json_schema": {"name": "paint", "schema": BOUNDED, "strict": True}}
    for seed in range(2):
        reply = client.chat.completions.create(
            model="ds4-test", messages=USER, response_format=response_format, max_tokens=200, seed=seed, extra_body=CHAT
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content), BOUNDED)


def test_thinking_mode_grammar_starts_after_reasoning(client, engine, tokenizer):
    # The script reasons (grammar off), ends the reasoning, then tries to write prose: the grammar forbids it.
    script(engine, tokenizer, f"I will answer in JSON, not 'Sure!'.{THINK_END}Sure! Here", eos=False)
    response_format = {"type": "json_schema", "json_schema": {"name": "paint", "schema": BOUNDED}}
    reply = client.chat.completions.create(
        model="ds4-test", messages=USER, max_tokens=200, response_format=response_format
    )
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "I will answer in JSON, not 'Sure!'."
    jsonschema.validate(json.loads(message.content), BOUNDED)


def test_stray_think_end_in_chat_mode_is_tolerated(client, engine, tokenizer):
    script(engine, tokenizer, f'{THINK_END}{{"color": "red", "ok": true, "count": 7}}')
    response_format = {"type": "json_schema", "json_schema": {"name": "paint", "schema": BOUNDED}}
    reply = client.chat.completions.create(
        model="ds4-test", messages=USER, max_tokens=100, response_format=response_format, extra_body=CHAT
    )
    assert json.loads(reply.choices[0].message.content) == {"color": "red", "ok": True, "count": 7}


def test_logprobs(client, engine, tokenizer):
    script(engine, tokenizer, f"x{THINK_END}ok")
    reply = client.chat.completions.create(
        model="ds4-test", messages=USER, max_tokens=10, logprobs=True, top_logprobs=3
    )
    entries = reply.choices[0].logprobs.content
    assert [e.token for e in entries] == [tokenizer.decode([t]) for t in engine.script]
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)


def test_completions_stream_and_not(client, engine, tokenizer):
    script(engine, tokenizer, "The end.")
    text = client.completions.create(model="ds4-test", prompt="Once", max_tokens=20).choices[0].text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="ds4-test", prompt="Once", max_tokens=20, stream=True)
    )
    assert text == streamed == "The end."


def test_tokenize_messages_equals_the_official_encoding(server, tokenizer):
    data = json.loads((VECTORS / "test_input_1.json").read_text())
    official = (VECTORS / "test_output_1.txt").read_text()
    # Vector 1 without its final assistant turn: the official text up to that turn's opening `<think>`.
    expected_text = official[: official.rindex("<｜Assistant｜>")] + "<｜Assistant｜><think>"
    body = {"messages": data["messages"][:-1], "tools": data["tools"], "model": "ds4-test"}
    got = httpx.post(server.url + "/tokenize", json=body).json()
    assert got["tokens"] == tokenizer.encode(expected_text) and got["count"] == len(got["tokens"])
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == expected_text
    prompt = httpx.post(server.url + "/tokenize", json={"prompt": "hello"}).json()
    assert prompt["tokens"] == [0] + tokenizer.encode("hello")


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["ds4-test"]
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "ds4_time_to_first_token_seconds_bucket",
        "ds4_inter_token_latency_seconds_bucket",
        "ds4_num_requests_running",
        "ds4_num_requests_waiting",
        "ds4_cache_usage_ratio",
        "ds4_num_preemptions_total",
        "ds4_prompt_tokens_total",
        "ds4_generation_tokens_total",
        'ds4_requests_total{endpoint="/v1/chat/completions",status="200"}',
    ):
        assert name in metrics, name
