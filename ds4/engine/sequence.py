"""One request's state as it flows through the scheduler, the runner and the engine."""

from __future__ import annotations

import enum
import itertools
from typing import Any

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids, how many of them the cache already holds, and where in the cache they live.

    Tokens `[0, num_computed_tokens)` are in the cache; the rest still have to run through the model.
    A preempted sequence drops its cache and starts again from zero, keeping the tokens it generated.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any = None):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SequenceStatus.WAITING
        self.arrival = next(_arrival_counter)
        self.num_computed_tokens = 0
        self.page_table: list[int] = []
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Set by the engine: the sampler's per-request state, the detokenizer and stop checker, and the
        # prompt logprobs gathered so far (one per prompt token, None for the first; None if not asked for).
        self.sampling: Any = None
        self.detokenizer: Any = None
        self.prompt_logprobs: list | None = None
        self.arrival_time = 0.0
        self.first_token_time: float | None = None

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
