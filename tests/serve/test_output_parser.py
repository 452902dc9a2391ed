"""Parsing model output: the official vectors' assistant turns parse back to their messages, whatever the
delta boundaries; DSML never leaks into content; broken DSML comes back as content with an error."""

import json
from pathlib import Path

import pytest

from ds4.serve.output_parser import (
    ContentDelta,
    OutputParser,
    ParseError,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    parse_full,
    validate_tool_call,
)
from ds4.tokenizer import load_tokenizer

ENCODING_DATA = Path(__file__).resolve().parents[1] / "data" / "encoding"

EOS = "<｜end▁of▁sentence｜>"
ASSISTANT = "<｜Assistant｜>"
TASK_TOKENS = ("<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>")


def run(chunks: list[str], thinking: bool):
    """Feed chunks; fold the events into (reasoning, content, [(name, arguments)], errors)."""
    parser = OutputParser(thinking, id_factory=lambda: "call_x")
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names, pieces, calls = {}, {}, []
    for event in events:
        if isinstance(event, ToolCallStart):
            names[event.index], pieces[event.index] = event.name, ""
        elif isinstance(event, ToolCallArgumentsDelta):
            pieces[event.index] += event.text
        elif isinstance(event, ToolCallEnd):
            assert event.arguments == pieces[event.index], "argument deltas must add up to the final arguments"
            calls.append((names[event.index], event.arguments))
    errors = [e.message for e in events if isinstance(e, ParseError)]
    assert errors == parser.errors
    return reasoning, content, calls, errors


def every_split(text: str, thinking: bool):
    whole = run([text], thinking)
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]], thinking) == whole, f"split at {cut}: {text[max(0, cut - 20) : cut]!r}|"
    assert run(list(text), thinking) == whole
    return whole


def official_assistant_turns():
    """(completion text, thinking, expected result) for every assistant turn of the official vectors.

    The completion is what the model would have generated after the generation header; the expected
    result comes from the assistant message of the vector's input."""
    turns = []
    for n, _thinking_prompt in [(1, True), (2, True), (3, True), (4, False)]:
        data = json.loads((ENCODING_DATA / f"test_input_{n}.json").read_text(encoding="utf-8"))
        messages = data["messages"] if isinstance(data, dict) else data
        prompt = (ENCODING_DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")
        assistants = [m for m in messages if m["role"] == "assistant"]
        pieces = prompt.split(ASSISTANT)[1:]
        assert len(pieces) == len(assistants)
        for k, (message, piece) in enumerate(zip(assistants, pieces)):
            thinking = piece.startswith("<think>")
            piece = piece.removeprefix("<think>").removeprefix("</think>")
            for token in TASK_TOKENS:
                piece = piece.removeprefix(token)
            completion = piece[: piece.index(EOS) + len(EOS)]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
            reasoning = (message.get("reasoning_content") or "") if thinking else ""
            expected = (reasoning, message.get("content") or "", calls, [])
            turns.append(pytest.param(completion, thinking, expected, id=f"vector{n}-turn{k}"))
    return turns


@pytest.mark.parametrize("completion, thinking, expected", official_assistant_turns())
def test_official_assistant_turns_parse_back_at_every_split(completion, thinking, expected):
    assert every_split(completion, thinking) == expected


def test_official_turns_parse_from_real_detokenised_deltas():
    tokenizer = load_tokenizer()
    for param in official_assistant_turns():
        completion, thinking, expected = param.values
        ids, deltas, shown = tokenizer.encode(completion), [], ""
        for i in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:i])
            if not text.endswith("\ufffd"):  # hold back a half-decoded multi-byte character
                deltas.append(text[len(shown) :])
                shown = text
        assert shown == completion
        assert run(deltas, thinking) == expected


SEVERAL_CALLS = (
    "Checking both.</think>Let me look.\n\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Pa"ris\\n\n</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="opts" string="false">{"units": ["C", "F"], "hourly": true}</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="now">\n'
    "\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="q" string="true">a < b </｜DSML｜paramete</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>" + EOS
)


def test_several_calls_with_json_values_at_every_split():
    assert every_split(SEVERAL_CALLS, thinking=True) == (
        "Checking both.",
        "Let me look.",
        [
            ("get_weather", '{"city": "Pa\\"ris\\\\n\\n", "days": 3, "opts": {"units": ["C", "F"], "hourly": true}}'),
            ("now", "{}"),
            ("search", '{"q": "a < b </｜DSML｜paramete"}'),
        ],
        [],
    )


def test_parse_full_returns_openai_tool_calls():
    reasoning, content, calls = parse_full(SEVERAL_CALLS, thinking=True)
    assert (reasoning, content) == ("Checking both.", "Let me look.")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now", "search"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 3
    assert json.loads(calls[0]["function"]["arguments"])["days"] == 3


BLOCK = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="f">\n'
    '<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


