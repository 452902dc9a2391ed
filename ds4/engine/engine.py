"""LLMEngine: requests in, incremental outputs out; one `step()` = schedule -> run the model -> postprocess.

engine = LLMEngine.from_pretrained(model_dir, device="cpu", max_num_seqs=8, kv_cache_memory=1 << 28)
engine.add_request("a", prompt_token_ids, SamplingParams(max_tokens=16))
while engine.has_unfinished_requests():
    for out in engine.step():
        ...  # out.new_token_ids, out.new_text, out.finished, out.finish_reason

Async decode (`async_decode`, on by default; it acts where CUDA graphs replay): a step is launched (its model calls
and sampling queued on the device) and then finished (its tokens read back, the host's wait for the device). When
the step just launched is a plain decode step, the next one is scheduled and launched before it is finished: each
request one token further, its input the launched step's sampled token, taken on the device. The device then
computes step N + 1 while the host postprocesses step N (tokens appended, stop checks, detokenisation, prefix-cache
commits), and `step()` returns N's outputs. A step runs ahead only if it equals what the synchronous engine would
run (LLMEngine._chunks_ahead, Scheduler.schedule_ahead): the same requests (none finished, none admitted or
preempted), one rank, no speculative decoding, sampling that needs no earlier token on the host (no grammar, bias,
min_tokens, penalties, logprobs); otherwise the step in flight is finished first and the engine schedules as usual.
A page end the step reaches keeps its prefix-cache snapshot as usual, keyed only once the page's tokens are known. A
request that finishes at N (EOS, max_tokens, a stop string, an abort) has run one row too many in N + 1: that row is
dropped unread. Its pages and slot go back at once, but no scheduling happens while a step is in flight, so nothing
reuses them before N + 1 has completed (and the device runs steps in order).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ds4.engine.config import EngineConfig, EngineConfigError
from ds4.engine.detokenizer import IncrementalDetokenizer, TokenBytes
from ds4.engine.model_runner import ChunkResult, LaunchedStep, build_runner
from ds4.engine.page_allocator import PageAllocator
from ds4.engine.prefix_cache import PrefixCache
from ds4.engine.sampler import Sampler, TokenLogprobs, samples_from_logits_alone
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.scheduler import RequestRejected, ScheduledChunk, Scheduler
from ds4.engine.sequence import Sequence
from ds4.engine.speculative import SpecDecodeStats
from ds4.engine.step_channel import RanksOutOfStep
from ds4.engine.stop import LENGTH, STOP, StopChecker, token_finish_reason
from ds4.engine.workers import Launch, Ranks, follow, start_ranks

logger = logging.getLogger(__name__)

SPEC_LOG_INTERVAL_S = 10.0

__all__ = ["LLMEngine", "RequestOutput", "EngineStats", "RequestRejected", "RanksOutOfStep"]


@dataclass
class RequestOutput:
    """What one request produced in one step (deltas), and whether it is done."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    # "stop" (EOS, a stop token or stop string), "length" (max_tokens or max_model_len), "abort", "error".
    finish_reason: str | None = None
    # The stop token id or stop string that ended the request (None for EOS and other reasons).
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    # Sent once, with the request's first output: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # since start
    num_pages: int
    num_free_pages: int
    capacity_tokens: int
    prompt_tokens: int  # prefill tokens run through the model since start (recomputation included)
    generation_tokens: int  # tokens sampled since start
    num_steps: int
    num_finished: int
    num_steps_ahead: int = 0  # of num_steps, those launched before the previous step's tokens were read (async decode)
    # Prefix caching: pages kept under a hash (held by requests or reclaimable), and since start the tokens
    # of admitted requests, of those the tokens taken from the cache, and the cached pages evicted.
    num_cached_pages: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evicted_pages: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    spec_decode: SpecDecodeStats | None = None  # with speculative decoding

    @property
    def cache_usage(self) -> float:
        return 1.0 - self.num_free_pages / self.num_pages


