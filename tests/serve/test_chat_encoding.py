"""The DSv4 prompt format: official vectors byte for byte, the OpenAI request mapping, and refusals."""

import copy
import json
from pathlib import Path

import pytest

from ds4.serve.chat_encoding import ChatFormatError, encode_chat_request, encode_messages
from ds4.tokenizer import load_tokenizer

ENCODING_DATA = Path(__file__).resolve().parents[1] / "data" / "encoding"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


def official_vector(n: int) -> tuple[list[dict], str]:
    data = json.loads((ENCODING_DATA / f"test_input_{n}.json").read_text(encoding="utf-8"))
    if isinstance(data, dict):  # vector 1: the tools belong to the system message
        data["messages"][0]["tools"] = data["tools"]
        data = data["messages"]
    return data, (ENCODING_DATA / f"test_output_{n}.txt").read_text(encoding="utf-8")


def through_generation_header(prompt: str, header: str) -> str:
    """The official prompt up to the header that asks for the final assistant turn."""
    return prompt[: prompt.rindex(header) + len(header)]


@pytest.mark.parametrize("n, thinking", [(1, True), (2, True), (3, True), (4, False)])
def test_official_vectors_byte_for_byte(n, thinking):
    messages, expected = official_vector(n)
    assert encode_messages(messages, thinking=thinking) == expected


def test_encoder_leaves_the_callers_messages_untouched():
    messages, _ = official_vector(1)
    before = copy.deepcopy(messages)
    encode_messages(messages, thinking=True)
    assert messages == before


def test_request_level_tools_land_on_the_leading_system_message():
    messages, expected = official_vector(1)
    tools = messages[0].pop("tools")
    prompt = encode_chat_request(messages[:-1], tools=tools)
    assert prompt.text == through_generation_header(expected, ASSISTANT + "<think>")
    assert prompt.thinking and prompt.reasoning_effort == "high" and prompt.output_starts_in_reasoning


def test_request_tools_replace_the_tools_of_the_leading_message():
    messages, expected = official_vector(1)
    real_tools = messages[0]["tools"]
    messages[0]["tools"] = [{"type": "function", "function": {"name": "stale"}}]
    prompt = encode_chat_request(messages[:-1], tools=real_tools)
    assert prompt.text == through_generation_header(expected, ASSISTANT + "<think>")


def test_request_defaults_to_thinking_and_drops_earlier_reasoning():
    messages, expected = official_vector(2)
    prompt = encode_chat_request(messages[:-1])
    assert prompt.text == through_generation_header(expected, ASSISTANT + "<think>")


@pytest.mark.parametrize(
    "kwargs, effort",
    [({"thinking": False}, None), ({"enable_thinking": False}, None), (None, "none"), ({"thinking": True}, "none")],
)
def test_chat_mode_switches(kwargs, effort):
    messages, expected = official_vector(4)
    prompt = encode_chat_request(messages[:-1], chat_template_kwargs=kwargs, reasoning_effort=effort)
    assert prompt.text == through_generation_header(expected, "<｜action｜>")
    assert not prompt.thinking and prompt.reasoning_effort is None and not prompt.output_starts_in_reasoning


def test_thinking_and_chat_generation_headers():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert encode_messages(messages, thinking=True) == f"{BOS}S{USER}Hi{ASSISTANT}<think>"
    assert encode_messages(messages, thinking=False) == f"{BOS}S{USER}Hi{ASSISTANT}</think>"


MAX_EFFORT_FIRST_LINE = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"


@pytest.mark.parametrize("effort", [None, "high", "low", "medium", "anything"])
def test_reasoning_efforts_below_max_add_nothing(effort):
    prompt = encode_chat_request([{"role": "user", "content": "Hi"}], reasoning_effort=effort)
    assert prompt.text == f"{BOS}{USER}Hi{ASSISTANT}<think>"
    assert prompt.reasoning_effort == "high"


def test_max_reasoning_effort_prefixes_the_conversation():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = encode_chat_request(messages, reasoning_effort="max").text
    assert text.startswith(BOS + MAX_EFFORT_FIRST_LINE)
    assert text.endswith(f"unchecked.\n\nS{USER}Hi{ASSISTANT}<think>")
    assert text.count("Reasoning Effort") == 1


