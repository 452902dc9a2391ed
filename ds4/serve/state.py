"""What every handler shares: the engine, the tokenizer, the grammar cache, metrics, and request bookkeeping.

The engine is an AsyncEngine (ds4/engine/async_engine.py) or anything with its surface:
    await add_request(request_id, prompt_token_ids, params) -> async iterator of RequestOutput
    abort(request_id)            stops a request and frees its pages
    stats() -> EngineStats       running / waiting / cache / preemption / token counters
    await shutdown()
    engine                       the LLMEngine: tokenizer, max_model_len, model.cfg.vocab_size
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from ds4.engine.async_engine import EngineDeadError
from ds4.engine.structured_output import GrammarCache, grammar_tokenizer_info
from ds4.serve.errors import APIError, bad_request
from ds4.serve.fanout import ChoiceStreams
from ds4.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class ServerState:
    def __init__(
        self,
        engine,
        served_model_names: list[str],
        api_key: str | None = None,
        grammar_cache: GrammarCache | None = None,
    ):
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the server needs an engine with a tokenizer")
        self.served_model_names = served_model_names
        self.api_key = api_key
        self.grammars = grammar_cache or GrammarCache(
            grammar_tokenizer_info(
                _backend(self.tokenizer), engine.engine.model.cfg.vocab_size, self.tokenizer.special.eos
            )
        )
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())
        self.shutting_down = False
        self.active_requests = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model.cfg.vocab_size

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {self.served_model_names}",
                param="model",
                code="model_not_found",
            )

    def check_prompt(self, prompt_ids: list[int], max_tokens: int | None, param: str) -> None:
        """400 naming `param` for a prompt the engine would refuse: ids outside the vocabulary, too long."""
        vocab = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param}: token ids outside the vocabulary of {vocab}: {bad[:8]}", param=param)
        limit = self.max_model_len
        num_prompt_tokens = len(prompt_ids)
        if num_prompt_tokens >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for output",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has "
                f"{num_prompt_tokens} tokens and max_tokens asks for {max_tokens} more",
                param="max_tokens",
                code="context_length_exceeded",
            )

    async def generate(self, prefix: str, choices: list[tuple[list[int], object]]) -> tuple[str, ChoiceStreams]:
        """Start one engine request per (prompt token ids, SamplingParams) choice, all of them or none; returns
        (request id, their outputs as one ChoiceStreams). Leaving it early (client gone, handler error) aborts
        every choice still running, so its pages go back at once."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        engine_ids = [request_id] if len(choices) == 1 else [f"{request_id}-{i}" for i in range(len(choices))]
        arrival = time.monotonic()
        streams = []
        try:
            for engine_id, (prompt_ids, params) in zip(engine_ids, choices):
                stream = await self.engine.add_request(engine_id, prompt_ids, params)
                streams.append(self._follow(engine_id, stream, arrival))
        except (ValueError, EngineDeadError) as e:  # RequestRejected and bad parameters; a dead engine
            for engine_id in engine_ids[: len(streams)]:
                self.abort(engine_id)
            raise APIError(500 if isinstance(e, EngineDeadError) else 400, str(e)) from e

        def abort_all() -> None:
            for engine_id in engine_ids:
                self.abort(engine_id)

        return request_id, ChoiceStreams(streams, abort_all)

    async def _follow(self, request_id: str, stream, arrival: float):
        self._enter()
        finished = False
        last = None
        try:
            async for out in stream:
                now = time.monotonic()
                if out.new_token_ids:
                    if last is None:
                        self.metrics.time_to_first_token.observe(now - arrival)
                    else:
                        for _ in out.new_token_ids:
                            self.metrics.inter_token_latency.observe((now - last) / len(out.new_token_ids))
                    last = now
                if out.finished:
                    finished = True
                    self._record_finish(out, now - arrival)
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._leave()

    def abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:  # aborting must never turn a disconnect into a server error
            logger.exception("abort of %s failed", request_id)

    def _record_finish(self, out, latency: float) -> None:
        self.metrics.finished.labels(out.finish_reason or "unknown").inc()
        self.metrics.request_latency.observe(latency)
        self.metrics.request_prompt_tokens.inc(out.num_prompt_tokens)
        self.metrics.request_generation_tokens.inc(out.num_output_tokens)

    def _enter(self) -> None:
        self.active_requests += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait for the running ones; False if some were still running at the timeout."""
        self.shutting_down = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False


def _backend(tokenizer):
    """The `tokenizers.Tokenizer` inside ds4's DSV4Tokenizer (xgrammar needs the raw vocabulary)."""
    return getattr(tokenizer, "backend", tokenizer)
