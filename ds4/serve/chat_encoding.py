"""DeepSeek-V4 chat format: messages -> the exact prompt text the model was trained on.

`encode_messages` reproduces the official encoder (`encoding/encoding_dsv4.py` of the model repo) byte for
byte on the input it accepts, and turns the input it would assert on (or silently mangle) into a
`ChatFormatError` with a reason. `encode_chat_request` maps an OpenAI chat request onto it with the
convention vLLM established for DSv4 (tools on the leading system message, thinking switch in
`chat_template_kwargs`, `reasoning_effort`).

The format, in short: BOS, then each message; users are `<｜User｜>text`, and the turn that asks for
generation ends `<｜Assistant｜>` + `<think>` (thinking) or `</think>` (chat). Assistant turns are
`{reasoning}</think>{content}{DSML tool calls}<｜end▁of▁sentence｜>`; tool results travel inside user
turns as `<tool_result>...</tool_result>`.
"""

import json
from dataclasses import dataclass, field
from typing import Any

from ds4.tokenizer import (
    ASSISTANT_TEXT,
    BOS_TEXT,
    DSML_TEXT,
    EOS_TEXT,
    LATEST_REMINDER_TEXT,
    THINK_END_TEXT,
    THINK_START_TEXT,
    USER_TEXT,
)


class ChatFormatError(ValueError):
    """The request cannot be expressed in the DSv4 chat format (the server answers HTTP 400)."""


TOOL_CALLS_OPEN = f"<{DSML_TEXT}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML_TEXT}tool_calls>"
INVOKE_OPEN = f"<{DSML_TEXT}invoke"
INVOKE_CLOSE = f"</{DSML_TEXT}invoke>"
PARAMETER_OPEN = f"<{DSML_TEXT}parameter"
PARAMETER_CLOSE = f"</{DSML_TEXT}parameter>"

# Quick-instruction tasks: internal classification prompts, each closed by its own special token.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Prompt text the model was trained with; it must stay byte-identical to the official encoder's.
MAX_EFFORT_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

_TOOLS_SECTION_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f'"{TOOL_CALLS_OPEN}" block like the following:\n\n'
    f"{TOOL_CALLS_OPEN}\n"
    f'{INVOKE_OPEN} name="$TOOL_NAME">\n'
    f'{PARAMETER_OPEN} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f'{INVOKE_OPEN} name="$TOOL_NAME2">\n'
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{TOOL_CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START_TEXT}), you MUST output your complete reasoning "
    f"inside {THINK_START_TEXT}...{THINK_END_TEXT} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END_TEXT} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_SECTION_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)
_RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
REASONING_EFFORTS = (None, "high", "max")


def _json(value: Any) -> str:
    # The official encoder's serialisation: default separators, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------
# Validated, normalised conversation
# ---------------------------------------------------------------------------------------------------


@dataclass
class _ToolCall:
    call_id: str | None
    name: str
    arguments: dict


@dataclass
class _UserPart:
    text: str
    is_tool_result: bool = False
    tool_call_id: str | None = None

    def render(self) -> str:
        return f"<tool_result>{self.text}</tool_result>" if self.is_tool_result else self.text


@dataclass
class _Turn:
    role: str  # system | developer | user | assistant | latest_reminder (tool results become user parts)
    text: str = ""
    parts: list[_UserPart] = field(default_factory=list)
    tools: list[dict] = field(default_factory=list)
    response_format: Any = None
    reasoning: str = ""
    tool_calls: list[_ToolCall] = field(default_factory=list)
    task: str | None = None
    open_ended: bool = False  # an assistant turn left without EOS so the model continues it


def _text_field(msg: dict, key: str, where: str, *, required: bool) -> str:
    value = msg.get(key)
    if value is None:
        if required:
            raise ChatFormatError(f"{where}: '{key}' is required")
        return ""
    if not isinstance(value, str):
        raise ChatFormatError(f"{where}: '{key}' must be a string, got {type(value).__name__}")
    return value


