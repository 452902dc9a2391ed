"""DeepSeek-V4 attention: one shared 512-d KV head (K = V) over a sliding window plus compressed entries.

Window layers see the last `sliding_window` raw tokens; HCA layers add every compressed entry the token
may see; CSA layers add the indexer's top-k. A per-head sink joins the softmax denominator. The output's
RoPE channels are rotated back to the query position before the grouped low-rank output projection.

Entries are stored as the cache keeps them (with the FP8 cache: the reference's e4m3 + bf16 RoPE entries, so the
step's own keys are rounded exactly as the ring will hold them); ds4.kernels.sparse_attention reads them in place
(its Triton kernel on CUDA, its torch reference elsewhere). A query's heads and the kv are normalised, rotated
and (kv) put in the cache's form as ds4.kernels.norm_rope does: the kv by its launch, the query in the attention's
(which also rotates the output back).

A token's window keys come from two places: its request's ring (positions before the step) and the step's
fresh kv (positions in it); the ring takes the step's tokens afterwards (row position % rows). The same
code serves a decode_only batch (no host syncs, CUDA-graph capturable); only the widths differ: a decode_only
token gathers its request's tokens_per_request fresh keys (one, or k + 1 verifying drafts; causally masked) and
as many compressed entries as its block table holds, a general step up to the longest chunk and the most
entries any token sees.

Tensor parallel: a rank holds a contiguous run of heads (its rows of wq_b, its sinks) and the output
projection of the o_groups they feed (its rows of wo_a and columns of wo_b; when ranks outnumber the groups,
its heads' columns of its group's wo_a, exact only without act_quant in between, see ParallelConfig); the
rank's wo_b output is a partial sum, all-reduced. The single KV head, the compressor, the indexer and their
caches are replicated: one KV head cannot be split by heads, and every rank's heads read all of it.
"""

from __future__ import annotations

import torch
from torch import nn

from ds4.config import CSA, WINDOW, ModelConfig
from ds4.distributed.parallel import Parallel
from ds4.kernels.norm_rope import EntryForm, norm_rope
from ds4.kernels.paging import decode_visible_rows, decode_window_keys, visible_entry_rows, window_key_rows
from ds4.kernels.ring_write import write_rings
from ds4.kernels.sparse_attention import RotaryQueries, sparse_attention
from ds4.model.batch import ForwardBatch, LayerStep, StepLayout
from ds4.model.cache import FP8, LayerCache
from ds4.model.compressor import Compressor
from ds4.model.indexer import Indexer
from ds4.model.linear import DEQUANTIZED, Linear, Norm, StackedLinears, fp32_param, kept_fp8_block
from ds4.model.rope import layer_inv_freq
from ds4.model.shard import hold
from ds4.model.side_stream import side_stream


