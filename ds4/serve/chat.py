"""/v1/chat/completions: OpenAI request -> DSv4 prompt + grammar -> engine -> reasoning / content / tool_calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ds4.engine.structured_output import GrammarError, GrammarSpec, StructuredOutput
from ds4.serve.chat_encoding import ChatFormatError, encode_chat_request
from ds4.serve.errors import APIError, bad_request, field_named_by
from ds4.serve.fanout import ChoiceStreams
from ds4.serve.output_parser import (
    ContentDelta,
    OutputParser,
    ParseError,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    validate_tool_call,
)
from ds4.serve.protocol import ChatCompletionRequest, NamedToolChoice
from ds4.serve.sampling import chat_logprobs, sampling_params, sse, usage
from ds4.serve.state import ServerState

logger = logging.getLogger(__name__)


class ChatTurn:
    """One chat request, prepared: prompt tokens, one SamplingParams per choice (each with its own grammar
    matcher), how to read the output. Choice j samples with seed + j."""

    def __init__(self, state: ServerState, request: ChatCompletionRequest):
        self.request = request
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
        self.tool_choice = request.tool_choice or ("auto" if tools else "none")
        self.tools = tools if self.tool_choice != "none" else []
        try:
            prompt = encode_chat_request(
                request.messages,
                self.tools or None,
                request.chat_template_kwargs,
                request.reasoning_effort,
                continue_final_message=request.continue_final_message,
            )
        except ChatFormatError as e:
            raise bad_request(str(e), param=field_named_by(str(e), type(request).model_fields) or "messages") from e
        self.thinking = prompt.output_starts_in_reasoning
        self.prompt_ids = state.tokenizer.encode(prompt.text)
        state.check_prompt(self.prompt_ids, request.output_limit, param="messages")
        self.wants_logprobs = request.logprobs
        self.params = [
            sampling_params(
                request,
                state.vocab_size,
                max_tokens=request.output_limit,
                logprobs=request.top_logprobs or 0 if request.logprobs else None,
                seed=request.choice_seed(j),
            )
            for j in range(request.n)
        ]
        self.grammar = self._grammar_spec()

    @property
    def choices(self) -> list[tuple[list[int], object]]:
        return [(self.prompt_ids, params) for params in self.params]

    def _grammar_spec(self) -> GrammarSpec | None:
        request = self.request
        tools_spec = None
        if self.tools:
            choice = self.tool_choice
            if isinstance(choice, NamedToolChoice):
                choice = choice.model_dump()
            strict = choice != "auto" or any(tool["function"].get("strict") is True for tool in self.tools)
            if strict:
                tools_spec = GrammarSpec.tool_calls(self.tools, choice, request.parallel_tool_calls)
        response_format = request.response_format
        if response_format is None or response_format.type == "text":
            return tools_spec
        if tools_spec is not None:
            raise bad_request(
                "response_format cannot be combined with a required, named or strict tool call", param="response_format"
            )
        if response_format.type == "json_object":
            return GrammarSpec.json_object()
        return GrammarSpec.json_schema(response_format.json_schema.json_schema)

    async def attach_grammar(self, state: ServerState) -> None:
        """Compile (in the grammar pool, cached) and give each choice its own matcher."""
        if self.grammar is None:
            return
        try:
            compiled = await asyncio.wrap_future(state.grammars.submit(self.grammar))
        except GrammarError as e:
            raise bad_request(str(e), param="response_format" if self.grammar.kind != "tool_calls" else "tools") from e
        special = state.tokenizer.special
        for params in self.params:
            params.structured_output = StructuredOutput(
                compiled, reasoning=self.thinking, think_end_token_id=special.think_end, eos_token_id=special.eos
            )


class _Reader:
    """Engine outputs -> parser events, with tool_choice and parallel_tool_calls applied and calls checked."""

    def __init__(self, turn: ChatTurn):
        self.turn = turn
        self.parser = OutputParser(thinking=turn.thinking)
        self.call_names: dict[int, str] = {}  # the calls passed on, by index

    def feed(self, text: str, final: bool) -> list:
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        return [e for e in events if self._keep(e)]

    def _keep(self, event) -> bool:
        if isinstance(event, ParseError):
            logger.warning("output of a chat request did not parse: %s", event.message)
            return False
        if isinstance(event, ToolCallStart):
            if not self.turn.tools or (self.call_names and not self.turn.request.parallel_tool_calls):
                return False
            self.call_names[event.index] = event.name
        if isinstance(event, (ToolCallArgumentsDelta, ToolCallEnd)) and event.index not in self.call_names:
            return False
        if isinstance(event, ToolCallEnd):
            problem = validate_tool_call(self.call_names[event.index], event.arguments, self.turn.tools)
            if problem:  # a strict grammar rules this out; without one the model may still get it wrong
                logger.warning("tool call does not match its schema: %s", problem)
        return True


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _usage(turn: ChatTurn, outputs: list) -> dict:
    return usage(len(turn.prompt_ids), sum(out.num_output_tokens for out in outputs if out is not None))


def _failed(out) -> APIError:
    return APIError(500, f"generation failed: {getattr(out, 'error', None) or 'no output'}")


class _Message:
    """One choice's whole message, built from its parser events."""

    def __init__(self):
        self.reasoning, self.content, self.calls, self.logprobs = [], [], {}, []

    def add(self, event) -> None:
        if isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            self.content.append(event.text)
        elif isinstance(event, ToolCallStart):
            self.calls[event.index] = {
                "id": event.id,
                "type": "function",
                "function": {"name": event.name, "arguments": None},
            }
        elif isinstance(event, ToolCallEnd):
            self.calls[event.index]["function"]["arguments"] = event.arguments

    def choice(self, state: ServerState, turn: ChatTurn, index: int, last) -> dict:
        tool_calls = [call for call in self.calls.values() if call["function"]["arguments"] is not None]
        message = {
            "role": "assistant",
            "content": "".join(self.content) or (None if tool_calls else ""),
            "reasoning_content": "".join(self.reasoning) or None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": chat_logprobs(state.tokenizer, self.logprobs)} if turn.wants_logprobs else None,
            "finish_reason": _finish_reason(last.finish_reason, bool(tool_calls)),
            "stop_reason": last.stop_reason,
        }


