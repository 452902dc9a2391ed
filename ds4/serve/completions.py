"""/v1/completions: raw prompt (text or token ids) in, text out; no chat format, no parsing."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ds4.serve.errors import APIError
from ds4.serve.protocol import CompletionRequest
from ds4.serve.sampling import completion_logprobs, sampling_params, sse, usage
from ds4.serve.state import ServerState


def prompt_token_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    """Token ids as given, or the text encoded after BOS (the tokenizer never adds it by itself)."""
    if isinstance(prompt, list):
        return list(prompt)
    ids = state.tokenizer.encode(prompt)
    bos = state.tokenizer.special.bos
    return ids if ids[:1] == [bos] else [bos] + ids


class CompletionTurn:
    def __init__(self, state: ServerState, request: CompletionRequest):
        self.request = request
        self.prompt_ids = prompt_token_ids(state, request.prompt)
        state.check_prompt_length(len(self.prompt_ids), request.max_tokens)
        self.params = sampling_params(request, request.max_tokens, request.logprobs)


async def full_response(state: ServerState, turn: CompletionTurn, request_id: str, outputs: AsyncIterator) -> dict:
    text, entries, last = [], [], None
    async for out in outputs:
        last = out
        text.append(out.new_text)
        entries += out.new_logprobs or []
    if last is None or last.finish_reason == "error":
        raise APIError(500, f"generation failed: {getattr(last, 'error', None) or 'no output'}")
    choice = {
        "index": 0,
        "text": "".join(text),
        "logprobs": None,
        "finish_reason": last.finish_reason,
        "stop_reason": last.stop_reason,
    }
    if turn.params.logprobs is not None:
        choice["logprobs"] = completion_logprobs(state.tokenizer, entries, 0)
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [choice],
        "usage": usage(last),
    }


async def stream_response(
    state: ServerState, turn: CompletionTurn, request_id: str, outputs: AsyncIterator
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(turn.request.stream_options and turn.request.stream_options.include_usage)
    offset = 0
    async for out in outputs:
        if out.finish_reason == "error":
            yield sse(APIError(500, f"generation failed: {out.error}").body())
            break
        logprobs = None
        if turn.params.logprobs is not None and out.new_logprobs:
            logprobs = completion_logprobs(state.tokenizer, out.new_logprobs, offset)
        offset += len(out.new_text)
        if out.new_text or logprobs or out.finished:
            choice = {
                "index": 0,
                "text": out.new_text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
            }
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.model_name,
                    "choices": [choice],
                }
            )
        if out.finished and include_usage:
            yield sse(
                {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": state.model_name,
                    "choices": [],
                    "usage": usage(out),
                }
            )
    yield "data: [DONE]\n\n"