@pytest.mark.parametrize(
    "text, thinking, expected",
    [
        ("R</think>" + BLOCK, True, ("R", "", [("f", '{"x": "1"}')], [])),  # no separator after </think>
        ("R\n\n" + BLOCK, True, ("R", "", [("f", '{"x": "1"}')], [])),  # the model skipped </think>
        ("</think>" + BLOCK, False, ("", "", [("f", '{"x": "1"}')], [])),
        ("Sure:\n\n\n" + BLOCK + EOS, False, ("", "Sure:\n", [("f", '{"x": "1"}')], [])),
        ("A\n\nB\n\n", False, ("", "A\n\nB\n\n", [], [])),
        ("R\n\n</think>C\n", True, ("R\n\n", "C\n", [], [])),
    ],
)
def test_tool_block_boundaries_keep_markup_out_of_text(text, thinking, expected):
    assert every_split(text, thinking) == expected


@pytest.mark.parametrize(
    "text, thinking, expected",
    [
        ("I think.</think>Answer.", True, ("I think.", "Answer.")),
        ("No end of thinking", True, ("No end of thinking", "")),
        ("</think>Answer.", False, ("", "Answer.")),  # stray </think> opening a chat-mode answer is dropped
        ("Answer</think>.", False, ("", "Answer</think>.")),  # only at the very start
        ("</thi", False, ("", "</thi")),
        ("Answer." + EOS, False, ("", "Answer.")),
        ("A <｜DSML｜ b", False, ("", "A <｜DSML｜ b")),  # DSML without a block opener is text
    ],
)
def test_reasoning_content_boundary(text, thinking, expected):
    reasoning, content, calls, errors = every_split(text, thinking)
    assert (reasoning, content, calls, errors) == (*expected, [], [])


def test_string_arguments_stream_before_the_parameter_closes():
    parser = OutputParser(thinking=False, id_factory=lambda: "call_1")
    events = parser.feed(
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="write">\n<｜DSML｜parameter name="text" string="true">'
    )
    assert ToolCallStart(0, "call_1", "write") in events
    events = parser.feed("hello wor")
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta)) == "hello wor"
    events = parser.feed("ld</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>") + parser.finish()
    assert ToolCallEnd(0, '{"text": "hello world"}') in events


def test_malformed_invoke_header_comes_back_as_content():
    text = "Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam=f>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    reasoning, content, calls, errors = every_split(text, thinking=False)
    assert content == text and calls == [] and len(errors) == 1 and "invoke header" in errors[0]


def test_completed_calls_survive_a_later_malformed_one():
    broken = '<｜DSML｜invoke name="g">\n<｜DSML｜parameter name="y">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    text = BLOCK.replace("</｜DSML｜tool_calls>", broken + "</｜DSML｜tool_calls>")
    _, content, calls, errors = every_split(text, thinking=False)
    assert calls == [("f", '{"x": "1"}')]
    # Everything after the last completed call comes back, so together nothing is lost.
    assert content == "\n" + broken + "</｜DSML｜tool_calls>" and "parameter header" in errors[0]
    events = OutputParser(thinking=False).feed(text)
    assert events[-1] == ParseError(errors[0], abandoned_tool_call=1)


def test_output_cut_off_inside_a_call_is_content():
    text = 'Hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="true">par'
    _, content, calls, errors = every_split(text, thinking=False)
    assert content == text and calls == []
    assert errors == ["malformed tool call: the output ended inside the tool calls block"]


def test_duplicate_parameter_is_malformed():
    param = '<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n'
    text = BLOCK.replace(param, param + param)
    _, content, calls, errors = every_split(text, thinking=False)
    assert calls == [] and content == text and "given twice" in errors[0]


def test_non_json_value_of_a_json_parameter_becomes_a_string():
    text = BLOCK.replace('string="true">1<', 'string="false">Paris<')
    assert every_split(text, thinking=False)[2] == [("f", '{"x": "Paris"}')]


def test_json_value_nested_past_the_recursion_limit_becomes_a_string():
    deep = "[" * 100_000 + "]" * 100_000
    text = BLOCK.replace('string="true">1<', f'string="false">{deep}<')
    parser = OutputParser(thinking=False)
    calls = [e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCallEnd)]
    assert [json.loads(call.arguments) for call in calls] == [{"x": deep}]


def test_text_after_end_of_sentence_is_kept_and_reported():
    _, content, _, errors = every_split("A" + EOS + "B", thinking=False)
    assert content == "AB" and errors == ["text after the end-of-sentence token"]


def test_feed_after_finish_is_a_programming_error():
    parser = OutputParser(thinking=False)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.mark.parametrize(
    "name, arguments, problem",
    [
        ("get_weather", '{"city": "Paris", "days": 3}', None),
        ("ping", "{}", None),
        ("get_weather", '{"days": 3}', "'city' is a required property"),
        ("get_weather", '{"city": "Paris", "days": 0}', "at days"),
        ("get_weather", '{"city": "Paris", "wind": 1}', "Additional properties"),
        ("get_weather", '{"city": ', "not valid JSON"),
        ("fly", "{}", "unknown tool 'fly'"),
        ("get_weather", "[" * 100_000 + "]" * 100_000, "nest too deeply"),
    ],
)
def test_validate_tool_call_against_schema(name, arguments, problem):
    result = validate_tool_call(name, arguments, WEATHER_TOOLS)
    if problem is None:
        assert result is None
    else:
        assert result is not None and problem in result


def test_validate_tool_call_reports_a_broken_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    assert "schema of 'f' is invalid" in validate_tool_call("f", "{}", tools)
