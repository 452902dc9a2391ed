"""Tensor and expert parallelism through `LLM` and the server's app: N ranks (processes over gloo) give what one
rank gives on the tiny official-format model, in fp32: identical greedy tokens (with MTP speculation and prefix
caching, whose snapshot copies and draft steps the other ranks mirror), prompt logprobs within 1e-5."""

import json

import httpx
import pytest
from live_server import LiveServer

from ds4 import LLM, SamplingParams
from ds4.checkpoint.tiny import make_tiny
from ds4.engine.async_engine import AsyncEngine
from ds4.engine.config import EngineConfigError
from ds4.engine.structured_output import GrammarCache, grammar_tokenizer_info
from ds4.serve.app import create_app

# The tiny model with output groups that split 4 ways (the CPU holds weights dequantised: no FP8 block to keep whole).
SPLITTABLE = {"o_groups": 4}
ENGINE = dict(
    device="cpu",
    dtype="float32",
    seed=0,
    kv_cache_memory=64 << 20,
    max_model_len=1024,
    page_size=16,  # prefix caching resumes from page ends: short prompts share whole pages
    max_num_seqs=4,
    speculative_config={"method": "mtp", "num_speculative_tokens": 2},
)
SHARED = [0, 9906, 11, 1917, 0, 128803, 3923, 374, 279, 6864, 315, 9822, 30, 128804, 128822, 791, 6864, 315] * 2
PROMPTS = [SHARED + [1000, 2000, 3000], SHARED + [4000], [0, 42, 4242, 424]]
PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {"loud": {"type": "boolean"}}, "required": ["loud"]},
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tp") / "tiny", format="official", seed=5, config_overrides=SPLITTABLE)


@pytest.fixture(scope="module")
def reference(model_dir):
    """One rank: the outputs every layout must reproduce."""
    with LLM(model_dir, **ENGINE) as llm:
        return _offline(llm), _served(llm)


def _offline(llm: LLM) -> list:
    first = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2), use_tqdm=False)
    # The second prompt resumes after the first's cached pages (a snapshot restore), in a batch with the third.
    rest = llm.generate(PROMPTS[1:], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hit_tokens > 0
    return [(o.token_ids, o.prompt_logprobs) for o in first + rest]


def _grammars(llm: LLM) -> GrammarCache:
    """Random weights fill every blank a grammar allows: one at most keeps the tool call short."""
    info = grammar_tokenizer_info(llm.tokenizer.backend, llm.engine.model.cfg.vocab_size, llm.tokenizer.special.eos)
    return GrammarCache(info, max_whitespace=1)


def _served(llm: LLM) -> tuple[str, dict]:
    """One streaming chat request and one strict tool call through the server's app on this engine."""
    live = LiveServer(create_app(AsyncEngine(llm.engine), served_model_names="tiny", grammar_cache=_grammars(llm)))
    try:
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "temperature": 0,
            "chat_template_kwargs": {"thinking": False},
        }
        text = ""
        with httpx.stream("POST", live.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        tool = {**chat, "max_tokens": 300, "tools": [PING], "tool_choice": "required", "parallel_tool_calls": False}
        reply = httpx.post(live.url + "/v1/chat/completions", json=tool, timeout=120).json()
        assert "choices" in reply and reply["choices"][0]["finish_reason"] == "tool_calls", reply
        call = reply["choices"][0]["message"]["tool_calls"][0]["function"]
        return text, {"name": call["name"], "arguments": json.loads(call["arguments"])}
    finally:
        live.stop()  # the app's shutdown stops the engine's other ranks too


@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_parallel_size=2),
        dict(tensor_parallel_size=4),
        dict(tensor_parallel_size=2, enable_expert_parallel=True),
    ],
    ids=["tp2", "tp4", "ep2"],
)
def test_parallel_layout_equals_one_rank(model_dir, reference, layout):
    offline, served = reference
    with LLM(model_dir, **ENGINE, **layout) as llm:
        got = _offline(llm)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in offline]
        prompt_logprobs, expected = got[0][1], offline[0][1]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(expected) == len(PROMPTS[0])
        errors = []
        for pos in range(1, len(expected)):
            assert prompt_logprobs[pos].keys() == expected[pos].keys(), pos
            # 1e-5 relative to the logprob's size (fp32 sums in another order: expert parallel adds the ranks'
            # experts as partial sums), absolute below 1.
            errors += [abs(prompt_logprobs[pos][t] - lp) / max(1.0, abs(lp)) for t, lp in expected[pos].items()]
        assert max(errors) < 1e-5, max(errors)
        assert _served(llm) == served


def test_layout_that_does_not_split_is_refused_before_reading(tmp_path):
    # 4 heads do not split 3 ways; the error names the reason and no weight file is opened (there is none).
    model = make_tiny(tmp_path / "tiny", format="official", config_overrides=SPLITTABLE)
    for shard in model.glob("*.safetensors"):
        shard.unlink()
    with pytest.raises(EngineConfigError, match="num_attention_heads"):
        LLM(model, device="cpu", tensor_parallel_size=3)