class LLMEngine:
    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        tokenizer=None,
        seed: int | None = None,
        workers: Ranks | None = None,
    ):
        """`model` a loaded DeepseekV4Model (rank 0's shard with tensor parallelism); `tokenizer` (DSV4Tokenizer or
        tokenizers.Tokenizer) for text and stops; `workers` the ranks of a tensor-parallel engine (from_pretrained
        starts them), which run every step's model calls with rank 0."""
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self._token_bytes = TokenBytes(getattr(tokenizer, "backend", tokenizer)) if tokenizer is not None else None
        self.device = next(model.parameters()).device
        k = self.config.num_speculative_tokens
        if k:
            _check_mtp(model)
        self.workers = workers
        self.sampler = Sampler(eos_token_ids=(model.cfg.eos_token_id,), seed=seed)
        channel = workers.channel if workers is not None else None
        self.plan, self.runner = build_runner(model, self.config, self.device, self.sampler, channel)
        self.cache = self.runner.cache
        plan = self.plan
        self.prefix_cache = PrefixCache(plan.page_size, plan.num_snapshots) if plan.num_snapshots else None
        self.allocator = PageAllocator(plan.num_pages, self.config.max_num_seqs, plan.page_size, self.prefix_cache)
        self.scheduler = Scheduler(self.config, self.allocator, self.plan.max_model_len)
        self.spec_decode = SpecDecodeStats(k) if k else None
        self._spec_logged_at, self._spec_logged_drafts = time.monotonic(), 0
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._ahead: LaunchedStep | None = None  # a step launched ahead of the last one's tokens (async decode)
        self._prompt_tokens = self._generation_tokens = self._steps = self._steps_ahead = self._finished = 0

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        weight_format: str = "auto",
        seed: int | None = None,
        load_format: str = "auto",
        config: str | Path | None = None,
        num_layers: int | None = None,
        launch: Launch | None = None,
        **engine_flags,
    ) -> LLMEngine | None:
        """Load a checkpoint (default: the built-in tiny model) and its tokenizer; engine_flags: EngineConfig fields.

        load_format "dummy" builds the model from a config alone (see ds4.engine.loader): `config` "flash", "pro"
        or a directory, else model_dir's config.json, else the tiny model's; num_layers keeps the first layers.
        weight_format: see DeepseekV4Model ("auto": checkpoint precision on CUDA, dequantised elsewhere).

        tensor_parallel_size N > 1: the layout is checked against the config before any weight is read, then this
        host's ranks start (ds4.engine.workers; `launch`: the hosts and the rendezvous, or torchrun's environment).
        The engine is rank 0's; in a process whose rank is not 0 (another host's, or under torchrun) this runs
        rank 0's steps until rank 0 stops, then returns None."""
        from ds4.engine.loader import ModelSource, checkpoint_dir, model_config
        from ds4.tokenizer import load_tokenizer

        engine_config = EngineConfig.from_kwargs(**engine_flags)
        model_dir = checkpoint_dir(model_dir, load_format)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = _resolve_dtype(dtype, device)
        cfg = model_config(model_dir, config, load_format, num_layers)
        with_mtp = engine_config.speculative_config is not None
        source = ModelSource(
            cfg, model_dir, load_format, torch_dtype, kv_cache_dtype, weight_format, seed or 0, with_mtp
        )
        ranks = start_ranks(cfg, engine_config, source, device, launch)
        if ranks is not None:
            if ranks.placement.rank != 0:
                follow(ranks, source, engine_config, device.type)
                ranks.stop()
                return None
            device = ranks.placement.device(device.type)
        try:
            model = source.load(device, ranks.parallel if ranks is not None else None)
            tokenizer_file = model_dir / "tokenizer.json" if model_dir is not None else None
            tokenizer = load_tokenizer(
                tokenizer_file if tokenizer_file is not None and tokenizer_file.exists() else None
            )
            return cls(model, engine_config, tokenizer, seed, ranks)
        except BaseException:
            if ranks is not None:
                ranks.stop()
            raise

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing to do with one rank)."""
        if self.workers is not None:
            self.workers.stop()
            self.workers = None

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (RequestRejected when it can never run) for a request add_request would refuse.

        Reads only fixed settings, so another thread may call it while the engine steps."""
        vocab = self.model.cfg.vocab_size
        params.validate(vocab)
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: prompt token ids outside the vocabulary of {vocab}: {bad[:8]}")
        if params.stop and self._token_bytes is None:
            raise ValueError(f"request {request_id!r}: stop strings need an engine with a tokenizer")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len} (prompt plus at least one output token)"
            )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request; raises RequestRejected (a ValueError) if it can never run, ValueError on bad input."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        self.check_request(request_id, prompt_token_ids, params)
        prompt = list(prompt_token_ids)
        detokenizer = stop_checker = None
        if self._token_bytes is not None:
            detokenizer = IncrementalDetokenizer(self._token_bytes, params.skip_special_tokens)
            stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        seq = Sequence(request_id, prompt, params, self.sampler.new_request(params, prompt), detokenizer, stop_checker)
        self.scheduler.add(seq)
        self.requests[request_id] = seq

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages go back now and the next step() reports it finished with "abort"."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.finish(seq, "abort")
        self._finished += 1
        self._aborted.append(self._output(seq, [], "", None))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted) or self._ahead is not None

    def step(self) -> list[RequestOutput]:
        """The outputs of one model step. With async decode (see the module docstring) a plain decode step launches
        the next one before it waits for its own tokens; that step's outputs come from the next call.

        Raises RanksOutOfStep when a rank of a tensor-parallel engine failed: no step can run any more."""
        if self.workers is not None and self.workers.fault is not None:
            raise RanksOutOfStep(self.workers.fault)
        outputs, self._aborted = self._aborted, []
        launched, self._ahead = self._ahead, None
        if launched is None:
            scheduled = self.scheduler.schedule()
            if scheduled.is_empty:
                return outputs
            chunks = scheduled.chunks
            snapshots = self.prefix_cache.plan_step(chunks) if self.prefix_cache is not None else None
            launched = self._attempt(outputs, chunks, lambda: self.runner.launch(chunks, snapshots))
            if launched is None:
                return outputs
        results = self._attempt(outputs, launched.chunks, lambda: self._launch_ahead_and_finish(launched))
        if results is not None:
            self._postprocess_step(launched.chunks, results, outputs)
        return outputs

    def _launch_ahead_and_finish(self, launched: LaunchedStep) -> list[ChunkResult]:
        """Launch the next step when it may run ahead of `launched`'s tokens, then wait for those."""
        chunks = self._chunks_ahead(launched)
        if chunks is not None:
            snapshots = self.prefix_cache.plan_step(chunks) if self.prefix_cache is not None else None
            self._ahead = self.runner.launch(chunks, snapshots, after=launched)
            self._steps_ahead += 1
        return self.runner.finish(launched)

    def _chunks_ahead(self, launched: LaunchedStep) -> list[ScheduledChunk] | None:
        """The next step's chunks, scheduled now, if it may run ahead: async decode on, one rank, no speculative
        decoding; `launched` replays a CUDA graph, its requests sampling one token each from the logits alone (no
        grammar, bias, min_tokens, penalties, logprobs); the scheduler would run the same requests
        (schedule_ahead)."""
        if not self.config.async_decode or self.workers is not None or self.spec_decode is not None:
            return None
        chunks = launched.chunks
        if launched.step.graph_key is None or not all(
            c.seq.prompt_logprobs is None and samples_from_logits_alone(c.seq.sampling) for c in chunks
        ):
            return None
        return self.scheduler.schedule_ahead(chunks)

    def _attempt(self, outputs: list[RequestOutput], chunks: list[ScheduledChunk], call):
        """call(); if it fails, the chunks' requests fail (a failed step fails its requests, not the engine): None."""
        try:
            return call()
        except RanksOutOfStep as e:
            self.workers.fail(str(e))
            raise
        except Exception as e:
            logger.exception("engine step failed")
            self._ahead = None  # it would run the same requests
            for chunk in chunks:
                if not chunk.seq.is_finished:
                    outputs.append(self._fail(chunk.seq, f"{type(e).__name__}: {e}"))
            if self.prefix_cache is not None:
                self.prefix_cache.end_step()
            return None

    def _postprocess_step(
        self, chunks: list[ScheduledChunk], results: list[ChunkResult], outputs: list[RequestOutput]
    ) -> None:
        self._steps += 1
        # A request that finished (or was aborted) while the step, launched ahead, ran: its row is dropped.
        done = [(chunk, result) for chunk, result in zip(chunks, results) if not chunk.seq.is_finished]
        for chunk, _ in done:
            chunk.seq.num_computed_tokens += chunk.num_known_tokens
            if self.prefix_cache is not None:
                self.prefix_cache.commit(chunk.seq)
        if self.prefix_cache is not None:
            self.prefix_cache.end_step()
        for chunk, result in done:
            seq = chunk.seq
            # The accepted drafts are computed tokens too (their pages are committed with the next step's).
            seq.num_computed_tokens += result.num_accepted_drafts
            self._prompt_tokens += chunk.num_known_tokens - chunk.samples
            if chunk.draft_token_ids:
                self.spec_decode.record(len(chunk.draft_token_ids), result.num_accepted_drafts)
            out = self._postprocess(seq, result)
            if out is not None:
                outputs.append(out)
        self._log_spec_decode()

    def stats(self) -> EngineStats:
        cached = self.prefix_cache
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_pages=self.allocator.num_pages,
            num_free_pages=self.allocator.num_free_pages,
            capacity_tokens=self.allocator.capacity_tokens,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_steps=self._steps,
            num_steps_ahead=self._steps_ahead,
            num_finished=self._finished,
            num_cached_pages=cached.num_cached_pages if cached is not None else 0,
            prefix_cache_queried_tokens=cached.stats.queried_tokens if cached is not None else 0,
            prefix_cache_hit_tokens=cached.stats.hit_tokens if cached is not None else 0,
            prefix_cache_evicted_pages=cached.stats.evicted_pages if cached is not None else 0,
            spec_decode=self.spec_decode.snapshot() if self.spec_decode is not None else None,
        )

    def _log_spec_decode(self) -> None:
        now = time.monotonic()
        stats = self.spec_decode
        if stats is None or now - self._spec_logged_at < SPEC_LOG_INTERVAL_S:
            return
        if stats.num_drafts > self._spec_logged_drafts:
            logger.info(stats.describe())
        self._spec_logged_at, self._spec_logged_drafts = now, stats.num_drafts

    def _postprocess(self, seq: Sequence, result: ChunkResult) -> RequestOutput | None:
        """Append the chunk's new tokens one by one, up to the one that finishes the request."""
        if seq.prompt_logprobs is not None:
            seq.prompt_logprobs.extend(result.prompt_logprobs)
        if not result.token_ids:
            return None
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        kept, texts = [], []
        finish_reason = stop_reason = None
        for token_id in result.token_ids:
            self._generation_tokens += 1
            seq.output_token_ids.append(token_id)
            seq.sampling.append(token_id)
            kept.append(token_id)
            text, finish_reason, stop_reason = self._check_stop(seq, token_id)
            texts.append(text)
            if finish_reason is not None:
                break
        logprobs = result.logprobs[: len(kept)] if result.logprobs is not None else None
        out = self._output(seq, kept, "".join(texts), logprobs)
        if finish_reason is not None:
            self._finish(seq, finish_reason)
            out.finished, out.finish_reason, out.stop_reason = True, finish_reason, stop_reason
        else:
            seq.draft_token_ids = result.draft_token_ids
        return out

    def _check_stop(self, seq: Sequence, token_id: int) -> tuple[str, str | None, int | str | None]:
        """(new text, finish reason, stop reason) after seq's newest token."""
        params = seq.params
        num_out = len(seq.output_token_ids)
        reason = token_finish_reason(token_id, num_out, params, self.sampler.eos_token_ids)
        stop_reason = token_id if reason == STOP and token_id in params.stop_token_ids else None
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = LENGTH
        detokenizer, checker = seq.detokenizer, seq.stop_checker
        if detokenizer is None or checker is None:
            return "", reason, stop_reason
        ended_on_token = reason == STOP
        delta = detokenizer.add_token(token_id) if not ended_on_token or params.include_stop_str_in_output else ""
        text = checker.feed(delta, can_stop=num_out >= params.min_tokens)
        if checker.stopped_by is not None:
            return text, STOP, checker.stopped_by
        if reason is not None:
            text += checker.feed(detokenizer.flush(), can_stop=num_out >= params.min_tokens)
            if checker.stopped_by is not None:
                return text, STOP, checker.stopped_by
            text += checker.flush()
        return text, reason, stop_reason

    def _output(
        self, seq: Sequence, token_ids: list[int], text: str, logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
        first = len(seq.output_token_ids) == len(token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=token_ids,
            new_text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            new_logprobs=logprobs,
            prompt_logprobs=seq.prompt_logprobs if first and token_ids else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        grammar = getattr(seq.params, "structured_output", None)
        if grammar is not None and grammar.failed:
            logger.warning(
                "request %s: its grammar rejected token %d after %d tokens; ended at EOS",
                seq.request_id,
                grammar.rejected_token,
                grammar.num_tokens,
            )
        self.scheduler.finish(seq, reason)
        self.requests.pop(seq.request_id, None)
        self._finished += 1

    def _fail(self, seq: Sequence, error: str) -> RequestOutput:
        self._finish(seq, "error")
        out = self._output(seq, [], "", None)
        out.error = error
        return out


def _check_mtp(model) -> None:
    """Speculative decoding drafts with the model's MTP layer, which must be loaded and a sliding-window layer
    (drafts run past the pages the step holds; a window layer has none)."""
    if not getattr(model, "with_mtp", False):
        raise EngineConfigError("speculative_config: method 'mtp' needs the model built with its MTP layer (with_mtp)")
    cfg = model.cfg
    if cfg.compress_ratios[cfg.num_hidden_layers] != 0:
        raise EngineConfigError(
            f"speculative_config: the MTP layer compresses (ratio {cfg.compress_ratios[cfg.num_hidden_layers]}); "
            "ds4 drafts only with a sliding-window MTP layer (ratio 0), as DeepSeek-V4's is"
        )


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in names:
        raise ValueError(f"dtype must be auto or one of {sorted(names)}, got {dtype!r}")
    return names[dtype]
