"""Model output text -> reasoning, content and tool calls, incrementally.

The text arrives in deltas cut anywhere (incremental detokenisation splits `<｜DSML｜invoke` into several
tokens), so every marker is recognised across delta boundaries: text that could still turn out to be the
start of a marker is held back until it is decided. DSML never reaches
content or reasoning; a tool call block that turns out malformed (or is cut off) is handed back as
content, raw, with an error, so no text is lost.

Output grammar (what the chat encoder teaches the model):
    [reasoning </think>] content [\\n\\n<｜DSML｜tool_calls> invoke... </｜DSML｜tool_calls>] [<｜end▁of▁sentence｜>]
    invoke    = <｜DSML｜invoke name="N">  parameter... </｜DSML｜invoke>
    parameter = <｜DSML｜parameter name="K" string="true|false">VALUE</｜DSML｜parameter>
A `string="true"` value is a raw string; `string="false"` is a JSON value. Whitespace between tags is
free here (the official parser wants exactly one newline).
"""

import enum
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import jsonschema

from ds4.serve.chat_encoding import (
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
)
from ds4.tokenizer import EOS_TEXT, THINK_END_TEXT


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # position among this output's tool calls, as in OpenAI streaming
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str  # the next piece of the OpenAI `arguments` JSON string


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: str  # the whole `arguments` JSON string (the concatenation of its deltas)


@dataclass(frozen=True)
class ParseError:
    message: str
    abandoned_tool_call: int | None = None  # a started call that will never end; its raw text went to content


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | ParseError


