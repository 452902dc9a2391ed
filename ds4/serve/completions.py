"""/v1/completions: raw prompts (texts or token ids) in, text out; no chat format, no parsing.

A request holds one or more prompts and asks n choices of each; choice p * n + j is choice j of prompt p
and samples with seed + j (see `_Sampling.choice_seed`). `echo` puts the prompt in front of each choice's
text, and with `logprobs` the prompt tokens' logprobs in front of the generated ones: the engine's prompt
logprobs, null for a first token that nothing precedes. For a text prompt the BOS that ds4 puts in front is
not shown, so the listed tokens are the text's own and its first token carries its logprob after BOS.
`max_tokens` 0 asks for the prompt alone: the engine still runs one step (it always samples a token), and that
token is dropped.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ds4.serve.errors import APIError
from ds4.serve.fanout import ChoiceStreams
from ds4.serve.protocol import CompletionRequest
from ds4.serve.sampling import completion_logprobs, join_completion_logprobs, sampling_params, sse, usage
from ds4.serve.state import ServerState


def prompt_token_ids(state: ServerState, text_ids: list[int]) -> list[int]:
    """A text's token ids after BOS (the tokenizer never adds it by itself), unless the text starts with it."""
    bos = state.tokenizer.special.bos
    return text_ids if text_ids[:1] == [bos] else [bos] + text_ids


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str  # what echo shows
    first_shown: int  # 1 when ds4 put BOS in front of a text: that token is not shown


def _prompt(state: ServerState, prompt: str | list[int], max_tokens: int | None) -> _Prompt:
    if isinstance(prompt, list):
        state.check_prompt(prompt, max_tokens, param="prompt")
        return _Prompt(list(prompt), state.tokenizer.decode(prompt), 0)
    text_ids = state.tokenizer.encode(prompt)
    token_ids = prompt_token_ids(state, text_ids)
    state.check_prompt(token_ids, max_tokens, param="prompt")
    return _Prompt(token_ids, prompt, len(token_ids) - len(text_ids))


class CompletionTurn:
    """One completion request, prepared: its prompts and one engine request per choice."""

    def __init__(self, state: ServerState, request: CompletionRequest):
        self.request = request
        self.prompts = [_prompt(state, p, request.max_tokens) for p in request.prompts]
        self.drops_output = request.max_tokens == 0
        max_tokens = 1 if self.drops_output else request.max_tokens
        wants_prompt_logprobs = request.echo and request.logprobs is not None
        self.choices = []
        for prompt in self.prompts:
            for j in range(request.n):
                params = sampling_params(
                    request,
                    state.vocab_size,
                    max_tokens=max_tokens,
                    logprobs=request.logprobs,
                    seed=request.choice_seed(j),
                    prompt_logprobs=request.logprobs if wants_prompt_logprobs else None,
                )
                self.choices.append((prompt.token_ids, params))

    def prompt_of(self, index: int) -> _Prompt:
        return self.prompts[index // self.request.n]


class _Choice:
    """One choice's engine outputs -> its deltas of text and legacy logprobs (the echo first)."""

    def __init__(self, state: ServerState, turn: CompletionTurn, index: int):
        self.tokenizer = state.tokenizer
        self.turn = turn
        self.prompt = turn.prompt_of(index)
        self.text_length = 0
        self.started = False
        self.last = None

    def delta(self, out) -> tuple[str, dict | None]:
        request = self.turn.request
        self.last = out
        texts, logprobs = [], []
        if not self.started:
            self.started = True
            if request.echo:
                texts.append(self.prompt.text)
                if request.logprobs is not None:
                    # None only when the choice ended (aborted) before its first token: nothing was scored.
                    entries = out.prompt_logprobs or [None] * len(self.prompt.token_ids)
                    first = self.prompt.first_shown
                    logprobs.append(
                        completion_logprobs(self.tokenizer, self.prompt.token_ids[first:], entries[first:], 0)
                    )
        if not self.turn.drops_output:
            offset = self.text_length + sum(len(t) for t in texts)
            texts.append(out.new_text)
            if request.logprobs is not None and out.new_logprobs:
                ids = [e.token_id for e in out.new_logprobs]
                logprobs.append(completion_logprobs(self.tokenizer, ids, out.new_logprobs, offset))
        text = "".join(texts)
        self.text_length += len(text)
        return text, join_completion_logprobs(logprobs) if logprobs else None

    @property
    def finish_reason(self) -> str | None:
        if self.last is None or not self.last.finished:
            return None
        return "length" if self.turn.drops_output and self.last.finish_reason != "abort" else self.last.finish_reason

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.last is None or self.turn.drops_output else self.last.num_output_tokens


def _usage(turn: CompletionTurn, choices: list[_Choice]) -> dict:
    prompt_tokens = sum(len(prompt.token_ids) for prompt in turn.prompts)
    return usage(prompt_tokens, sum(choice.num_output_tokens for choice in choices))


def _failed(out) -> APIError:
    return APIError(500, f"generation failed: {getattr(out, 'error', None) or 'no output'}")


async def full_response(state: ServerState, turn: CompletionTurn, request_id: str, outputs: ChoiceStreams) -> dict:
    choices = [_Choice(state, turn, i) for i in range(len(turn.choices))]
    texts = [[] for _ in choices]
    logprobs = [[] for _ in choices]
    async for index, out in outputs:
        if out.finish_reason == "error":
            raise _failed(out)
        text, part = choices[index].delta(out)
        texts[index].append(text)
        if part is not None:
            logprobs[index].append(part)
    if any(choice.last is None for choice in choices):
        raise _failed(None)
    wants_logprobs = turn.request.logprobs is not None
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [
            {
                "index": i,
                "text": "".join(texts[i]),
                "logprobs": join_completion_logprobs(logprobs[i]) if wants_logprobs else None,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.last.stop_reason,
            }
            for i, choice in enumerate(choices)
        ],
        "usage": _usage(turn, choices),
    }


async def stream_response(
    state: ServerState, turn: CompletionTurn, request_id: str, outputs: ChoiceStreams
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(turn.request.stream_options and turn.request.stream_options.include_usage)
    choices = [_Choice(state, turn, i) for i in range(len(turn.choices))]

    def chunk(choice_list: list[dict], **extra) -> str:
        return sse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": choice_list,
                **extra,
            }
        )

    async for index, out in outputs:
        if out.finish_reason == "error":
            yield sse(_failed(out).body())
            break
        text, logprobs = choices[index].delta(out)
        if text or logprobs or out.finished:
            yield chunk(
                [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": choices[index].finish_reason}]
            )
    else:
        if include_usage:
            yield chunk([], usage=_usage(turn, choices))
    yield "data: [DONE]\n\n"
