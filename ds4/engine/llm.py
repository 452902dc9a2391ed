"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`, vLLM-style."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from ds4.engine.engine import LLMEngine
from ds4.engine.sampler import TokenLogprobs
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.workers import Launch


@dataclass
class CompletionOutput:
    """One finished request: the prompt as tokens, what was generated, and why it stopped."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # Per generated token: {token_id: logprob} of the `logprobs` most likely tokens plus the chosen one.
    logprobs: list[dict[int, float]] | None = None
    # Per prompt position: {token_id: logprob} of the `prompt_logprobs` most likely tokens plus the prompt
    # token; None for the first position, which has nothing before it.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None


class LLM:
    """Loads a model (default: the built-in tiny one) and runs batches of prompts through the engine.

    Engine flags (max_num_batched_tokens=, max_num_seqs=, kv_cache_memory=, ...) are keyword arguments.
    load_format="dummy" builds the model from a config alone (config="flash", "pro" or a directory) with
    random weights made on the device; num_layers keeps its first layers. tensor_parallel_size=N splits the model
    over N ranks (one GPU each; CPU: processes over gloo) that this process starts; `launch` places them on several
    hosts (ds4.engine.workers), where the processes whose first rank is not 0 follow rank 0 until it closes and get
    `engine` None. `close()` stops the ranks (they also stop when this process exits).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        seed: int | None = None,
        load_format: str = "auto",
        config: str | Path | None = None,
        num_layers: int | None = None,
        launch: Launch | None = None,
        **engine_flags,
    ):
        self.engine = LLMEngine.from_pretrained(
            model,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            seed=seed,
            load_format=load_format,
            config=config,
            num_layers=num_layers,
            launch=launch,
            **engine_flags,
        )
        self.tokenizer = self.engine.tokenizer if self.engine is not None else None
        self._next_id = 0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Complete every prompt (text, or token ids); outputs come back in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        outputs: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"offline-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, token_ids, p or SamplingParams())
            outputs[request_id] = CompletionOutput(request_id, token_ids)
            order.append(request_id)
        self._run(outputs, use_tqdm)
        return [outputs[r] for r in order]

    def _run(self, outputs: dict[str, CompletionOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=len(outputs), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            for step_output in self.engine.step():
                out = outputs[step_output.request_id]
                _accumulate(out, step_output)
                generated += len(step_output.new_token_ids)
                if step_output.finished:
                    bar.update(1)
            bar.set_postfix(out_tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
        bar.close()


def _accumulate(out: CompletionOutput, step) -> None:
    out.token_ids.extend(step.new_token_ids)
    out.text += step.new_text
    if step.new_logprobs is not None:
        out.logprobs = (out.logprobs or []) + [_as_dict(lp) for lp in step.new_logprobs]
    if step.prompt_logprobs is not None:
        out.prompt_logprobs = [None if lp is None else _as_dict(lp) for lp in step.prompt_logprobs]
    if step.finished:
        out.finish_reason, out.stop_reason, out.error = step.finish_reason, step.stop_reason, step.error


def _as_dict(lp: TokenLogprobs) -> dict[int, float]:
    return {**lp.top, lp.token_id: lp.logprob}
