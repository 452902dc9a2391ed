"""Strict output: xgrammar masks over the real DSv4 tokenizer, gated on </think>, checked against independent oracles
(the official encoding vector's DSML tool call, json.loads + jsonschema on random walks through the mask)."""

import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from tool_schemas import BOUNDED, PAINT

from ds4.engine.structured_output import (
    GrammarCache,
    GrammarError,
    GrammarSpec,
    StructuredOutput,
    apply_structured_output,
    grammar_tokenizer_info,
)
from ds4.tokenizer import default_tokenizer_path

VOCAB = 129280
EOS, THINK_START, THINK_END = 1, 128821, 128822
USER = 128803
VECTORS = Path(__file__).resolve().parents[1] / "data" / "encoding"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(default_tokenizer_path()))


@pytest.fixture(scope="module")
def cache(tokenizer):
    grammars = GrammarCache(grammar_tokenizer_info(tokenizer, VOCAB, EOS))
    yield grammars
    grammars.close()


def new_state(cache, spec, reasoning=False):
    return StructuredOutput(cache.compile(spec), reasoning=reasoning, think_end_token_id=THINK_END, eos_token_id=EOS)


def allowed(state):
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    constrained = state.fill_bitmask(bitmask, 0)
    bits = ((bitmask[0].view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:VOCAB]
    return set(bits.nonzero().flatten().tolist()) if constrained else None


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def random_walk(state, rng, max_steps=3000):
    """Follow the mask with uniformly random allowed tokens until EOS; the tokens before EOS."""
    out = []
    for _ in range(max_steps):
        choice = rng.choice(sorted(allowed(state)))
        assert state.accept(choice)
        if choice == EOS:
            assert state.is_terminated()
            return out
        out.append(choice)
    raise AssertionError(f"no EOS after {max_steps} grammar steps")


def official_tool_call():
    """The assistant's DSML tool call in official vector 1 (from the blank lines to the closing tag)."""
    text = (VECTORS / "test_output_1.txt").read_text()
    start = text.index("</think>\n\n<｜DSML｜tool_calls>") + len("</think>")
    end = text.index("</｜DSML｜tool_calls>", start) + len("</｜DSML｜tool_calls>")
    return text[start:end]


def official_tools():
    return json.loads((VECTORS / "test_input_1.json").read_text())["tools"]


def parse_dsml(text):
    """Independent reading of a DSML block: [(name, {param: value})], JSON values for string="false"."""
    calls = []
    for name, body in re.findall(r'<｜DSML｜invoke name="([^"]+)">\n(.*?)</｜DSML｜invoke>', text, re.S):
        params = {}
        for key, is_string, value in re.findall(
            r'<｜DSML｜parameter name="([^"]+)" string="(true|false)">(.*?)</｜DSML｜parameter>', body, re.S
        ):
            params[key] = value if is_string == "true" else json.loads(value)
        calls.append((name, params))
    return calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_official_tool_call_is_accepted_token_by_token(cache, tokenizer, tool_choice):
    state = new_state(cache, GrammarSpec.tool_calls(official_tools(), tool_choice))
    for token_id in tokenizer.encode(official_tool_call(), add_special_tokens=False).ids:
        assert token_id in allowed(state), decode(tokenizer, [token_id])
        assert state.accept(token_id)
    assert allowed(state) == {EOS}
    assert state.accept(EOS) and state.is_terminated()


def test_required_tool_call_rejects_text_and_control_tokens(cache, tokenizer):
    state = new_state(cache, GrammarSpec.tool_calls(official_tools(), "required"))
    first = allowed(state) - {THINK_END}  # chat mode: the one stray </think> DSv4 may open with
    assert not {EOS, USER, THINK_START} & first
    assert all("\n\n<｜DSML｜tool_calls>".startswith(decode(tokenizer, [t])) for t in first)
    assert not state.accept(tokenizer.token_to_id("Hello"))
    assert allowed(state) == {EOS}  # a rejected token steers the request to its end instead of failing it


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_under_required_tools_parses_and_validates(cache, tokenizer, seed):
    tools = [
        PAINT,
        {
            "type": "function",
            "function": {
                "name": "noop",
                "parameters": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
            },
        },
    ]
    state = new_state(cache, GrammarSpec.tool_calls(tools, "required"))
    text = decode(tokenizer, random_walk(state, random.Random(seed)))
    assert text.startswith("\n\n<｜DSML｜tool_calls>\n") and text.endswith("</｜DSML｜tool_calls>")
    calls = parse_dsml(text)
    assert calls
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])


