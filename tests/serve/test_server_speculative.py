"""Strict tool calls with thinking on, a named tool_choice and speculative decoding, 10 requests at once with
~8K-token prompts: every response is a 200 holding one valid call.

The engine is the scripted stand-in, here verifying k drafts a step with the engine's own `verify` (the
sampler's grammar hook, per-position bitmasks, rollback). The script reasons, ends the reasoning with
`</think>` and writes the tool call; the drafts are the script's next tokens, each replaced by a random one
with probability 0.3, so windows are cut at every position and `</think>` often falls inside one.
"""

import json
import random
import threading

import httpx
import jsonschema
import pytest
import torch
from live_server import LiveServer
from scripted_engine import _SCRIPT_BONUS, EOS, VOCAB, ScriptedEngine
from tool_schemas import BOUNDED, NOOP, PAINT

from ds4.engine.async_engine import AsyncEngine
from ds4.engine.sampler import Sampler
from ds4.engine.speculative import SpecDecodeStats, verify
from ds4.serve.app import create_app
from ds4.tokenizer import load_tokenizer

K = 3
THINK_END_ID = 128822
CALL = (
    "</think>\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="paint">\n'
    '<｜DSML｜parameter name="color" string="true">green</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="count" string="false">4</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


class SpeculativeScriptedEngine(ScriptedEngine):
    """Each step verifies up to K drafts per request and emits the kept tokens, up to the one that finishes it."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, max_model_len=16384, step_delay_s=0.0)
        self.sampler = Sampler(eos_token_ids=(EOS,))
        self.rng = random.Random(0)
        self.spec = SpecDecodeStats(K)
        self.think_end_inside = 0  # windows that kept </think> as a draft after the first position
        self._lock = threading.Lock()

    def _advance(self, request):
        script = self._scripts[request.request_id] or []
        done = len(request.output_token_ids)
        drafts = [t if self.rng.random() > 0.3 else self.rng.randrange(2, VOCAB) for t in script[done : done + K]]
        logits = torch.randn(len(drafts) + 1, VOCAB, generator=request.generator)
        for j in range(len(drafts) + 1):
            if done + j < len(script):
                logits[j, script[done + j]] += _SCRIPT_BONUS
        kept = verify(self.sampler, logits, [request], [drafts])[0]
        if drafts:
            self.spec.record(len(drafts), len(kept) - 1)
        if THINK_END_ID in kept[1:-1]:
            self.think_end_inside += 1
        text, reason = "", None
        for token_id in kept:
            request.output_token_ids.append(token_id)
            self._counts["generation"] += 1
            if token_id == EOS:
                reason = "stop"
            elif len(request.output_token_ids) >= request.params.max_tokens:
                reason = "length"
            if reason != "stop":
                text += request.detokenizer.add_token(token_id)
            if reason is not None:
                break
        if reason is not None:
            text += request.detokenizer.flush()
            del self._requests[request.request_id]
            self._counts["finished"] += 1
        return self._output(request, request.output_token_ids[done:], text, reason, None)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = SpeculativeScriptedEngine(tokenizer)
    engine.script = tokenizer.encode("The user wants paint; call it." + CALL) + [EOS]
    live = LiveServer(create_app(AsyncEngine(engine), served_model_names="ds4-test"))
    yield engine, live
    live.stop()


def test_concurrent_strict_tool_calls_under_speculation_never_fail(served):
    engine, live = served
    long_text = " ".join(f"word{i}" for i in range(4000))  # ~8K tokens
    body = {
        "model": "ds4-test",
        "messages": [{"role": "user", "content": long_text + " Paint something."}],
        "tools": [PAINT, NOOP],
        "tool_choice": {"type": "function", "function": {"name": "paint"}},
        "max_tokens": 300,
        "temperature": 0,
        "chat_template_kwargs": {"thinking": True},
    }
    replies = [None] * 10

    def ask(i):
        with httpx.Client(timeout=120) as client:
            replies[i] = client.post(live.url + "/v1/chat/completions", json={**body, "stream": i % 2 == 1})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.status_code for r in replies] == [200] * 10
    for i, reply in enumerate(replies):
        calls, reasoning = _tool_calls(reply, stream=i % 2 == 1)
        assert [name for name, _ in calls] == ["paint"], reply.text[:500]
        jsonschema.validate(calls[0][1], BOUNDED)
        assert "DSML" not in reasoning
    stats = engine.spec
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.think_end_inside > 0
    assert engine.stats().num_running == 0


def _tool_calls(reply, stream):
    if not stream:
        message = reply.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        return calls, message.get("reasoning_content") or ""
    calls, reasoning = {}, ""
    for line in reply.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name") or ""
                entry["arguments"] += call["function"].get("arguments") or ""
    return [(c["name"], json.loads(c["arguments"])) for c in calls.values()], reasoning
