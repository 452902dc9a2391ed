"""/v1/chat/completions: OpenAI request -> DSv4 prompt + grammar -> engine -> reasoning / content / tool_calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ds4.engine.structured_output import GrammarError, GrammarSpec, StructuredOutput
from ds4.serve.chat_encoding import ChatFormatError, encode_chat_request
from ds4.serve.errors import APIError, bad_request
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
    """One chat request, prepared: prompt tokens, sampling params (with a grammar), how to read the output."""

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
            raise bad_request(str(e), param="messages") from e
        self.thinking = prompt.output_starts_in_reasoning
        self.prompt_ids = state.tokenizer.encode(prompt.text)
        state.check_prompt_length(len(self.prompt_ids), request.output_limit)
        self.params = sampling_params(
            request, request.output_limit, request.top_logprobs or 0 if request.logprobs else None
        )
        self.grammar = self._grammar_spec()

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
        """Compile (in the grammar pool, cached) and give the request its own matcher."""
        if self.grammar is None:
            return
        try:
            compiled = await asyncio.wrap_future(state.grammars.submit(self.grammar))
        except GrammarError as e:
            raise bad_request(str(e), param="response_format" if self.grammar.kind != "tool_calls" else "tools") from e
        special = state.tokenizer.special
        self.params.structured_output = StructuredOutput(
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


async def full_response(state: ServerState, turn: ChatTurn, request_id: str, outputs: AsyncIterator) -> dict:
    reader = _Reader(turn)
    reasoning, content, calls, logprobs = [], [], {}, []
    last = None
    async for out in outputs:
        last = out
        if out.new_logprobs:
            logprobs += out.new_logprobs
        for event in reader.feed(out.new_text, out.finished):
            if isinstance(event, ReasoningDelta):
                reasoning.append(event.text)
            elif isinstance(event, ContentDelta):
                content.append(event.text)
            elif isinstance(event, ToolCallStart):
                calls[event.index] = {
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": None},
                }
            elif isinstance(event, ToolCallEnd):
                calls[event.index]["function"]["arguments"] = event.arguments
    if last is None or last.finish_reason == "error":
        raise APIError(500, f"generation failed: {getattr(last, 'error', None) or 'no output'}")
    tool_calls = [call for call in calls.values() if call["function"]["arguments"] is not None]
    message = {
        "role": "assistant",
        "content": "".join(content) or (None if tool_calls else ""),
        "reasoning_content": "".join(reasoning) or None,
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": _finish_reason(last.finish_reason, bool(tool_calls)),
        "stop_reason": last.stop_reason,
    }
    if turn.params.logprobs is not None:
        choice["logprobs"] = {"content": chat_logprobs(state.tokenizer, logprobs)}
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": usage(last),
    }


async def stream_response(
    state: ServerState, turn: ChatTurn, request_id: str, outputs: AsyncIterator
) -> AsyncIterator[str]:
    reader = _Reader(turn)
    created = int(time.time())
    include_usage = bool(turn.request.stream_options and turn.request.stream_options.include_usage)

    def chunk(delta: dict, finish_reason: str | None = None, logprobs=None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse(
            {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    has_calls = False
    async for out in outputs:
        if out.finish_reason == "error":
            yield sse(APIError(500, f"generation failed: {out.error}").body())
            break
        logprobs = None
        if out.new_logprobs and turn.params.logprobs is not None:
            logprobs = {"content": chat_logprobs(state.tokenizer, out.new_logprobs)}
        deltas = [_delta(event, reader) for event in reader.feed(out.new_text, out.finished)]
        deltas = [d for d in deltas if d is not None]
        has_calls = has_calls or any("tool_calls" in d for d in deltas)
        for i, delta in enumerate(deltas):
            yield chunk(delta, logprobs=logprobs if i == 0 else None)
        if logprobs and not deltas:
            yield chunk({}, logprobs=logprobs)
        if out.finished:
            yield chunk({}, _finish_reason(out.finish_reason, has_calls))
            if include_usage:
                yield sse(
                    {
                        "id": request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": state.model_name,
                        "choices": [],
                        "usage": usage(out),
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
