"""One request's state as it flows through the scheduler, the runner and the engine."""

from __future__ import annotations

import enum
import itertools
import time

from ds4.engine.detokenizer import IncrementalDetokenizer
from ds4.engine.sampler import RequestSampling, TokenLogprobs
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.stop import StopChecker

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, how many of them the cache already holds, and where in the cache they live.

    Tokens `[0, num_computed_tokens)` are in the cache; the rest still have to run through the model.
    A preempted sequence drops its cache and starts again from zero (or from its longest cached prefix),
    keeping the tokens it generated.
    The sequence owns `prompt_token_ids` (`sampling` reads the same list). `detokenizer` and `stop_checker`
    are None for an engine without a tokenizer.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sampling: RequestSampling,
        detokenizer: IncrementalDetokenizer | None = None,
        stop_checker: StopChecker | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.sampling = sampling
        self.detokenizer = detokenizer
        self.stop_checker = stop_checker
        self.status = SequenceStatus.WAITING
        self.arrival = next(_arrival_counter)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.num_computed_tokens = 0
        # Speculative decoding: the MTP layer's guesses of the tokens after the last one, verified next step.
        self.draft_token_ids: list[int] = []
        self.page_table: list[int] = []
        self.slot: int | None = None
        # Prefix caching: chain keys of its full pages (memo), and how many of page_table are cached or settled.
        self.page_keys: list[bytes] = []
        self.num_cached_pages = 0
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # The prompt logprobs gathered so far: one per prompt token, None for the first; None if not asked for.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = [None] if params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, stop: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if stop <= prompt_len:
            return self.prompt_token_ids[start:stop]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : stop - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - prompt_len]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, pages={len(self.page_table)}, slot={self.slot})"
        )
