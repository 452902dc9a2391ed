"""The live server on the built-in tiny random model, through the official openai client.

Random weights write endless free text, so strict-output tests use schemas whose values are bounded
(enums, booleans, bounded integers): only the grammar can make the output well formed.
"""

import json

import httpx
import jsonschema
import openai
import pytest
from live_server import LiveServer

from ds4.engine.async_engine import AsyncEngine
from ds4.engine.engine import LLMEngine
from ds4.serve.app import create_app

BOUNDED = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "urgent": {"type": "boolean"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "urgent", "days"],
}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": BOUNDED}}
PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"]},
    },
}
USER = [{"role": "user", "content": "Weather?"}]
CHAT = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine.from_pretrained(
        device="cpu", seed=0, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory=64 << 20, max_model_len=2048
    )
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="tiny"))
    yield live
    live.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_chat_stream_equals_non_stream(client):
    kwargs = dict(model="tiny", messages=USER, max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    message = reply.choices[0].message
    streamed_reasoning = "".join(
        c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices
    )
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_reasoning, streamed_content) == (
        message.model_extra["reasoning_content"] or "",
        message.content or "",
    )
    assert reply.usage.completion_tokens == chunks[-1].usage.completion_tokens == 8
    assert reply.choices[0].finish_reason == "length"


def test_completions_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=7)
    first = client.completions.create(**kwargs).choices[0].text
    assert first == client.completions.create(**kwargs).choices[0].text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "forecast"}}])
def test_strict_tool_call_from_random_weights_validates(client, tool_choice):
    # One call (parallel_tool_calls=False) keeps the output short: random weights love the allowed blanks.
    choice = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[FORECAST, PING],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
        extra_body=CHAT,
    ).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1 and not choice.message.content
    schemas = {"forecast": BOUNDED, "ping": PING["function"]["parameters"]}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    if isinstance(tool_choice, dict):
        assert {call.function.name for call in choice.message.tool_calls} == {"forecast"}


def test_json_schema_from_random_weights_validates_in_every_choice(client):
    # Two sampled choices: each needs its own grammar matcher, or one would advance the other's.
    response_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": BOUNDED}}
    reply = client.chat.completions.create(
        model="tiny",
        messages=USER,
        response_format=response_format,
        max_tokens=300,
        temperature=1.0,
        seed=4,
        n=2,
        extra_body=CHAT,
    )
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), BOUNDED)


@pytest.mark.parametrize(
    "parameters",
    [{"type": "nope"}, {"type": "object", "properties": 5}, {"type": "object", "properties": {"a": {"$ref": "#/x"}}}],
)
def test_bad_tool_schema_of_a_strict_call_is_a_400_naming_tools(server, parameters):
    tool = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    body = {"model": "tiny", "messages": USER, "tools": [tool], "tool_choice": "required", "max_tokens": 4}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "tools"
