"""Shared pieces of the generation endpoints: OpenAI fields -> SamplingParams, logprobs, usage, SSE framing."""

from __future__ import annotations

import json
import math

from ds4.engine.sampling_params import SamplingParams
from ds4.serve.errors import bad_request, field_named_by

# What a logprob of -inf is written as: JSON has no infinity (vLLM's convention).
_NEG_INF_LOGPROB = -9999.0


def sampling_params(
    request,
    vocab_size: int,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    seed: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's params for one choice (a fresh object: it may carry the choice's own grammar state)."""
    optional = {
        name: getattr(request, name)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if getattr(request, name) is not None
    }
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            seed=seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=request.logit_bias,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **optional,
        )
        params.validate(vocab_size)
    except ValueError as e:
        raise bad_request(str(e), param=field_named_by(str(e), type(request).model_fields)) from e
    if not all(math.isfinite(getattr(params, name)) for name in _FLOAT_FIELDS):
        raise bad_request("sampling parameters must be finite numbers")
    return params


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _finite(logprob: float) -> float:
    return logprob if logprob > _NEG_INF_LOGPROB else _NEG_INF_LOGPROB


def chat_logprobs(tokenizer, entries) -> list[dict]:
    """Chat format: per token {token, logprob, bytes, top_logprobs: [...]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]} for e in entries]


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, text_offset: int) -> dict:
    """Legacy completions format: parallel lists of tokens, their logprobs, top alternatives and text offsets.
    An entry of None (the first prompt token, which nothing predicts) has null logprobs."""
    tokens, offsets = [], []
    for token_id in token_ids:
        offsets.append(text_offset)
        tokens.append(_token_text(tokenizer, token_id))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else _finite(e.logprob) for e in entries],
        "top_logprobs": [
            None if e is None else {_token_text(tokenizer, t): _finite(lp) for t, lp in e.top.items()} for e in entries
        ],
        "text_offset": offsets,
    }


def join_completion_logprobs(parts: list[dict]) -> dict:
    return {key: [item for part in parts for item in part[key]] for key in _LOGPROB_KEYS}


_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
