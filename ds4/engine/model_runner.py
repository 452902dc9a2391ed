"""One engine step on the model: flat batch in, sampled tokens (and logprobs) out.

The scheduler's chunks become one ForwardBatch (tokens of every request end to end). The model's
hidden rows that matter are picked before the vocabulary projection: the last known row of every chunk
that reaches the end of its request's known tokens (it predicts the next token) and the rows of its
drafts, plus the prompt rows of requests that asked for prompt logprobs. On CUDA, steps where every
request runs exactly one token replay a CUDA graph captured for a padded batch size; steps that verify
drafts run eagerly.

With speculative decoding (ds4.engine.speculative), chunks with drafts are verified instead of sampled,
and the MTP layer then follows every chunk over the positions it kept and drafts for the next step.

A step is launched (`launch`: the batch uploaded, the model calls and the plain chunks' sampling queued on the
device, no wait) and then finished (`finish`: the sampled tokens read back, which waits for the device, then what
needs them on the host: verification, logprobs, the MTP drafts). Between the two the engine may launch the next
step, its input ids the launched step's sampled tensor (async decode, ds4.engine.engine).

The model calls of a step go through `execute` (snapshot restores, the forward or its graph, the logits) and
`draft` (the MTP layer, then snapshot saves), from host data alone (`Step`, `DraftInputs`): on a tensor-parallel
engine rank 0 sends those to the other ranks first (ds4.engine.step_channel), which make the same calls.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field, fields

import torch

from ds4.engine.cache_plan import CachePlan, plan_cache
from ds4.engine.config import EngineConfig, EngineConfigError
from ds4.engine.cuda_graphs import DecodeGraphs, GraphKey, shared_logits_bytes
from ds4.engine.prefix_cache import StepSnapshots
from ds4.engine.sampler import Sampler, SamplerOutput, TokenLogprobs, compute_logprobs
from ds4.engine.scheduler import ScheduledChunk
from ds4.engine.speculative import MTPDrafter, may_speculate, verify
from ds4.engine.step_channel import RanksOutOfStep, StepChannel
from ds4.engine.uploads import upload
from ds4.model.batch import ForwardBatch

logger = logging.getLogger(__name__)


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
        sampler: Sampler | None,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        drafter: MTPDrafter | None = None,
        channel: StepChannel | None = None,
    ):
        """`channel`: rank 0 of a tensor-parallel engine sends each step's model calls through it (None: one rank).
        `sampler` may be None on the other ranks, which never sample."""
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.device = torch.device(device)
        self.graphs = graphs
        self.drafter = drafter
        self.channel = channel

    def launch(
        self, chunks: list[ScheduledChunk], snapshots: StepSnapshots | None = None, after: LaunchedStep | None = None
    ) -> LaunchedStep:
        """Queue the step's model calls and the sampling of its plain chunks on the device; `finish` waits for them.
        Nothing here waits for the device, unless a request asks for logprobs.

        after: the step in flight whose tokens this step's chunks run, one each (chunks scheduled ahead of it, in
        its chunks' order; one rank): their ids are its sampled tensor, never read by the host."""
        key = self._graph_key(chunks, snapshots)
        step = build_step(chunks, snapshots, key)
        first_rows = chunk_rows(chunks, key.tokens_per_request if key is not None else None)
        sample_rows, prompt_rows = logit_rows(chunks, first_rows)
        # The sample rows, chunk by chunk; of those, the rows of the chunks that sample one token (no drafts).
        rows, plain, plain_rows = [], [], []
        for first, i in sample_rows:
            if not chunks[i].draft_token_ids:
                plain.append(i)
                plain_rows.append(len(rows))
            rows += range(first, first + _num_sample_rows(chunks[i]))
        step.logit_rows = rows + [r for r, _, _ in prompt_rows]
        if after is not None and self.channel is not None:
            raise ValueError("a step launched ahead runs on one rank: the other ranks would not get its token ids")
        input_ids = after.sampled.token_ids if after is not None else None
        batch, hidden, logits = self._mirrored(lambda message: self.execute(message, input_ids), step)
        launched = LaunchedStep(
            chunks, step, first_rows, batch, hidden, logits, sample_rows, prompt_rows, len(rows), plain
        )
        if plain:
            requests = [chunks[i].seq.sampling for i in plain]
            launched.sampled = self.sampler.sample(_select_rows(logits, plain_rows), requests)
            # Copied now, so that finish waits for this copy alone: a blocking read would wait for everything queued
            # on the stream by then, a step launched ahead included.
            launched.tokens_on_host = launched.sampled.token_ids.to("cpu", non_blocking=True)
            if self.device.type == "cuda":
                launched.tokens_copied = torch.cuda.Event()
                launched.tokens_copied.record()
        return launched

    def finish(self, launched: LaunchedStep) -> list[ChunkResult]:
        """The launched step's tokens on the host (the step's wait for the device), its drafts verified, its prompt
        logprobs; with an MTP layer the drafts for the next step."""
        chunks, logits = launched.chunks, launched.logits
        results = [ChunkResult() for _ in chunks]
        if launched.sampled is not None:
            if launched.tokens_copied is not None:
                launched.tokens_copied.synchronize()
            tokens, logprobs = launched.tokens_on_host.tolist(), launched.sampled.logprobs
            for i, token_id, entry in zip(launched.plain, tokens, logprobs):
                results[i].token_ids = [token_id]
                results[i].logprobs = None if entry is None else [entry]
        num_sample_rows = launched.num_sample_rows
        drafted = [i for _, i in launched.sample_rows if chunks[i].draft_token_ids]
        if drafted:
            self._verify(chunks, drafted, launched.sample_rows, logits[:num_sample_rows], results)
        if launched.prompt_rows:
            prompt_rows = launched.prompt_rows
            (targets,) = upload(logits.device, ([t for _, _, t in prompt_rows], torch.long))
            num_top = [chunks[i].seq.params.prompt_logprobs for _, i, _ in prompt_rows]
            entries = compute_logprobs(logits[num_sample_rows:], targets, num_top)
            for (_, i, _), entry in zip(prompt_rows, entries):
                results[i].prompt_logprobs.append(entry)
        if self.drafter is not None:
            self._draft(chunks, launched.step, launched.batch, launched.hidden, results, launched.first_rows)
        return results

    def execute(
        self, step: Step, input_ids: torch.Tensor | None = None
    ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor | None]:
        """The step's snapshot restores, forward (or graph replay) and the logits of its logit rows (None when it
        asks for none); without an MTP layer also its snapshot saves (else `draft` makes them). input_ids: the
        step's token ids on the device, in place of step.input_ids (placeholders)."""
        key = step.graph_key
        if key is not None:  # uploaded straight into the graph's inputs
            batch = self.graphs.inputs.load(
                key, step.input_ids, step.positions, step.context_lens, step.slots, step.block_tables
            )
        else:
            batch = step.to_batch(self.device)
        if input_ids is not None:  # over the placeholders (a graph's inputs stay where its graph reads them)
            batch.input_ids.copy_(input_ids)
        snapshots = step.snapshots
        if snapshots is not None:  # prefix caching: resume admitted requests, keep page-end states
            self.cache.restore_snapshots(snapshots.restore_snapshots, snapshots.restore_slots, snapshots.restore_ends)
            batch.snapshots = tuple(snapshots.inner)
        if key is not None:  # the graph computes every row's logits (valid until the next step's replay)
            hidden, every_row = self.graphs.run(batch, key)
        else:
            hidden = self.model.forward(batch, self.cache)
        if self.drafter is None:
            self._save_snapshots(snapshots)
        logits = None
        if step.logit_rows:
            if key is not None:
                logits = _select_rows(every_row, step.logit_rows)
            else:
                logits = self.model.compute_logits(_select_rows(hidden, step.logit_rows))
        return batch, hidden, logits

    def draft(self, step: Step, batch: ForwardBatch, hidden: torch.Tensor, inputs: DraftInputs) -> torch.Tensor:
        """The MTP layer over the step's rows, then the step's snapshot saves (the MTP window is part of the
        state kept). Returns the drafts: of every request after a graph step, else of inputs.drafting's."""
        if step.graph_key is not None:
            drafts = self.graphs.draft(inputs.next_ids, inputs.last_rows, step.graph_key)
        else:
            ids = _to_device(inputs.next_ids, torch.long, self.device)
            rows = _to_device([inputs.last_rows[i] for i in inputs.drafting], torch.long, self.device)
            requests = _to_device(inputs.drafting, torch.long, self.device)
            drafts = self.drafter.run(batch, hidden, ids, rows, requests)
        self._save_snapshots(step.snapshots)
        return drafts

    def follow(self, channel: StepChannel) -> None:
        """A rank other than 0: make the model calls rank 0 makes, as it sends them, until it sends None."""
        step = batch = hidden = None
        while (message := channel.recv()) is not None:
            if isinstance(message, Step):
                step = message
                batch, hidden, _ = self.execute(step)
            else:  # the MTP inputs of the step just run (none come when rank 0's sampling failed)
                self.draft(step, batch, hidden, message)

    def _graph_key(self, chunks: list[ScheduledChunk], snapshots: StepSnapshots | None) -> GraphKey | None:
        """The CUDA graph this step replays, if any (never for a step that keeps snapshots inside a chunk)."""
        if self.graphs is None or (snapshots is not None and snapshots.inner):
            return None
        return self.graphs.key([c.num_tokens for c in chunks], max(len(c.seq.page_table) for c in chunks))

    def _save_snapshots(self, snapshots: StepSnapshots | None) -> None:
        if snapshots is not None:
            self.cache.save_snapshots(snapshots.save_slots, snapshots.save_snapshots, snapshots.save_ends)

    def _mirrored(self, call, message):
        """call(message) on this rank, after sending the message to the other ranks, which make the same call.
        There, a failure leaves the ranks out of step (their collectives no longer pair up): it is fatal."""
        if self.channel is None:
            return call(message)
        try:
            self.channel.send(message)
            return call(message)
        except Exception as e:
            raise RanksOutOfStep(f"a tensor-parallel step failed: {type(e).__name__}: {e}") from e

    def _verify(self, chunks, drafted: list[int], sample_rows, logits: torch.Tensor, results) -> None:
        """The chunks with drafts keep the ones their rows accept, and one more token."""
        rows, row = [], 0
        for _, i in sample_rows:
            n = _num_sample_rows(chunks[i])
            if chunks[i].draft_token_ids:
                rows.extend(range(row, row + n))
            row += n
        logits = _select_rows(logits, rows)
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

    def _draft(self, chunks, step: Step, batch, hidden, results, first_rows: list[int]) -> None:
        """The MTP layer over every chunk's rows, each fed the token after it (the known ones, then the chunk's
        new tokens or, mid-prompt, the next prompt token; 0 past them); drafts where a chunk sampled."""
        inputs = DraftInputs([0] * len(step.input_ids), [], [])
        for i, (c, result, first) in enumerate(zip(chunks, results, first_rows)):
            end = c.start + c.num_known_tokens
            after = result.token_ids if c.samples else c.seq.token_ids(end, end + 1)
            ids = c.seq.token_ids(c.start + 1, end) + after
            inputs.next_ids[first : first + len(ids)] = ids
            inputs.last_rows.append(first + len(ids) - 1)
            if c.samples and may_speculate(c.seq.params):
                inputs.drafting.append(i)
        drafts = self._mirrored(lambda message: self.draft(step, batch, hidden, message), inputs).tolist()
        if step.graph_key is not None:
            drafts = [drafts[i] for i in inputs.drafting]
        for i, draft in zip(inputs.drafting, drafts):
            results[i].draft_token_ids = draft