def test_parallel_tool_calls_false_allows_one_call(cache, tokenizer):
    one = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="noop">\n</｜DSML｜invoke>\n'
    tools = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]
    second_call = tokenizer.encode('<｜DSML｜invoke name="noop">', add_special_tokens=False).ids
    for parallel, expect in ((True, True), (False, False)):
        state = new_state(cache, GrammarSpec.tool_calls(tools, "required", parallel_tool_calls=parallel))
        assert all(state.accept(t) for t in tokenizer.encode(one, add_special_tokens=False).ids)
        assert all(state.accept(t) for t in second_call) is expect


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_under_json_schema_validates(cache, tokenizer, seed):
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED))
    jsonschema.validate(json.loads(decode(tokenizer, random_walk(state, random.Random(seed)))), BOUNDED)


def test_json_object_accepts_any_object_and_nothing_else(cache, tokenizer):
    state = new_state(cache, GrammarSpec.json_object())
    for token_id in tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False).ids:
        assert state.accept(token_id)
    assert allowed(state) == {EOS}
    state = new_state(cache, GrammarSpec.json_object())
    assert not state.accept(tokenizer.encode("[", add_special_tokens=False).ids[0])


def test_whitespace_is_bounded(cache, tokenizer):
    space = tokenizer.token_to_id("Ġ")
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED))
    assert state.accept(tokenizer.token_to_id("{"))
    taken = 0
    while space in allowed(state):
        assert state.accept(space)
        taken += 1
        assert taken <= cache.max_whitespace
    assert taken == cache.max_whitespace


def test_inactive_until_reasoning_ends(cache, tokenizer):
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED), reasoning=True)
    for token_id in tokenizer.encode("Let me think. [not json] ", add_special_tokens=False).ids:
        assert allowed(state) is None and not state.active
        assert state.accept(token_id)
    assert state.accept(THINK_END) and state.active
    first = allowed(state)
    assert first and THINK_END not in first and tokenizer.token_to_id("[") not in first
    answer = '{"color": "red", "ok": true, "count": 3}'
    assert all(state.accept(t) for t in tokenizer.encode(answer, add_special_tokens=False).ids)
    assert allowed(state) == {EOS}


def test_stray_think_end_in_chat_mode_is_tolerated_once_at_the_start(cache, tokenizer):
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED))
    assert state.active and THINK_END in allowed(state)
    assert state.accept(THINK_END)  # skipped, not fed to the grammar
    assert THINK_END not in allowed(state)
    answer = tokenizer.encode('{"color": "blue", "ok": false, "count": 0}', add_special_tokens=False).ids
    assert state.accept(answer[0])
    assert not state.accept(THINK_END)  # inside the JSON it is a real violation
    assert state.failed and allowed(state) == {EOS}


def test_thinking_mode_allows_no_second_think_end(cache, tokenizer):
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED), reasoning=True)
    assert state.accept(THINK_END)
    assert THINK_END not in allowed(state)
    assert not state.accept(THINK_END)


def test_rollback_over_think_end_in_one_speculative_window(cache, tokenizer):
    state = new_state(cache, GrammarSpec.json_schema(BOUNDED), reasoning=True)
    thought = tokenizer.encode("ok", add_special_tokens=False).ids
    brace = tokenizer.token_to_id("{")
    draft = thought + [THINK_END, brace]
    assert all(state.accept(t) for t in draft)
    before_rollback = allowed(state)
    state.rollback(2)  # the verifier kept only the reasoning token
    assert not state.active and allowed(state) is None and state.num_tokens == len(thought)
    assert state.accept(THINK_END) and state.accept(brace)
    assert allowed(state) == before_rollback


def test_apply_structured_output_masks_only_grammar_rows(cache, tokenizer):
    states = [
        new_state(cache, GrammarSpec.json_schema(BOUNDED)),
        None,
        new_state(cache, GrammarSpec.json_schema(BOUNDED), reasoning=True),
    ]
    brace = tokenizer.token_to_id("{")
    kept = [[brace], [5, 6], [7]]  # row 0 already kept "{": the hook must catch its state up
    requests = [
        SimpleNamespace(params=SimpleNamespace(structured_output=s), output_token_ids=ids)
        for s, ids in zip(states, kept)
    ]
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    masked = apply_structured_output(logits, requests)
    assert torch.equal(logits, original)
    assert torch.equal(masked[1:], original[1:])  # no grammar; grammar still inside the reasoning
    expected = allowed(states[0])
    assert states[0].num_tokens == 1 and states[2].num_tokens == 1
    finite = set(torch.isfinite(masked[0]).nonzero().flatten().tolist())
    assert finite == expected and tokenizer.token_to_id('"') in expected
    assert not {tokenizer.token_to_id("}"), tokenizer.token_to_id("["), brace} & expected


def test_cache_compiles_once_and_reports_bad_schemas(cache):
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert cache.submit(spec) is cache.submit(
        GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    with pytest.raises(GrammarError):
        cache.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
    with pytest.raises(GrammarError):
        cache.compile(GrammarSpec.tool_calls(official_tools(), {"type": "function", "function": {"name": "missing"}}))