def _parse_tools(tools: Any, where: str) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError(f"{where}: 'tools' must be a list")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ChatFormatError(f"{where}: tools[{i}] must be an object of type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatFormatError(f"{where}: tools[{i}].function must be an object with a non-empty 'name'")
        functions.append(function)
    return functions


def _parse_tool_calls(tool_calls: Any, where: str) -> list[_ToolCall]:
    if tool_calls is None:
        return []
    if not isinstance(tool_calls, list):
        raise ChatFormatError(f"{where}: 'tool_calls' must be a list")
    calls = []
    for i, call in enumerate(tool_calls):
        here = f"{where}: tool_calls[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ChatFormatError(f"{here} must be an object of type 'function'")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ChatFormatError(f"{here}.id must be a string")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatFormatError(f"{here}.function must be an object with a non-empty 'name'")
        calls.append(_ToolCall(call_id or None, function["name"], _parse_arguments(function.get("arguments"), here)))
    return calls


def _parse_arguments(arguments: Any, where: str) -> dict:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ChatFormatError(f"{where}.function.arguments is not valid JSON: {err}") from None
        except RecursionError:
            raise ChatFormatError(f"{where}.function.arguments nests too deeply") from None
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"{where}.function.arguments must be a JSON object")
    return arguments


def _check_task(msg: dict, where: str) -> str | None:
    task = msg.get("task")
    if task is not None and task not in TASK_TOKENS:
        raise ChatFormatError(f"{where}: unknown task {task!r}; expected one of {sorted(TASK_TOKENS)}")
    return task


def _check_tool_result_has_call(messages: list[dict], index: int, where: str) -> None:
    """A tool message must answer a call of the assistant turn right before its run of tool messages."""
    start = index
    while start > 0 and messages[start - 1].get("role") == "tool":
        start -= 1
    before = messages[start - 1] if start > 0 else {}
    calls = before.get("tool_calls") if before.get("role") == "assistant" else None
    if not calls:
        raise ChatFormatError(f"{where}: a tool message must follow an assistant message with tool_calls")
    if index - start >= len(calls):
        raise ChatFormatError(f"{where}: more tool results than tool calls in the preceding assistant message")
    call_id = messages[index].get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise ChatFormatError(f"{where}: 'tool_call_id' must be a string")
    known_ids = {call.get("id") for call in calls if isinstance(call, dict) and call.get("id")}
    if call_id and known_ids and call_id not in known_ids:
        raise ChatFormatError(f"{where}: tool_call_id {call_id!r} matches no call of the preceding assistant message")


def _parse_message(messages: list[dict], index: int) -> _Turn | _UserPart:
    msg = messages[index]
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise ChatFormatError(f"{where} must be an object")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatFormatError(f"{where}: unknown role {role!r}; expected one of {list(ROLES)}")
    if msg.get("tools") is not None and role not in ("system", "developer"):
        raise ChatFormatError(f"{where}: only system and developer messages may carry 'tools'")
    task = _check_task(msg, where)
    if role == "tool":
        _check_tool_result_has_call(messages, index, where)
        text = _text_field(msg, "content", where, required=True)
        return _UserPart(text, is_tool_result=True, tool_call_id=msg.get("tool_call_id") or None)
    if role == "assistant":
        return _Turn(
            role,
            text=_text_field(msg, "content", where, required=False),
            reasoning=_text_field(msg, "reasoning_content", where, required=False),
            tool_calls=_parse_tool_calls(msg.get("tool_calls"), where),
            task=task,
            open_ended=bool(msg.get("wo_eos", False)),
        )
    if role == "user":
        return _Turn(role, parts=[_UserPart(_text_field(msg, "content", where, required=True))], task=task)
    if role == "developer" and not msg.get("content"):
        raise ChatFormatError(f"{where}: a developer message needs non-empty content")
    return _Turn(
        role,
        text=_text_field(msg, "content", where, required=role == "latest_reminder"),
        tools=_parse_tools(msg.get("tools"), where),
        response_format=msg.get("response_format"),
        task=task,
    )


def _conversation(messages: list[dict]) -> list[_Turn]:
    """Validate messages and fold tool results (and the user text around them) into user turns."""
    if not isinstance(messages, list):
        raise ChatFormatError("messages must be a list")
    turns: list[_Turn] = []
    for index in range(len(messages)):
        parsed = _parse_message(messages, index)
        previous = turns[-1] if turns else None
        if isinstance(parsed, _UserPart):
            # DSv4 has no tool role: a result joins the user turn before it, or opens a new one.
            if previous is not None and previous.role == "user":
                previous.parts.append(parsed)
            else:
                turns.append(_Turn("user", parts=[parsed]))
        elif parsed.role == "user" and previous is not None and previous.role == "user" and previous.task is None:
            previous.parts.extend(parsed.parts)
        else:
            turns.append(parsed)
    _order_tool_results(turns)
    return turns