class _HeadSplit:
    """A rank's heads, the o_groups they feed, and their place inside the first of those groups (None: the
    whole model, world size 1)."""

    def __init__(self, cfg: ModelConfig, parallel: Parallel):
        heads, groups = cfg.num_attention_heads, cfg.o_groups
        self.single = parallel.is_single
        self.heads = parallel.shard(heads)
        per_group = heads // groups
        first, last = self.heads.start // per_group, -(-self.heads.stop // per_group)
        self.groups = slice(first, last)
        inside = self.heads.start - first * per_group
        self.group_heads = slice(inside, inside + min(per_group, self.heads.stop - self.heads.start))
        self.full_group = self.group_heads == slice(0, per_group)

    def scaled(self, s: slice, unit: int) -> slice | None:
        """s in units of `unit` rows or columns; None when this rank holds everything (world size 1)."""
        if self.single:
            return None
        return slice(s.start * unit, s.stop * unit)


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str,
        weight_format: str = DEQUANTIZED,
        parallel: Parallel | None = None,
    ):
        super().__init__()
        self.parallel = parallel = parallel or Parallel.single()
        fp8 = kept_fp8_block(cfg, weight_format)
        d, hd = cfg.hidden_size, cfg.head_dim
        self.kind, self.ratio = cfg.layer_kinds[layer], cfg.compress_ratios[layer]
        self.head_dim, self.rope_dim, self.o_lora_rank = hd, cfg.qk_rope_head_dim, cfg.o_lora_rank
        split = _HeadSplit(cfg, parallel)
        self.heads, self.groups = split.heads.stop - split.heads.start, split.groups.stop - split.groups.start
        heads, olr = self.heads, self.o_lora_rank
        self.window, self.eps = cfg.sliding_window, cfg.rms_norm_eps
        self.dtype, self.fp8_kv = dtype, kv_cache_dtype == FP8
        self.wq_a = Linear(d, cfg.q_lora_rank, dtype, device, fp8)
        self.q_norm = Norm(cfg.q_lora_rank, device)
        self.wq_b = Linear(cfg.q_lora_rank, heads * hd, dtype, device, fp8, rows=split.scaled(split.heads, hd))
        self.wkv = Linear(d, hd, dtype, device, fp8)
        self.q_a_and_kv = StackedLinears(self.wq_a, self.wkv)
        self.kv_norm = Norm(hd, device)
        # Grouped low-rank output projection; the reference multiplies it without act_quant.
        in_a, out_a, o_rows = heads * hd // self.groups, self.groups * olr, split.scaled(split.groups, olr)
        in_cols = None if split.full_group else split.scaled(split.group_heads, hd)
        self.wo_a = Linear(in_a, out_a, dtype, device, fp8, self.groups, False, rows=o_rows, cols=in_cols)
        self.wo_b = Linear(out_a, d, dtype, device, fp8, cols=o_rows)
        self.attn_sink = hold(fp32_param(heads, device=device), split.scaled(split.heads, 1))
        self.register_buffer("inv_freq", layer_inv_freq(cfg, layer).to(device), persistent=False)
        if self.kind != WINDOW:
            self.compressor = Compressor(d, self.ratio, hd, self.kind == CSA, self.eps, device, dtype)
            compressions = [self.compressor.wkv, self.compressor.wgate]
        if self.kind == CSA:
            self.indexer = Indexer(cfg, self.ratio, dtype, device, self.fp8_kv, weight_format)
            # Both query projections take qr; both compressors' projections and the indexer's head weights x:
            # one launch each.
            self.queries = StackedLinears(self.wq_b, self.indexer.wq_b)
            compressions += [self.indexer.compressor.wkv, self.indexer.compressor.wgate, self.indexer.weights_proj]
        if self.kind != WINDOW:
            self.compressions = StackedLinears(*compressions)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, layout: StepLayout | None, cache: LayerCache
    ) -> torch.Tensor:
        """layout None: a decode_only batch (see ForwardBatch)."""
        step = LayerStep(batch, layout, cache, self.inv_freq)
        t, pos = x.shape[0], batch.positions
        side = side_stream(x.device)
        # A decode_only step's entries go into the window ring in their norm_rope launch. Its rows are shared values
        # of the step: made here, before the fork (the compressor may take the same ones on its stream).
        ring_copy = self._ring_copy(step)
        if self.kind != WINDOW:
            # The compressor (the projections of x, pooling into the cache, its rings) beside the query path, on
            # the side stream: at decode both are chains of latency-bound launches. The query path touches none of
            # the step's shared values before the join but those made before the fork (the compressor may make
            # others on its stream first).
            snapshot = cache.snapshot.compressor if cache.snapshot is not None else None
            with side.fork(t):
                compressed = self.compressions(x)  # kv and score of the compressor (the indexer's, its weights)
                self.compressor(*compressed[:2], step, cache.compressor, cache.compressed, snapshot)
        q_a, projected = self.q_a_and_kv(x)
        # The step's entries in the form the cache stores (FP8 rounds them as the reference does), beside the query
        # path: at decode a latency-bound launch of its own (after the compressor's work on the side stream). The
        # projection stays referenced past the join (a local), so that the main stream cannot reuse its memory while
        # the side stream reads it.
        with side.fork(t):
            kv = norm_rope(projected, pos, self._form(self.kv_norm.weight, self.fp8_kv), ring_copy)
        norm = (q_a, self.q_norm.weight, self.eps)  # q_norm, inside the query projection's launch at one token
        q, index_q = self.queries.normed(*norm) if self.kind == CSA else (self.wq_b.normed(*norm), None)
        q = q.view(t, self.heads, self.head_dim)  # finished (norm, RoPE) by sparse_attention
        side.join()

        key_sets = self._window_keys(kv, step)
        if self.kind != WINDOW:
            width = self._entry_width(step)
            if self.kind == CSA:
                rows = self.indexer(x, index_q, compressed[2:], step, width)
            else:
                per_page = cache.compressed.shape[1]

                def visible() -> torch.Tensor:
                    if step.decode_only:  # one launch on CUDA
                        n = batch.tokens_per_request
                        return decode_visible_rows(pos, n, batch.block_tables, self.ratio, per_page, width)
                    tables = batch.block_tables[step.token_requests]
                    return visible_entry_rows(tables, (pos + 1) // self.ratio, per_page, width)

                rows = batch.shared(("visible entries", self.ratio, per_page, width), visible)
            key_sets.append((cache.compressed.flatten(0, 1), rows))
        rotary = RotaryQueries(self._form(None, False), pos)
        o = sparse_attention(q, key_sets, self.attn_sink, self.head_dim**-0.5, self.rope_dim, rotary=rotary)
        self._snapshot_windows(kv, step)
        if ring_copy is None:
            self._store_window(kv, step)
        return self.parallel.all_reduce(self.wo_b(self.wo_a(o.flatten(1))))

    def _form(self, weight: torch.Tensor | None, fp8: bool) -> EntryForm:
        return EntryForm(weight, self.inv_freq, self.eps, self.dtype, fp8)

    def _window_keys(self, kv: torch.Tensor, step: LayerStep) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each token's last `window` positions: [(ring pool, rows of the positions before the step),
        (fresh kv, rows of the positions in it)], -1 elsewhere."""
        rows = step.cache.window.shape[1]  # sliding_window + spare, token p in row p % rows
        held, fresh = step.batch.shared(("window keys", self.window, rows), lambda: self._window_rows(step, rows))
        return [(step.cache.window.flatten(0, 1), held), (kv, fresh)]

    def _window_rows(self, step: LayerStep, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of _window_keys (kernels.paging.window_key_rows), which depend on the batch alone (every layer's
        are the same): a decode step's in one launch on CUDA."""
        batch = step.batch
        fields = (batch.context_lens, batch.query_start_loc, batch.slots)
        if step.decode_only:
            return decode_window_keys(batch.positions, batch.tokens_per_request, *fields, self.window, rows)
        fresh_width = min(self.window, step.longest)
        return window_key_rows(batch.positions, step.token_requests, *fields, self.window, rows, fresh_width)

    def _entry_width(self, step: LayerStep) -> int:
        """How many compressed entries a token's gather spans: the block table's capacity for a decode_only
        batch (a fixed shape), else the most any token sees (from the host-side layout: no sync). Their pages
        are trusted to be assigned, as a decode_only batch's are (`ForwardBatch.validate` checks)."""
        if step.decode_only:
            return step.batch.block_tables.shape[1] * step.cache.compressed.shape[1]
        return step.layout.most_entries(self.ratio)

    def _snapshot_windows(self, kv: torch.Tensor, step: LayerStep) -> None:
        """The window ring at each snapshot's page end e: positions e - window .. e - 1 in ring order, from the
        ring or the step's kv (rows of positions below 0 get stand-ins that nothing reads)."""
        batch, cache = step.batch, step.cache
        if not batch.snapshots:
            return
        dev, win = kv.device, self.window
        req, ends, ids = batch.snapshot_fields()
        key_pos = ends[:, None] - win + torch.arange(win, device=dev)
        ctx = batch.context_lens.long()[req][:, None]
        fresh = kv[(batch.query_start_loc.long()[req][:, None] + key_pos - ctx).clamp(0, kv.shape[0] - 1)]
        held = cache.window[batch.slots.long()[req][:, None], key_pos % cache.window.shape[1]]
        cache.snapshot.window[ids[:, None], key_pos % win] = torch.where((key_pos >= ctx)[..., None], fresh, held)

    def _ring_copy(self, step: LayerStep) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a decode_only step, (window ring, each token's flat ring row) to store its entry as it is made: each
        token is its request's last at its row, and the ring rows the step's tokens write (positions from the
        context on) are not among those its attention reads (positions before the context, within the window: at
        least `rows` - window + 1 apart, rows >= window + tokens a request - 1), so the store need not wait for the
        attention. Else None (_store_window writes after the attention: a chunk may span more positions than the
        ring has rows)."""
        ring = step.cache.window
        if not step.decode_only or ring.shape[1] < self.window + step.batch.tokens_per_request - 1:
            return None
        size = ring.shape[1]
        _, (slots, rows) = step.ring_writes(size)
        # Every layer's rings have the same rows: their flat rows (int64, as `rows`) are made once a step, one launch.
        return ring, step.batch.shared(("flat ring rows", size), lambda: torch.add(rows, slots, alpha=size))

    def _store_window(self, kv: torch.Tensor, step: LayerStep) -> None:
        """Each request's ring takes its last tokens at position % rows: every token writes its ring row with the
        kv of its request's last token there (equal values, so the order of writes is moot)."""
        ring = step.cache.window
        write_rings([(ring, kv)], *step.ring_writes(ring.shape[1]))
