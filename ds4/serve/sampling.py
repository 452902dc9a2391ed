"""Shared pieces of the generation endpoints: OpenAI fields -> SamplingParams, logprobs, usage, SSE framing."""

from __future__ import annotations

import json

from ds4.engine.sampling_params import SamplingParams
from ds4.serve.errors import bad_request


def sampling_params(request, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The engine's params for one request (a fresh object: it may carry the request's own grammar state)."""
    optional = {
        name: getattr(request, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if getattr(request, name) is not None
    }
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=request.logit_bias,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            **optional,
        )
    except ValueError as e:
        raise bad_request(str(e)) from e


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, entries) -> list[dict]:
    """Chat format: per token {token, logprob, bytes, top_logprobs: [...]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]} for e in entries]


def completion_logprobs(tokenizer, entries, text_offset: int) -> dict:
    """Legacy completions format: parallel lists of tokens, their logprobs, top alternatives and text offsets."""
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        tokens.append(_token_text(tokenizer, e.token_id))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top.items()} for e in entries],
        "text_offset": offsets,
    }


def usage(out) -> dict:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
