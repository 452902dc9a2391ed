"""One engine step on the model: flat batch in, sampled tokens (and logprobs) out.

The scheduler's chunks become one ForwardBatch (tokens of every request end to end). The model's
hidden rows that matter are picked before the vocabulary projection: the last row of every chunk that
reaches the end of its request's known tokens (it predicts the next token), plus the prompt rows of
requests that asked for prompt logprobs. On CUDA, steps where every request runs exactly one token
replay a CUDA graph captured for a padded batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds4.engine.cuda_graphs import DecodeGraphs
from ds4.engine.prefix_cache import StepSnapshots
from ds4.engine.sampler import Sampler, TokenLogprobs, compute_logprobs
from ds4.engine.scheduler import ScheduledChunk
from ds4.model.batch import ForwardBatch


@dataclass
class ChunkResult:
    token_id: int | None = None  # the next token, when the chunk samples
    logprobs: TokenLogprobs | None = None
    # Prompt logprobs of the prompt tokens this chunk predicted for the first time (in order).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model, cache, sampler: Sampler, device: torch.device, graphs: DecodeGraphs | None = None):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.graphs = graphs

    def run(self, chunks: list[ScheduledChunk], snapshots: StepSnapshots | None = None) -> list[ChunkResult]:
        batch = build_batch(chunks, self.device)
        if snapshots is not None:  # prefix caching: resume admitted requests, keep page-end states
            self.cache.restore_snapshots(snapshots.restore_snapshots, snapshots.restore_slots, snapshots.restore_ends)
            batch.snapshots = tuple(snapshots.inner)
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)
        else:
            hidden = self.model.forward(batch, self.cache)
        if snapshots is not None:
            self.cache.save_snapshots(snapshots.save_slots, snapshots.save_snapshots, snapshots.save_ends)
        sample_rows, prompt_rows = logit_rows(chunks)
        rows = [r for r, _ in sample_rows] + [r for r, _, _ in prompt_rows]
        results = [ChunkResult() for _ in chunks]
        if not rows:
            return results
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        if sample_rows:
            sampling = [chunks[i].seq.sampling for _, i in sample_rows]
            out = self.sampler.sample(logits[: len(sample_rows)], sampling)
            for (_, i), token_id, logprobs in zip(sample_rows, out.token_ids.tolist(), out.logprobs):
                results[i].token_id, results[i].logprobs = token_id, logprobs
        if prompt_rows:
            targets = torch.tensor([t for _, _, t in prompt_rows], device=logits.device)
            num_top = [chunks[i].seq.params.prompt_logprobs for _, i, _ in prompt_rows]
            entries = compute_logprobs(logits[len(sample_rows) :], targets, num_top)
            for (_, i, _), entry in zip(prompt_rows, entries):
                results[i].prompt_logprobs.append(entry)
        return results


def build_batch(chunks: list[ScheduledChunk], device: torch.device) -> ForwardBatch:
    """The flat batch of one step, built on the host and moved to the device in one transfer per field."""
    input_ids, positions, starts = [], [], [0]
    for c in chunks:
        input_ids += c.seq.token_ids(c.start, c.start + c.num_tokens)
        positions += range(c.start, c.start + c.num_tokens)
        starts.append(starts[-1] + c.num_tokens)
    width = max(len(c.seq.page_table) for c in chunks)
    tables = [c.seq.page_table + [-1] * (width - len(c.seq.page_table)) for c in chunks]

    def put(values, dtype=torch.int32) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    return ForwardBatch(
        input_ids=put(input_ids, torch.long),
        positions=put(positions, torch.long),
        query_start_loc=put(starts),
        context_lens=put([c.start for c in chunks]),
        slots=put([c.seq.slot for c in chunks]),
        block_tables=put(tables),
    )


def logit_rows(chunks: list[ScheduledChunk]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """(row, chunk) pairs to sample from, and (row, chunk, target token) triples for prompt logprobs.

    Row p of a request predicts its token p + 1. Prompt logprobs already computed before a preemption
    (seq.prompt_logprobs holds one entry per prompt token, None for the first) are not computed again.
    """
    samples, prompts = [], []
    offset = 0
    for i, c in enumerate(chunks):
        seq = c.seq
        if c.samples:
            samples.append((offset + c.num_tokens - 1, i))
        if seq.prompt_logprobs is not None:
            first = max(c.start, len(seq.prompt_logprobs) - 1)
            last = min(c.start + c.num_tokens, seq.num_prompt_tokens - 1)
            prompts += [(offset + p - c.start, i, seq.prompt_token_ids[p + 1]) for p in range(first, last)]
        offset += c.num_tokens
    return samples, prompts