class _Mode(enum.Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    TOOL_BLOCK = "tool block"
    RAW = "raw"  # after malformed DSML: everything is content
    ENDED = "ended"  # after EOS


class _Expect(enum.Enum):
    """Where the tool-block parser stands."""

    INVOKE = "an invoke or the end of the tool calls block"
    INVOKE_HEADER = 'an invoke header ` name="...">`'
    PARAMETER = "a parameter or the end of the invoke"
    PARAMETER_HEADER = 'a parameter header ` name="..." string="true|false">`'
    VALUE = "a parameter value"


_INVOKE_HEADER = re.compile(r'\s*name="([^"]+)"\s*')
_PARAMETER_HEADER = re.compile(r'\s*name="([^"]+)"\s+string="(true|false)"\s*')
_MAX_SEPARATOR_NEWLINES = 2  # the encoder writes "\n\n" between text and the tool calls block


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could be the beginning of a marker."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-length:]):
                longest = length
                break
    return longest


def _separator_length(text: str) -> int:
    return min(len(text) - len(text.rstrip("\n")), _MAX_SEPARATOR_NEWLINES)


def _json_string_body(text: str) -> str:
    # JSON escapes character by character, so escaped pieces concatenate to the escaped whole.
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_value(raw: str) -> str:
    """A `string="false"` value as JSON: verbatim when it is valid JSON, else as a JSON string."""
    try:
        json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # a model can write JSON nested past the interpreter's limit
        return json.dumps(raw, ensure_ascii=False)
    return raw


@dataclass
class _OpenCall:
    index: int
    parameters: set[str] = field(default_factory=set)
    arguments: list[str] = field(default_factory=list)
    value_is_string: bool = False
    pending_key: str = ""  # the `"name": ` of a JSON-valued parameter, written once its value is complete
    raw_value: list[str] = field(default_factory=list)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """Feed text deltas, get events. Call `finish()` once the output is complete."""

    def __init__(self, thinking: bool, id_factory: Callable[[], str] = new_tool_call_id):
        self._mode = _Mode.REASONING if thinking else _Mode.CONTENT
        self._id_factory = id_factory
        self._buffer = ""
        self._events: list[Event] = []
        self._at_chat_start = not thinking  # a chat-mode output may open with a stray `</think>`
        self._expect = _Expect.INVOKE
        self._unconfirmed = ""  # raw tool-block text not yet part of a completed call
        self._call: _OpenCall | None = None
        self._calls_started = 0
        self._finished = False
        self.errors: list[str] = []

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish")
        self._buffer += text
        while self._buffer and self._step(final=False):
            pass
        return self._take_events()

    def finish(self) -> list[Event]:
        if not self._finished:
            self._finished = True
            while self._buffer and self._step(final=True):
                pass
            if self._mode is _Mode.TOOL_BLOCK:
                self._malformed("the output ended inside the tool calls block")
        return self._take_events()

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # --- text (reasoning / content) -------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        """Consume what can be decided; True when progress was made and another step may follow."""
        if self._mode is _Mode.TOOL_BLOCK:
            return self._step_tool_block(final)
        if self._mode is _Mode.ENDED:
            self._report("text after the end-of-sentence token")
            self._mode = _Mode.RAW
        if self._at_chat_start:
            return self._skip_stray_think_end(final)
        return self._step_text(final)

    def _markers(self) -> tuple[str, ...]:
        if self._mode is _Mode.REASONING:
            # A tool block right inside reasoning means the model skipped `</think>`: it still is a call.
            return (THINK_END_TEXT, TOOL_CALLS_OPEN, EOS_TEXT)
        if self._mode is _Mode.CONTENT:
            return (TOOL_CALLS_OPEN, EOS_TEXT)
        return (EOS_TEXT,)

    def _step_text(self, final: bool) -> bool:
        markers = self._markers()
        found = [(self._buffer.find(m), m) for m in markers if m in self._buffer]
        if not found:
            text = self._buffer if final else self._buffer[: len(self._buffer) - _held_back(self._buffer, markers)]
            if not final and TOOL_CALLS_OPEN in markers:
                # Trailing newlines may be the separator before a tool block: wait until that is decided.
                text = text[: len(text) - _separator_length(text)]
            self._emit_text(text)
            self._buffer = self._buffer[len(text) :]
            return False
        position, marker = min(found)
        before, self._buffer = self._buffer[:position], self._buffer[position + len(marker) :]
        if marker == TOOL_CALLS_OPEN:
            text = before[: len(before) - _separator_length(before)]
            self._emit_text(text)
            self._enter_tool_block(before[len(text) :] + marker)
        elif marker == THINK_END_TEXT:
            self._emit_text(before)
            self._mode = _Mode.CONTENT
        else:
            self._emit_text(before)
            self._mode = _Mode.ENDED
        return True

    def _skip_stray_think_end(self, final: bool) -> bool:
        if self._buffer.startswith(THINK_END_TEXT):
            self._buffer = self._buffer[len(THINK_END_TEXT) :]
        elif THINK_END_TEXT.startswith(self._buffer) and not final:
            return False
        self._at_chat_start = False
        return True

    def _emit_text(self, text: str) -> None:
        if text:
            kind = ReasoningDelta if self._mode is _Mode.REASONING else ContentDelta
            self._events.append(kind(text))

    # --- tool calls block -----------------------------------------------------------------------

    def _enter_tool_block(self, opening: str) -> None:
        self._mode = _Mode.TOOL_BLOCK
        self._expect = _Expect.INVOKE
        self._unconfirmed = opening

    def _consume(self, length: int) -> str:
        taken, self._buffer = self._buffer[:length], self._buffer[length:]
        self._unconfirmed += taken
        return taken

    def _step_tool_block(self, final: bool) -> bool:
        if self._expect is _Expect.INVOKE:
            return self._expect_tag({INVOKE_OPEN: self._open_invoke, TOOL_CALLS_CLOSE: self._close_block})
        if self._expect is _Expect.PARAMETER:
            return self._expect_tag({PARAMETER_OPEN: self._open_parameter, INVOKE_CLOSE: self._close_invoke})
        if self._expect is _Expect.VALUE:
            return self._read_value(final)
        end = self._buffer.find(">")
        if end < 0:
            return False
        header = self._consume(end + 1)[:-1]
        if self._expect is _Expect.INVOKE_HEADER:
            return self._start_call(header)
        return self._start_parameter(header)

    def _expect_tag(self, handlers: dict[str, Callable[[], None]]) -> bool:
        stripped = self._buffer.lstrip()
        for tag, handler in handlers.items():
            if stripped.startswith(tag):
                self._consume(len(self._buffer) - len(stripped) + len(tag))
                handler()
                return True
        if any(tag.startswith(stripped) for tag in handlers):
            return False
        return self._malformed(f"expected {self._expect.value}, got {stripped[:40]!r}")

    def _open_invoke(self) -> None:
        self._expect = _Expect.INVOKE_HEADER

    def _open_parameter(self) -> None:
        self._expect = _Expect.PARAMETER_HEADER

    def _close_block(self) -> None:
        self._unconfirmed = ""
        self._mode = _Mode.CONTENT

    def _start_call(self, header: str) -> bool:
        match = _INVOKE_HEADER.fullmatch(header)
        if match is None:
            return self._malformed(f"bad invoke header {header!r}")
        self._call = _OpenCall(self._calls_started)
        self._calls_started += 1
        self._events.append(ToolCallStart(self._call.index, self._id_factory(), match.group(1)))
        self._expect = _Expect.PARAMETER
        return True

    def _start_parameter(self, header: str) -> bool:
        match = _PARAMETER_HEADER.fullmatch(header)
        if match is None:
            return self._malformed(f"bad parameter header {header!r}")
        name, string = match.groups()
        call = self._call
        if name in call.parameters:
            return self._malformed(f"parameter {name!r} given twice")
        separator = ", " if call.parameters else "{"
        call.parameters.add(name)
        call.value_is_string = string == "true"
        call.raw_value = []
        key = separator + json.dumps(name, ensure_ascii=False) + ": "
        if call.value_is_string:
            self._add_arguments(key + '"')
        else:
            call.pending_key = key
        self._expect = _Expect.VALUE
        return True

    def _read_value(self, final: bool) -> bool:
        call = self._call
        end = self._buffer.find(PARAMETER_CLOSE)
        if end < 0:
            if final:
                return False
            piece = self._consume(len(self._buffer) - _held_back(self._buffer, (PARAMETER_CLOSE,)))
            if call.value_is_string:
                self._add_arguments(_json_string_body(piece))
            else:
                call.raw_value.append(piece)
            return False
        piece = self._consume(end)
        self._consume(len(PARAMETER_CLOSE))
        if call.value_is_string:
            self._add_arguments(_json_string_body(piece) + '"')
        else:
            self._add_arguments(call.pending_key + _json_value("".join(call.raw_value) + piece))
        self._expect = _Expect.PARAMETER
        return True

    def _add_arguments(self, text: str) -> None:
        if text:
            self._call.arguments.append(text)
            self._events.append(ToolCallArgumentsDelta(self._call.index, text))

    def _close_invoke(self) -> None:
        call = self._call
        self._add_arguments("}" if call.parameters else "{}")
        self._events.append(ToolCallEnd(call.index, "".join(call.arguments)))
        self._call = None
        self._unconfirmed = ""
        self._expect = _Expect.INVOKE

    def _malformed(self, reason: str) -> bool:
        """Give up on the block: its unconfirmed raw text becomes content, the rest of the output too."""
        raw, self._buffer = self._unconfirmed + self._buffer, ""
        self._unconfirmed = ""
        abandoned = self._call.index if self._call is not None else None
        self._call = None
        self._mode = _Mode.RAW
        self._emit_text(raw)
        self._report(f"malformed tool call: {reason}", abandoned)
        return False

    def _report(self, message: str, abandoned: int | None = None) -> None:
        self.errors.append(message)
        self._events.append(ParseError(message, abandoned))


def parse_full(text: str, thinking: bool) -> tuple[str, str, list[dict]]:
    """Whole output -> (reasoning, content, OpenAI tool_calls).

    Malformed DSML ends up in content; run an `OutputParser` to also get the errors."""
    parser = OutputParser(thinking)
    reasoning, content, calls = [], [], {}
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {"id": event.id, "type": "function", "function": {"name": event.name}}
        elif isinstance(event, ToolCallEnd):
            calls[event.index]["function"]["arguments"] = event.arguments
    complete = [call for call in calls.values() if "arguments" in call["function"]]
    return "".join(reasoning), "".join(content), complete


def validate_tool_call(name: str, arguments: str, tools: list[dict] | None) -> str | None:
    """Check a parsed call against the request's tools (OpenAI format); the reason it fails, or None."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools or [] if "function" in t}
    if name not in schemas:
        return f"unknown tool {name!r}"
    try:
        values = json.loads(arguments)
    except json.JSONDecodeError as err:
        return f"arguments of {name!r} are not valid JSON: {err}"
    except RecursionError:
        return f"arguments of {name!r} nest too deeply to check"
    schema = schemas[name]
    if schema is None:
        return None
    validator_class = jsonschema.validators.validator_for(schema)
    try:
        validator_class.check_schema(schema)
    except jsonschema.SchemaError as err:
        return f"the parameters schema of {name!r} is invalid: {err.message}"
    try:
        error = jsonschema.exceptions.best_match(validator_class(schema).iter_errors(values))
    except RecursionError:
        return f"arguments of {name!r} nest too deeply to check"
    if error is None:
        return None
    location = "/".join(str(p) for p in error.absolute_path)
    return f"arguments of {name!r} do not match its schema{f' at {location}' if location else ''}: {error.message}"
