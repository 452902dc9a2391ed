"""An LLMEngine stand-in whose 'model' is a token source, for server tests that need exact control of the output.

Everything around the model is real: it runs behind the real AsyncEngine, masks logits with the real
structured-output hook, detokenizes with the real incremental detokenizer. The source gives each step's
logits: a script of tokens to prefer (a large bonus on the scripted token over noise), then seeded noise,
which writes endless free text the way random weights do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ds4.engine.detokenizer import IncrementalDetokenizer, TokenBytes
from ds4.engine.engine import EngineStats, RequestOutput
from ds4.engine.sampler import compute_logprobs
from ds4.engine.scheduler import RequestRejected
from ds4.engine.structured_output import apply_structured_output

VOCAB = 129280
EOS = 1
_SCRIPT_BONUS = 40.0


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: object
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator
    output_token_ids: list[int] = field(default_factory=list)


class ScriptedEngine:
    """`script` (list of token ids, or None for pure noise) applies to every request added after it is set."""

    workers = None  # one rank

    def close(self) -> None:
        pass

    def __init__(self, tokenizer, max_model_len: int = 2048, num_pages: int = 64, step_delay_s: float = 0.0005):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB, eos_token_id=EOS))
        self.script: list[int] | None = None
        self._token_bytes = TokenBytes(tokenizer.backend)
        self._num_pages = num_pages
        self.step_delay_s = step_delay_s
        self._requests: dict[str, _Request] = {}
        self._scripts: dict[str, list[int] | None] = {}
        self._aborted: list[RequestOutput] = []
        self._counts = dict(prompt=0, generation=0, steps=0, finished=0)
        self.max_running = 0

    def check_request(self, request_id, prompt_token_ids, params) -> None:
        params.validate(VOCAB)
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected(f"prompt of {len(prompt_token_ids)} tokens >= max_model_len {self.max_model_len}")

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.check_request(request_id, prompt_token_ids, params)
        seed = params.seed if params.seed is not None else len(self._scripts)
        self._requests[request_id] = _Request(
            request_id,
            list(prompt_token_ids),
            params,
            IncrementalDetokenizer(self._token_bytes, params.skip_special_tokens),
            torch.Generator().manual_seed(seed),
        )
        self._scripts[request_id] = None if self.script is None else list(self.script)
        self._counts["prompt"] += len(prompt_token_ids)
        self.max_running = max(self.max_running, len(self._requests))

    def abort(self, request_id) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._counts["finished"] += 1
            self._aborted.append(self._output(request, [], "", "abort", None))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for request in list(self._requests.values()):
            outputs.append(self._advance(request))
        self._counts["steps"] += 1
        return outputs

    def stats(self) -> EngineStats:
        used = len(self._requests)
        return EngineStats(
            num_running=used,
            num_waiting=0,
            num_preemptions=0,
            num_pages=self._num_pages,
            num_free_pages=self._num_pages - used,
            capacity_tokens=self._num_pages * 256,
            prompt_tokens=self._counts["prompt"],
            generation_tokens=self._counts["generation"],
            num_steps=self._counts["steps"],
            num_finished=self._counts["finished"],
        )

    def _logits(self, request: _Request) -> torch.Tensor:
        logits = torch.randn(1, VOCAB, generator=request.generator)
        script = self._scripts[request.request_id]
        step = len(request.output_token_ids)
        if script is not None and step < len(script):
            logits[0, script[step]] += _SCRIPT_BONUS
        return logits

    def _advance(self, request: _Request) -> RequestOutput:
        raw = self._logits(request)
        masked = apply_structured_output(raw, [request])
        token_id = int(masked[0].argmax())
        request.output_token_ids.append(token_id)
        self._counts["generation"] += 1
        params = request.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = compute_logprobs(raw, torch.tensor([token_id]), [params.logprobs])
        reason = None
        if token_id == EOS and not params.ignore_eos:
            reason = "stop"
        elif params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens:
            reason = "length"
        elif len(request.prompt_token_ids) + len(request.output_token_ids) >= self.max_model_len:
            reason = "length"
        text = "" if reason == "stop" else request.detokenizer.add_token(token_id)
        if reason is not None:
            text += request.detokenizer.flush()
            del self._requests[request.request_id]
            self._counts["finished"] += 1
        return self._output(request, [token_id], text, reason, logprobs)

    @staticmethod
    def _output(request: _Request, token_ids, text, reason, logprobs) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            new_logprobs=logprobs,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=len(request.output_token_ids),
        )