def _num_sample_rows(chunk: ScheduledChunk) -> int:
    return 1 + len(chunk.draft_token_ids)


def chunk_rows(chunks: list[ScheduledChunk], tokens_per_request: int | None = None) -> list[int]:
    """Each chunk's first row in the step's flat batch (every chunk padded to tokens_per_request tokens, if given)."""
    rows = [0]
    for c in chunks[:-1]:
        rows.append(rows[-1] + (tokens_per_request or c.num_tokens))
    return rows


@dataclass
class Step:
    """One step's model calls as host data: what rank 0 runs, and sends to the other ranks of a tensor-parallel
    engine so that they run the same."""

    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    context_lens: list[int]
    slots: list[int]
    # Every request's page table padded with -1 to the widest (a graph step: to its graph's width), end to end:
    # int32 values in an array, whose padding is repeated in C rather than converted value by value.
    block_tables: array
    snapshots: StepSnapshots | None = None
    graph_key: GraphKey | None = None  # the CUDA graph the step replays
    logit_rows: list[int] = field(default_factory=list)  # hidden rows projected to logits (none: no projection)

    def to_batch(self, device: torch.device) -> ForwardBatch:
        """The flat batch on the device, in one transfer (a graph step's goes into its graph's inputs instead)."""
        int32, long = torch.int32, torch.long
        ids, pos, loc, lens, slot, table = upload(
            device,
            (self.input_ids, long),
            (self.positions, long),
            (self.query_start_loc, int32),
            (self.context_lens, int32),
            (self.slots, int32),
            (self.block_tables, int32),
        )
        return ForwardBatch(
            ids, pos, loc, lens, slot, table.view(len(self.slots), len(self.block_tables) // len(self.slots))
        )


@dataclass
class LaunchedStep:
    """A step whose model calls and plain sampling are queued on the device (ModelRunner.launch), until `finish`."""

    chunks: list[ScheduledChunk]
    step: Step
    first_rows: list[int]  # each chunk's first row in the flat batch
    batch: ForwardBatch
    hidden: torch.Tensor
    logits: torch.Tensor | None  # the sample rows' (chunk by chunk), then the prompt-logprob rows'
    sample_rows: list[tuple[int, int]]  # (first row, chunk), see logit_rows
    prompt_rows: list[tuple[int, int, int]]  # (row, chunk, target token)
    num_sample_rows: int
    plain: list[int] = field(default_factory=list)  # the chunks that sample one token (no drafts)
    # Their tokens, on the device, in that order (of a step of plain decodes: one per chunk, the input of the
    # step launched after it), and their copy to the host (pinned on CUDA; readable once tokens_copied is done).
    sampled: SamplerOutput | None = None
    tokens_on_host: torch.Tensor | None = None
    tokens_copied: torch.cuda.Event | None = None


@dataclass
class DraftInputs:
    """The MTP step's host data: the token after each row of the step, each request's last kept row, and the
    requests that draft."""

    next_ids: list[int]
    last_rows: list[int]
    drafting: list[int]


def build_step(
    chunks: list[ScheduledChunk], snapshots: StepSnapshots | None = None, graph_key: GraphKey | None = None
) -> Step:
    """The flat batch of one step (tokens of every chunk end to end) and its snapshot copies, on the host.

    With a graph key (a CUDA-graph step): a decode_only batch, each chunk followed by padding tokens (id 0) at
    the positions after its own, up to key.tokens_per_request tokens, and block tables key.pages wide."""
    input_ids, positions, starts, context_lens, slots, tables = [], [], [0], [], [], array("i")
    width = graph_key.pages if graph_key is not None else max(len(c.seq.page_table) for c in chunks)
    no_page = array("i", [-1])
    for c in chunks:
        seq, start = c.seq, c.start
        n = graph_key.tokens_per_request if graph_key is not None else c.num_tokens
        # A chunk scheduled ahead runs a token not yet known: a placeholder, replaced on the device.
        input_ids += [0] if c.ahead else seq.token_ids(start, start + c.num_known_tokens)
        input_ids += c.draft_token_ids
        if n > c.num_tokens:
            input_ids += [0] * (n - c.num_tokens)
        positions += range(start, start + n)
        starts.append(starts[-1] + n)
        context_lens.append(start)
        slots.append(seq.slot)
        tables.fromlist(seq.page_table)
        tables += no_page * (width - len(seq.page_table))
    return Step(input_ids, positions, starts, context_lens, slots, tables, snapshots, graph_key)


def build_runner(
    model, config: EngineConfig, device: torch.device, sampler: Sampler | None, channel: StepChannel | None = None
) -> tuple[CachePlan, ModelRunner]:
    """The cache plan and runner of an engine, with its cache (`runner.cache`), decode graphs and MTP drafter.
    Every rank of a tensor-parallel engine builds its own the same way (the cache plan's activation measurement
    and the graph captures run the model, collectives included); they agree on the smallest plan."""
    k = config.num_speculative_tokens
    use_graphs = device.type == "cuda" and not config.enforce_eager
    if use_graphs and not getattr(model, "cuda_graph_safe", False):
        logger.warning("the model's forward is not CUDA-graph safe; decode steps run eagerly")
        use_graphs = False
    max_graph_batch = min(config.max_cuda_graph_batch_size, config.max_num_seqs)
    graph_logits = shared_logits_bytes(model.cfg.vocab_size, max_graph_batch, k + 1) if use_graphs else 0
    # With graphs, one extra slot is the scratch slot that padding rows write to.
    plan = plan_cache(model, config, device, config.max_num_seqs + use_graphs, graph_logits)
    if channel is not None:
        gathered = channel.all_gather((rank_setup(model, config), plan))
        check_same_setup([setup for setup, _ in gathered])
        plan = min((p for _, p in gathered), key=lambda p: (p.num_pages, p.num_snapshots))
    cache = model.new_cache(plan.num_slots, plan.num_pages, plan.page_size, plan.num_snapshots, spare=k)
    drafter = MTPDrafter(model, cache, k) if k else None
    graphs = None
    if use_graphs:
        graphs = DecodeGraphs(
            model,
            cache,
            max_graph_batch,
            -(-plan.max_model_len // plan.page_size),
            padding_slot=config.max_num_seqs,
            device=device,
            drafter=drafter,
        )
    return plan, ModelRunner(model, cache, sampler, device, graphs, drafter, channel)


def rank_setup(model, config: EngineConfig) -> dict:
    """What the ranks of a tensor-parallel engine must agree on: the engine flags and the model built (each host
    builds its ranks from its own command line)."""
    setup = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    return setup | {"model config": model.cfg, "dtype": model.dtype, "kv_cache_dtype": model.kv_cache_dtype}


def check_same_setup(setups: list[dict]) -> None:
    """Refuse ranks whose setups (rank_setup, in rank order) differ: their steps would not pair up."""
    differing = [name for name in setups[0] if any(setup[name] != setups[0][name] for setup in setups[1:])]
    if differing:
        raise EngineConfigError(
            f"the ranks were started with different settings ({', '.join(differing)}): give every host the same flags"
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