def _order_tool_results(turns: list[_Turn]) -> None:
    """Put the tool results of a user turn in the order the latest assistant turn made the calls."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {call.call_id: i for i, call in enumerate(turn.tool_calls) if call.call_id}
        elif turn.role == "user":
            slots = [i for i, part in enumerate(turn.parts) if part.is_tool_result]
            if len(slots) > 1 and call_order:
                results = sorted((turn.parts[i] for i in slots), key=lambda p: call_order.get(p.tool_call_id, 0))
                for slot, result in zip(slots, results):
                    turn.parts[slot] = result


# ---------------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------------


def render_tools(functions: list[dict]) -> str:
    """The `## Tools` section: DSML instructions followed by one JSON schema per line."""
    return _TOOLS_SECTION_HEAD + "\n".join(_json(f) for f in functions) + _TOOLS_SECTION_TAIL


def render_tool_calls(calls: list[_ToolCall]) -> str:
    """An assistant turn's DSML block: string arguments raw, everything else as JSON."""
    invokes = []
    for call in calls:
        parameters = "\n".join(
            f'{PARAMETER_OPEN} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else _json(value)}{PARAMETER_CLOSE}"
            for key, value in call.arguments.items()
        )
        invokes.append(f'{INVOKE_OPEN} name="{call.name}">\n{parameters}\n{INVOKE_CLOSE}')
    return f"\n\n{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _render_instructions(turn: _Turn) -> str:
    text = turn.text
    if turn.tools:
        text += "\n\n" + render_tools(turn.tools)
    if turn.response_format:
        text += "\n\n" + _RESPONSE_FORMAT_HEAD + _json(turn.response_format)
    return text


@dataclass(frozen=True)
class _Mode:
    thinking: bool
    drop_thinking: bool
    last_user: int  # index of the last user/developer turn, -1 if none

    def shows_reasoning(self, assistant_index: int) -> bool:
        """Reasoning of an assistant turn stays in the prompt unless it answered an earlier user turn."""
        return self.thinking and (not self.drop_thinking or assistant_index > self.last_user)

    def opens_thinking(self, user_index: int) -> bool:
        """After a user turn the assistant opens `<think>`, except for earlier exchanges being dropped."""
        return self.thinking and (not self.drop_thinking or user_index >= self.last_user)


def _render_turn(turns: list[_Turn], index: int, mode: _Mode) -> str:
    turn = turns[index]
    if turn.role == "system":
        return _render_instructions(turn)
    if turn.role == "developer":
        return USER_TEXT + _render_instructions(turn)
    if turn.role == "user":
        return USER_TEXT + "\n\n".join(part.render() for part in turn.parts)
    if turn.role == "latest_reminder":
        return LATEST_REMINDER_TEXT + turn.text
    answers_task = index > 0 and turns[index - 1].task is not None
    reasoning = ""
    if not answers_task and mode.shows_reasoning(index):
        reasoning = turn.reasoning + THINK_END_TEXT
    tool_calls = render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
    return reasoning + turn.text + tool_calls + ("" if turn.open_ended else EOS_TEXT)


def _render_transition(turns: list[_Turn], index: int, mode: _Mode) -> str:
    """What follows a turn when the model speaks next (the turn is last, or an assistant/reminder follows)."""
    if index + 1 < len(turns) and turns[index + 1].role not in ("assistant", "latest_reminder"):
        return ""
    turn = turns[index]
    if turn.task is not None:
        if turn.task != "action":
            return TASK_TOKENS[turn.task]
        return ASSISTANT_TEXT + (THINK_START_TEXT if mode.thinking else THINK_END_TEXT) + TASK_TOKENS["action"]
    if turn.role in ("user", "developer"):
        return ASSISTANT_TEXT + (THINK_START_TEXT if mode.opens_thinking(index) else THINK_END_TEXT)
    return ""