def test_max_reasoning_effort_is_ignored_in_chat_mode():
    prompt = encode_chat_request(
        [{"role": "user", "content": "Hi"}], chat_template_kwargs={"thinking": False}, reasoning_effort="max"
    )
    assert prompt.text == f"{BOS}{USER}Hi{ASSISTANT}</think>"


def _two_turns(extra_system: dict | None = None) -> list[dict]:
    system = {"role": "system", "content": "S", **(extra_system or {})}
    return [
        system,
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


def test_earlier_reasoning_is_dropped_without_tools():
    text = encode_messages(_two_turns(), thinking=True)
    assert text == f"{BOS}S{USER}Q1{ASSISTANT}</think>A1{EOS}{USER}Q2{ASSISTANT}<think>"


def test_earlier_reasoning_is_kept_when_tools_exist():
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = encode_messages(_two_turns({"tools": tools}), thinking=True)
    assert text.endswith(f"{USER}Q1{ASSISTANT}<think>R1</think>A1{EOS}{USER}Q2{ASSISTANT}<think>")


def test_drop_thinking_off_keeps_earlier_reasoning():
    text = encode_messages(_two_turns(), thinking=True, drop_thinking=False)
    assert text == f"{BOS}S{USER}Q1{ASSISTANT}<think>R1</think>A1{EOS}{USER}Q2{ASSISTANT}<think>"


def test_chat_mode_never_shows_reasoning():
    text = encode_messages(_two_turns(), thinking=False, drop_thinking=False)
    assert text == f"{BOS}S{USER}Q1{ASSISTANT}</think>A1{EOS}{USER}Q2{ASSISTANT}</think>"


def test_earlier_developer_turns_leave_with_their_reasoning():
    messages = [
        {"role": "developer", "content": "D1"},
        {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    assert encode_messages(messages, thinking=True) == f"{BOS}A1{EOS}{USER}Q2{ASSISTANT}<think>"


def test_request_tools_without_system_message_get_one_of_their_own():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    text = encode_chat_request([{"role": "user", "content": "Hi"}], tools=tools).text
    assert text.startswith(BOS + "\n\n## Tools\n\n")
    assert '\n{"name": "f", "parameters": {"type": "object"}}\n\n' in text
    assert text.endswith(f"to invoke tool calls.\n{USER}Hi{ASSISTANT}<think>")


def test_request_tools_land_on_a_leading_developer_message():
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = encode_chat_request([{"role": "developer", "content": "D"}], tools=tools).text
    assert text.startswith(f"{BOS}{USER}D\n\n## Tools\n\n")
    assert text.endswith(f"to invoke tool calls.\n{ASSISTANT}<think>")


def test_tool_call_round_trip_layout():
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "reasoning_content": "R",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris", "days": 3}'}},
                {"id": "b", "type": "function", "function": {"name": "t", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    expected = (
        f"{BOS}{USER}Weather?{ASSISTANT}</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="w">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="t">\n\n</｜DSML｜invoke>\n'
        f"</｜DSML｜tool_calls>{EOS}"
        # Results are put back in call order; with no tools declared the tool turn is the latest user turn.
        f"{USER}<tool_result>A</tool_result>\n\n<tool_result>B</tool_result>{ASSISTANT}<think>"
    )
    assert encode_chat_request(messages).text == expected


def test_assistant_prefill_is_continued():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    prompt = encode_chat_request(messages, continue_final_message=True)
    assert prompt.text == f"{BOS}{USER}Hi{ASSISTANT}<think></think>Hel"
    assert not prompt.output_starts_in_reasoning
    chat = encode_chat_request(messages, chat_template_kwargs={"thinking": False}, continue_final_message=True)
    assert chat.text == f"{BOS}{USER}Hi{ASSISTANT}</think>Hel"


def test_content_parts_and_reasoning_alias():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "reasoning": "R", "content": "A"},
        {"role": "user", "content": "c"},
    ]
    text = encode_chat_request(messages, chat_template_kwargs={"thinking": True}).text
    assert text == f"{BOS}{USER}a\nb{ASSISTANT}</think>A{EOS}{USER}c{ASSISTANT}<think>"


def test_latest_reminder_and_task_tokens():
    messages = [
        {"role": "user", "content": "U"},
        {"role": "latest_reminder", "content": "R"},
    ]
    assert encode_messages(messages, thinking=True) == f"{BOS}{USER}U{ASSISTANT}<think><｜latest_reminder｜>R"
    titled = [{"role": "user", "content": "U", "task": "title"}]
    assert encode_messages(titled, thinking=True) == f"{BOS}{USER}U<｜title｜>"


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "robot", "content": "x"}], "unknown role"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}], "must follow an assistant"),
        (
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "zz", "content": "r"},
            ],
            "matches no call",
        ),
        (
            [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "content": "r"},
                {"role": "tool", "content": "r"},
            ],
            "more tool results",
        ),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "only text content"),
        ([{"role": "user", "content": 5}], "must be a string"),
        ([{"role": "user", "content": None}], "is required"),
        ([{"role": "user", "content": "x", "task": "dance"}], "unknown task"),
        ([{"role": "developer", "content": ""}], "non-empty content"),
        ([{"role": "user", "content": "x", "tools": []}], "only system and developer"),
        (
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                },
                {"role": "user", "content": "y"},
            ],
            "not valid JSON",
        ),
        (
            [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
                },
                {"role": "user", "content": "y"},
            ],
            "JSON object",
        ),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "ends with a 'assistant'"),
        (["hello"], "must be an object"),
        ([], "non-empty list"),
    ],
)
def test_invalid_requests_are_refused_with_a_reason(messages, reason):
    with pytest.raises(ChatFormatError, match=reason):
        encode_chat_request(messages)


