"""Speculative decoding with DeepSeek-V4's MTP layer: draft k tokens, verify them in one forward, keep what passes.

One step of a speculating request (ds4.engine.model_runner drives it):
  1. The main model runs the request's last sampled token and its drafts (positions c .. c + k) in one forward.
  2. `verify` keeps the longest prefix of drafts the target accepts and adds one token: the target's own
     choice where the first draft failed, or a bonus token after the last draft when all passed.
  3. `MTPDrafter.run` runs the MTP layer over the positions the main model kept (position p gets the main
     model's streams at p and the token at p + 1), then drafts the next k tokens from its last row,
     feeding its own output streams back in for k > 1.
Prefill chunks take step 3 too, so the MTP layer's cache always covers the positions the main model's does.

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
from dataclasses import dataclass, field

import torch

from ds4.engine.sampler import RequestSampling, Sampler, warp_logits
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
    argmax = processed.argmax(dim=-1).tolist()  # one transfer for every greedy row
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


@dataclass
class MTPSpan:
    """One request's part of the MTP step: its rows start at `first_row` of the main batch, one per kept
    position, and `next_token_ids` holds the token after each kept position."""

    first_row: int
    next_token_ids: list[int]
    drafts: bool  # whether to draft from its last row


class MTPDrafter:
    """Keeps the MTP layer's cache in step with the main model's and drafts k tokens per request."""

    def __init__(self, model, cache, num_speculative_tokens: int):
        self.model, self.cache, self.k = model, cache, num_speculative_tokens

    def run(self, batch: ForwardBatch, hidden: torch.Tensor, spans: list[MTPSpan]) -> list[list[int]]:
        """Drafts per span ([] where it does not draft). `batch` and `hidden` are the main model's step."""
        device = hidden.device
        counts = [len(s.next_token_ids) for s in spans]
        rows = torch.tensor([s.first_row + i for s, n in zip(spans, counts) for i in range(n)], device=device)
        starts = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        step = ForwardBatch(
            input_ids=torch.tensor([t for s in spans for t in s.next_token_ids], dtype=torch.long).to(device),
            positions=batch.positions[rows],
            query_start_loc=starts.to(device),
            context_lens=batch.context_lens,
            slots=batch.slots,
            block_tables=batch.block_tables,
        )
        streams = self.model.mtp_forward(step, hidden[rows], self.cache)
        drafting = [r for r, s in enumerate(spans) if s.drafts]
        if not drafting:
            return [[] for _ in spans]
        index = torch.tensor(drafting, device=device)
        last = starts[1:].to(device).long()[index] - 1
        streams, positions = streams[last], step.positions[last]
        tokens = [self.model.compute_mtp_logits(streams).argmax(dim=-1)]
        for j in range(1, self.k):
            # The MTP layer again, one position on, on its own output streams and its last draft.
            step = ForwardBatch(
                input_ids=tokens[-1],
                positions=positions + j,
                query_start_loc=torch.arange(len(drafting) + 1, dtype=torch.int32, device=device),
                context_lens=(positions + j).to(torch.int32),
                slots=batch.slots[index],
                block_tables=batch.block_tables[index],
                decode_only=True,
            )
            streams = self.model.mtp_forward(step, streams, self.cache)
            tokens.append(self.model.compute_mtp_logits(streams).argmax(dim=-1))
        drafted = torch.stack(tokens, dim=1).tolist()
        out: list[list[int]] = [[] for _ in spans]
        for r, draft in zip(drafting, drafted):
            out[r] = draft
        return out