def _last_user_index(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    add_bos: bool = True,
) -> str:
    """Encode messages in the official encoder's own format into the DSv4 prompt text.

    Messages are dicts with `role` (system, developer, user, assistant, tool, latest_reminder), `content`
    (a string), and optionally `reasoning_content`, `tool_calls` (OpenAI format), `tool_call_id`, `tools`
    (OpenAI format, system/developer only), `response_format`, `task` and `wo_eos` (assistant: leave the
    turn open so the model continues it). Earlier turns' reasoning is dropped when `drop_thinking`,
    unless some message carries tools.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    turns = _conversation(messages)
    drop_thinking = drop_thinking and not any(turn.tools for turn in turns)
    if thinking and drop_thinking:
        # Developer turns of earlier exchanges leave the context together with their reasoning.
        last_user = _last_user_index(turns)
        turns = [t for i, t in enumerate(turns) if t.role != "developer" or i >= last_user]
    mode = _Mode(thinking, drop_thinking, _last_user_index(turns))
    pieces = [BOS_TEXT] if add_bos else []
    if thinking and reasoning_effort == "max" and turns:
        pieces.append(MAX_EFFORT_PREFIX)
    for index in range(len(turns)):
        pieces.append(_render_turn(turns, index, mode))
        pieces.append(_render_transition(turns, index, mode))
    return "".join(pieces)


# ---------------------------------------------------------------------------------------------------
# OpenAI request mapping
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    thinking: bool
    reasoning_effort: str | None
    output_starts_in_reasoning: bool  # the prompt opened `<think>`: the model's first tokens are reasoning


def _flatten_content(content: Any, where: str) -> Any:
    """OpenAI content parts -> one string; text parts are joined with newlines as vLLM does."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(f"{where}.content[{i}]: only text content parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ChatFormatError(f"{where}.content[{i}]: a text part needs a string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def _from_openai_message(msg: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(msg, dict):
        raise ChatFormatError(f"{where} must be an object")
    msg = dict(msg)
    msg["content"] = _flatten_content(msg.get("content"), where)
    if msg.get("reasoning_content") is None and msg.get("reasoning") is not None:
        msg["reasoning_content"] = msg["reasoning"]
    msg.pop("wo_eos", None)  # continuation is asked for with `continue_final_message`, not per message
    return msg


def _thinking_switch(chat_template_kwargs: Any) -> bool:
    kwargs = chat_template_kwargs or {}
    if not isinstance(kwargs, dict):
        raise ChatFormatError("chat_template_kwargs must be an object")
    switches = {key: kwargs[key] for key in ("thinking", "enable_thinking") if kwargs.get(key) is not None}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise ChatFormatError(f"chat_template_kwargs.{key} must be a boolean")
    if len(set(switches.values())) > 1:
        raise ChatFormatError("chat_template_kwargs.thinking and enable_thinking disagree")
    return next(iter(switches.values()), True)


def _attach_tools(messages: list[dict], tools: Any) -> list[dict]:
    if not tools:
        return messages
    if messages[0].get("role") in ("system", "developer"):
        return [{**messages[0], "tools": tools}] + messages[1:]
    return [{"role": "system", "content": "", "tools": tools}] + messages


def encode_chat_request(
    messages: list[Any],
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    reasoning_effort: str | None = None,
    *,
    continue_final_message: bool = False,
) -> ChatPrompt:
    """Map an OpenAI chat completion request onto the DSv4 encoder.

    Thinking is on unless `chat_template_kwargs` turns it off (`thinking`/`enable_thinking`) or
    `reasoning_effort` is "none". In thinking mode the effort is "max" when asked for, else "high".
    Request-level tools replace the tools of a leading system/developer message, or arrive in a new
    system message of their own. With `continue_final_message`, the last (assistant) message is left
    open and the model continues it.
    """
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages must be a non-empty list")
    if reasoning_effort is not None and not isinstance(reasoning_effort, str):
        raise ChatFormatError("reasoning_effort must be a string")
    thinking = _thinking_switch(chat_template_kwargs) and reasoning_effort != "none"
    effort = ("max" if reasoning_effort == "max" else "high") if thinking else None
    converted = _attach_tools([_from_openai_message(m, i) for i, m in enumerate(messages)], tools)
    if continue_final_message:
        if converted[-1].get("role") != "assistant":
            raise ChatFormatError("continue_final_message needs the last message to be an assistant message")
        converted[-1]["wo_eos"] = True
    text = encode_messages(converted, thinking=thinking, reasoning_effort=effort)
    if not continue_final_message:
        _check_generation_point(converted)
    return ChatPrompt(text, thinking, effort, output_starts_in_reasoning=text.endswith(THINK_START_TEXT))


def _check_generation_point(messages: list[dict]) -> None:
    """The prompt must end where the assistant speaks next, or the model would answer into the void."""
    last = next((m for m in reversed(messages) if m.get("role") != "latest_reminder"), messages[-1])
    if last.get("role") not in ("user", "developer", "tool"):
        raise ChatFormatError(
            f"the conversation ends with a {last.get('role')!r} message; it must end with a user, developer or "
            "tool message (or set continue_final_message to continue a final assistant message)"
        )
