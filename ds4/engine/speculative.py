"""Speculative decoding with DeepSeek-V4's MTP layer: draft k tokens, verify them in one forward, keep what passes.

One step of a speculating request (ds4.engine.model_runner drives it):
  1. The main model runs the request's last sampled token and its drafts (positions c .. c + k) in one forward.
  2. `verify` keeps the longest prefix of drafts the target accepts and adds one token: the target's own
     choice where the first draft failed, or a bonus token after the last draft when all passed.
  3. `MTPDrafter.run` runs the MTP layer over the step's rows (position p gets the main model's streams at p
     and the token at p + 1; rows past the kept ones any token), then drafts the next k tokens from the
     last kept row, feeding its own output streams back in for k > 1.
Prefill chunks take step 3 too, so the MTP layer's cache always covers the positions the main model's does.
On CUDA, steps of decodes and verifications replay graphs of both forwards (ds4.engine.cuda_graphs).

Drafts are the MTP layer's argmax, a point mass q. Greedy requests keep a draft while it equals the target's
argmax, so their output is the output without speculation. Random requests keep draft d with probability
p(d) (p: the request's whole target distribution: grammar, bias, min_tokens, temperature, min-p, top-k/p)
and otherwise draw from p without d: each emitted token has exactly p's distribution (rejection sampling
for a point-mass draft). Every verification draws k + 1 uniforms from the request's own generator, so a
seeded request is reproducible whatever shares its batch (its tokens differ from a run without
speculation: the draws differ).

Nothing in the caches is undone after a rejection: the per-slot rings hold k spare rows (ds4.model.cache).
A grammar is advanced over the drafts only to give each position its bitmask, then rolled back; the
tokens kept reach it later like any output token (after `</think>` only, wherever it falls in the window).

Requests that never speculate (they decode one token a step in the same batches): those with repetition,
frequency or presence penalties (each draft position would need its own copy of the token counts). The
scheduler also drafts fewer tokens, or none, where max_tokens, max_model_len, the step's token budget or
free pages leave less room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from ds4.engine.sampler import RequestSampling, Sampler, greedy_tokens, warp_logits
from ds4.engine.sampling_params import SamplingParams
from ds4.model.batch import ForwardBatch


def may_speculate(params: SamplingParams) -> bool:
    return not params.uses_penalties


@dataclass
class _DraftPosition:
    """A request as the sampler sees it at one draft position: the drafts before it count as output."""

    params: SamplingParams
    output_token_ids: list[int]


def verify(
    sampler: Sampler, logits: torch.Tensor, requests: Sequence[RequestSampling], drafts: Sequence[list[int]]
) -> list[list[int]]:
    """The tokens each request keeps: its accepted drafts, then one token of the target's.

    logits: fp32 [sum(len(d) + 1), vocab], request i's len(drafts[i]) + 1 rows consecutive (row j predicts
    the token after drafts[i][:j])."""
    positions, grammars = [], []
    for request, draft in zip(requests, drafts):
        state = getattr(request.params, "structured_output", None)
        if state is not None:
            state.sync(request.output_token_ids)
            grammars.append((state, state.num_tokens, state.rejected_token))
        kept = list(request.output_token_ids)
        positions += [_DraftPosition(request.params, kept + draft[:j]) for j in range(len(draft) + 1)]
    # The sampler's grammar hook advances each matcher over the drafts, position by position.
    processed = sampler.process(logits, positions)
    for state, num_tokens, rejected in grammars:
        state.rollback(state.num_tokens - num_tokens)
        state.rejected_token = rejected
    argmax = greedy_tokens(processed).tolist()  # one transfer for every greedy row
    kept_tokens, row = [], 0
    for request, draft in zip(requests, drafts):
        if request.params.is_greedy:
            kept_tokens.append(_verify_greedy(argmax[row : row + len(draft) + 1], draft))
        else:
            kept_tokens.append(_verify_random(processed[row : row + len(draft) + 1], draft, request))
        row += len(draft) + 1
    return kept_tokens


def _verify_greedy(target: list[int], draft: list[int]) -> list[int]:
    accepted = next((j for j, token in enumerate(draft) if token != target[j]), len(draft))
    return draft[:accepted] + [target[accepted]]


def _verify_random(logits: torch.Tensor, draft: list[int], request: RequestSampling) -> list[int]:
    n = len(draft)
    probs = warp_logits(logits, [request.params] * (n + 1)).softmax(dim=-1).double()
    uniforms = [request.draw_uniform() for _ in range(n + 1)]
    draft_ids = torch.tensor(draft, dtype=torch.long, device=logits.device)
    draft_probs = probs[torch.arange(n, device=logits.device), draft_ids].tolist()
    accepted = next((j for j in range(n) if not uniforms[j] < draft_probs[j]), n)
    target = probs[accepted]
    if accepted < n:  # the draft failed: draw from p without it
        target = target.clone()
        target[draft[accepted]] = 0.0
    cdf = target.cumsum(dim=0)
    # right=True: the first token whose cdf exceeds the target, never one of probability zero.
    token = int(torch.searchsorted(cdf, (uniforms[n] * cdf[-1]).reshape(1), right=True).clamp_(max=cdf.shape[0] - 1))
    return draft[:accepted] + [token]


@dataclass
class SpecDecodeStats:
    """Counts since start. A draft is one verification of one request's draft tokens."""

    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts whose j-th token was kept

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_speculative_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: 1 + accepted drafts (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_rates(self) -> list[float]:
        """Per draft position j: the fraction of drafts whose j-th token was kept."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def describe(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rates())
        return (
            f"speculative decoding: mean acceptance length {self.mean_acceptance_length:.2f}, "
            f"per-position acceptance [{rates}], {self.num_draft_tokens} drafted, {self.num_accepted_tokens} accepted"
        )


class MTPDrafter:
    """Keeps the MTP layer's cache in step with the main model's and drafts k tokens per request."""

    def __init__(self, model, cache, num_speculative_tokens: int):
        self.model, self.cache, self.k = model, cache, num_speculative_tokens

    def run(
        self,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        last_rows: torch.Tensor,
        requests: torch.Tensor,
    ) -> torch.Tensor:
        """[len(requests), k] drafts. `batch` and `hidden` are the main model's step; the MTP layer runs over all
        of its rows, row p fed next_ids[p], the token after it (on a row past what its request keeps any token:
        what it writes lies in the cache's spare rows, as a rejected draft's does). Request requests[i] then
        drafts from its row last_rows[i], the last it keeps. No host sync: capturable for a decode_only batch."""
        streams = self.model.mtp_forward(replace(batch, input_ids=next_ids), hidden, self.cache)
        if requests.shape[0] == 0:
            return torch.empty(0, self.k, dtype=torch.long, device=hidden.device)
        streams, positions = streams[last_rows], batch.positions[last_rows]
        slots, tables = batch.slots[requests], batch.block_tables[requests]
        starts = torch.arange(requests.shape[0] + 1, dtype=torch.int32, device=positions.device)
        tokens = [greedy_tokens(self.model.compute_mtp_logits(streams))]
        for j in range(1, self.k):
            # The MTP layer again, one position on, on its own output streams and its last draft.
            step = ForwardBatch(
                input_ids=tokens[-1],
                positions=positions + j,
                query_start_loc=starts,
                context_lens=(positions + j).to(torch.int32),
                slots=slots,
                block_tables=tables,
                decode_only=True,
            )
            streams = self.model.mtp_forward(step, streams, self.cache)
            tokens.append(greedy_tokens(self.model.compute_mtp_logits(streams)))
        return torch.stack(tokens, dim=1)