async def full_response(state: ServerState, turn: ChatTurn, request_id: str, outputs: ChoiceStreams) -> dict:
    readers = [_Reader(turn) for _ in turn.params]
    messages = [_Message() for _ in turn.params]
    last = [None] * len(turn.params)
    async for index, out in outputs:
        if out.finish_reason == "error":
            raise _failed(out)
        last[index] = out
        messages[index].logprobs += out.new_logprobs or []
        for event in readers[index].feed(out.new_text, out.finished):
            messages[index].add(event)
    if any(out is None for out in last):
        raise _failed(None)
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [message.choice(state, turn, i, last[i]) for i, message in enumerate(messages)],
        "usage": _usage(turn, last),
    }


async def stream_response(
    state: ServerState, turn: ChatTurn, request_id: str, outputs: ChoiceStreams
) -> AsyncIterator[str]:
    readers = [_Reader(turn) for _ in turn.params]
    last = [None] * len(turn.params)
    has_calls = [False] * len(turn.params)
    created = int(time.time())
    include_usage = bool(turn.request.stream_options and turn.request.stream_options.include_usage)

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }
        )

    for index in range(len(turn.params)):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, out in outputs:
        if out.finish_reason == "error":
            yield sse(_failed(out).body())
            break
        last[index] = out
        logprobs = None
        if out.new_logprobs and turn.wants_logprobs:
            logprobs = {"content": chat_logprobs(state.tokenizer, out.new_logprobs)}
        deltas = [_delta(event, readers[index]) for event in readers[index].feed(out.new_text, out.finished)]
        deltas = [d for d in deltas if d is not None]
        has_calls[index] = has_calls[index] or any("tool_calls" in d for d in deltas)
        for i, delta in enumerate(deltas):
            yield chunk(index, delta, logprobs=logprobs if i == 0 else None)
        if logprobs and not deltas:
            yield chunk(index, {}, logprobs=logprobs)
        if out.finished:
            yield chunk(index, {}, _finish_reason(out.finish_reason, has_calls[index]))
    else:
        if include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": _usage(turn, last),
                }
            )
    yield "data: [DONE]\n\n"


def _delta(event, reader: _Reader) -> dict | None:
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ToolCallStart):
        return {
            "tool_calls": [
                {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            ]
        }
    if isinstance(event, ToolCallArgumentsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    if isinstance(event, ToolCallEnd):
        return None
    raise TypeError(f"unexpected parser event {event!r}")