@pytest.mark.parametrize(
    "kwargs, effort, reason",
    [
        ({"thinking": True, "enable_thinking": False}, None, "disagree"),
        ({"thinking": "yes"}, None, "must be a boolean"),
        ("thinking", None, "must be an object"),
        (None, 3, "must be a string"),
    ],
)
def test_invalid_switches_are_refused(kwargs, effort, reason):
    with pytest.raises(ChatFormatError, match=reason):
        encode_chat_request([{"role": "user", "content": "x"}], chat_template_kwargs=kwargs, reasoning_effort=effort)


def test_bad_tools_are_refused():
    with pytest.raises(ChatFormatError, match="non-empty 'name'"):
        encode_chat_request([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {}}])
    with pytest.raises(ChatFormatError, match="continue_final_message"):
        encode_chat_request([{"role": "user", "content": "x"}], continue_final_message=True)
    with pytest.raises(ChatFormatError, match="reasoning_effort"):
        encode_messages([{"role": "user", "content": "x"}], thinking=True, reasoning_effort="low")


# --- tokenisation with the real DSv4 tokenizer ------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_special_token_ids(tokenizer):
    expected = {
        "<｜begin▁of▁sentence｜>": 0,
        "<｜end▁of▁sentence｜>": 1,
        "<｜User｜>": 128803,
        "<｜Assistant｜>": 128804,
        "<think>": 128821,
        "</think>": 128822,
        "｜DSML｜": 128825,
        "<｜latest_reminder｜>": 128828,
    }
    for text, token_id in expected.items():
        assert tokenizer.encode(text) == [token_id]
    special = tokenizer.special
    assert (special.bos, special.eos, special.user, special.assistant) == (0, 1, 128803, 128804)
    assert (special.think_start, special.think_end) == (128821, 128822)
    assert (special.dsml, special.latest_reminder) == (128825, 128828)
    assert tokenizer.vocab_size == 129280


def test_encode_adds_no_bos(tokenizer):
    ids = tokenizer.encode("Hello")
    assert ids and ids[0] != 0
    assert tokenizer.decode(ids) == "Hello"


def test_official_prompts_tokenise_onto_the_special_tokens(tokenizer):
    _, prompt = official_vector(1)
    ids = tokenizer.encode(prompt)
    assert ids[0] == 0 and ids[-1] == 1
    assert tokenizer.decode(ids) == prompt
    # Every special marker in the text is a single special token, never spelled out of pieces.
    for text, token_id in [(USER, 128803), (ASSISTANT, 128804), ("<think>", 128821), ("</think>", 128822)]:
        assert ids.count(token_id) == prompt.count(text)
    assert ids.count(128825) == prompt.count("｜DSML｜")


def test_request_prompt_tokens_end_with_the_generation_header(tokenizer):
    messages, _ = official_vector(2)
    ids = tokenizer.encode(encode_chat_request(messages[:-1]).text)
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]
