"""One engine step on the model: flat batch in, sampled tokens (and logprobs) out.

The scheduler's chunks become one ForwardBatch (tokens of every request end to end). The model's
hidden rows that matter are picked before the vocabulary projection: the last known row of every chunk
that reaches the end of its request's known tokens (it predicts the next token) and the rows of its
drafts, plus the prompt rows of requests that asked for prompt logprobs. On CUDA, steps where every
request runs exactly one token replay a CUDA graph captured for a padded batch size; steps that verify
drafts run eagerly.

With speculative decoding (ds4.engine.speculative), chunks with drafts are verified instead of sampled,
and the MTP layer then follows every chunk over the positions it kept and drafts for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ds4.engine.cuda_graphs import DecodeGraphs, GraphKey
from ds4.engine.prefix_cache import StepSnapshots
from ds4.engine.sampler import Sampler, TokenLogprobs, compute_logprobs
from ds4.engine.scheduler import ScheduledChunk
from ds4.engine.speculative import MTPDrafter, may_speculate, verify
from ds4.engine.uploads import upload
from ds4.model.batch import ForwardBatch


@dataclass
class ChunkResult:
    # The tokens the chunk adds (when it samples): one, or with drafts the accepted ones and one more.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # one per token, when asked for
    # Prompt logprobs of the prompt tokens this chunk predicted for the first time (in order).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # drafts for the next step

    @property
    def num_accepted_drafts(self) -> int:
        return max(len(self.token_ids) - 1, 0)


class ModelRunner:
    def __init__(
        self,
        model,
        cache,
        sampler: Sampler,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        drafter: MTPDrafter | None = None,
    ):
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.graphs = graphs
        self.drafter = drafter

    def run(self, chunks: list[ScheduledChunk], snapshots: StepSnapshots | None = None) -> list[ChunkResult]:
        key = self._graph_key(chunks, snapshots)
        tokens_per_request = key.tokens_per_request if key is not None else None
        batch = build_batch(chunks, self.device, tokens_per_request)
        first_rows = chunk_rows(chunks, tokens_per_request)
        if snapshots is not None:  # prefix caching: resume admitted requests, keep page-end states
            self.cache.restore_snapshots(snapshots.restore_snapshots, snapshots.restore_slots, snapshots.restore_ends)
            batch.snapshots = tuple(snapshots.inner)
        if key is not None:
            hidden = self.graphs.run(batch, key)
        else:
            hidden = self.model.forward(batch, self.cache)
        sample_rows, prompt_rows = logit_rows(chunks, first_rows)
        rows = [r for first, i in sample_rows for r in range(first, first + _num_sample_rows(chunks[i]))]
        num_sample_rows = len(rows)
        rows += [r for r, _, _ in prompt_rows]
        results = [ChunkResult() for _ in chunks]
        if rows:
            logits = self.model.compute_logits(_select_rows(hidden, rows))
            self._sample(chunks, sample_rows, logits[:num_sample_rows], results)
            if prompt_rows:
                (targets,) = upload(logits.device, ([t for _, _, t in prompt_rows], torch.long))
                num_top = [chunks[i].seq.params.prompt_logprobs for _, i, _ in prompt_rows]
                entries = compute_logprobs(logits[num_sample_rows:], targets, num_top)
                for (_, i, _), entry in zip(prompt_rows, entries):
                    results[i].prompt_logprobs.append(entry)
        if self.drafter is not None:
            self._draft(chunks, batch, hidden, results, first_rows, key)
        if snapshots is not None:  # after the MTP layer's step too: its window is part of the state kept
            self.cache.save_snapshots(snapshots.save_slots, snapshots.save_snapshots, snapshots.save_ends)
        return results

    def _graph_key(self, chunks: list[ScheduledChunk], snapshots: StepSnapshots | None) -> GraphKey | None:
        """The CUDA graph this step replays, if any (never for a step that keeps snapshots inside a chunk)."""
        if self.graphs is None or (snapshots is not None and snapshots.inner):
            return None
        return self.graphs.key([c.num_tokens for c in chunks], max(len(c.seq.page_table) for c in chunks))

    def _sample(self, chunks, sample_rows, logits: torch.Tensor, results: list[ChunkResult]) -> None:
        """Plain chunks sample one token from their row; chunks with drafts verify them on theirs."""
        plain, drafted, plain_rows, drafted_rows, row = [], [], [], [], 0
        for _, i in sample_rows:
            n = _num_sample_rows(chunks[i])
            (drafted if chunks[i].draft_token_ids else plain).append(i)
            (drafted_rows if chunks[i].draft_token_ids else plain_rows).extend(range(row, row + n))
            row += n
        if plain:
            out = self.sampler.sample(_select_rows(logits, plain_rows), [chunks[i].seq.sampling for i in plain])
            for i, token_id, logprobs in zip(plain, out.token_ids.tolist(), out.logprobs):
                results[i].token_ids = [token_id]
                results[i].logprobs = None if logprobs is None else [logprobs]
        if drafted:
            logits = _select_rows(logits, drafted_rows)
            requests = [chunks[i].seq.sampling for i in drafted]
            kept = verify(self.sampler, logits, requests, [chunks[i].draft_token_ids for i in drafted])
            row = 0
            for i, tokens in zip(drafted, kept):
                results[i].token_ids = tokens
                num_top = chunks[i].seq.params.logprobs
                if num_top is not None:
                    targets = torch.tensor(tokens, device=logits.device)
                    results[i].logprobs = compute_logprobs(
                        logits[row : row + len(tokens)], targets, [num_top] * len(tokens)
                    )
                row += _num_sample_rows(chunks[i])

    def _draft(self, chunks, batch, hidden, results, first_rows: list[int], key: GraphKey | None) -> None:
        """The MTP layer over every chunk's rows, each fed the token after it (the known ones, then the chunk's
        new tokens or, mid-prompt, the next prompt token; 0 past them); drafts where a chunk sampled."""
        next_ids, last_rows, drafting = [0] * batch.num_tokens, [], []
        for i, (c, result, first) in enumerate(zip(chunks, results, first_rows)):
            end = c.start + c.num_known_tokens
            after = result.token_ids if c.samples else c.seq.token_ids(end, end + 1)
            ids = c.seq.token_ids(c.start + 1, end) + after
            next_ids[first : first + len(ids)] = ids
            last_rows.append(first + len(ids) - 1)
            if c.samples and may_speculate(c.seq.params):
                drafting.append(i)
        ids = _to_device(next_ids, torch.long, self.device)
        if key is not None:
            drafts = self.graphs.draft(ids, _to_device(last_rows, torch.long, self.device), key).tolist()
            drafts = [drafts[i] for i in drafting]
        else:
            rows = _to_device([last_rows[i] for i in drafting], torch.long, self.device)
            requests = _to_device(drafting, torch.long, self.device)
            drafts = self.drafter.run(batch, hidden, ids, rows, requests).tolist()
        for i, draft in zip(drafting, drafts):
            results[i].draft_token_ids = draft


def _num_sample_rows(chunk: ScheduledChunk) -> int:
    return 1 + len(chunk.draft_token_ids)


def chunk_rows(chunks: list[ScheduledChunk], tokens_per_request: int | None = None) -> list[int]:
    """Each chunk's first row in the step's flat batch (every chunk padded to tokens_per_request tokens, if given)."""
    rows = [0]
    for c in chunks[:-1]:
        rows.append(rows[-1] + (tokens_per_request or c.num_tokens))
    return rows


def build_batch(
    chunks: list[ScheduledChunk], device: torch.device, tokens_per_request: int | None = None
) -> ForwardBatch:
    """The flat batch of one step, built on the host and moved to the device in one transfer.

    tokens_per_request (a CUDA-graph step): a decode_only batch, each chunk followed by padding tokens (id 0) at
    the positions after its own, up to that many tokens."""
    input_ids, positions, starts, context_lens, slots, tables = [], [], [0], [], [], []
    width = max(len(c.seq.page_table) for c in chunks)
    for c in chunks:
        seq, start, n = c.seq, c.start, tokens_per_request or c.num_tokens
        input_ids += seq.token_ids(start, start + c.num_known_tokens)
        input_ids += c.draft_token_ids
        if n > c.num_tokens:
            input_ids += [0] * (n - c.num_tokens)
        positions += range(start, start + n)
        starts.append(starts[-1] + n)
        context_lens.append(start)
        slots.append(seq.slot)
        tables += seq.page_table
        tables += [-1] * (width - len(seq.page_table))
    int32, long = torch.int32, torch.long
    ids, pos, loc, lens, slot, table = upload(
        device,
        (input_ids, long),
        (positions, long),
        (starts, int32),
        (context_lens, int32),
        (slots, int32),
        (tables, int32),
    )
    return ForwardBatch(
        ids,
        pos,
        loc,
        lens,
        slot,
        table.view(len(chunks), width),
        decode_only=tokens_per_request is not None,
        tokens_per_request=tokens_per_request or 1,
    )


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    (tensor,) = upload(device, (values, dtype))
    return tensor


def _select_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows]; x itself when rows are all of its rows in order (the common step: every request decodes one token)."""
    if rows == list(range(x.shape[0])):
        return x
    (index,) = upload(x.device, (rows, torch.long))
    return x[index]


def logit_rows(
    chunks: list[ScheduledChunk], first_rows: list[int]
) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """(first row, chunk) pairs to sample from (the last known token's row, then one row per draft), and
    (row, chunk, target token) triples for prompt logprobs.

    Row p of a request predicts its token p + 1. Prompt logprobs already computed before a preemption
    (seq.prompt_logprobs holds one entry per prompt token, None for the first) are not computed again.
    """
    samples, prompts = [], []
    for i, (c, offset) in enumerate(zip(chunks, first_rows)):
        seq = c.seq
        if c.samples:
            samples.append((offset + c.num_known_tokens - 1, i))
        if seq.prompt_logprobs is not None:
            first = max(c.start, len(seq.prompt_logprobs) - 1)
            last = min(c.start + c.num_known_tokens, seq.num_prompt_tokens - 1)
            prompts += [(offset + p - c.start, i, seq.prompt_token_ids[p + 1]) for p in range(first, last)]
    return samples, prompts
