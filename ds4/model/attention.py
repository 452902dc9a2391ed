"""DeepSeek-V4 attention: one shared 512-d KV head (K = V) over a sliding window plus compressed entries.

Window layers see the last `sliding_window` raw tokens; HCA layers add every compressed entry the token
may see; CSA layers add the indexer's top-k. A per-head sink joins the softmax denominator. The output's
RoPE channels are rotated back to the query position before the grouped low-rank output projection.

A decode_only batch (no StepLayout) takes the decode path: the same keys gathered with fixed shapes and
no host syncs, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from ds4.config import CSA, WINDOW, ModelConfig
from ds4.kernels.fp4_act import fp4_quant_dequant, hadamard_rotate
from ds4.kernels.fp8_kv import fp8_quant_dequant
from ds4.kernels.rmsnorm import rms_norm
from ds4.kernels.rope import apply_rope
from ds4.kernels.sparse_attention import sparse_attention
from ds4.model.batch import ForwardBatch, StepLayout
from ds4.model.cache import LayerCache
from ds4.model.compressor import Compressor
from ds4.model.indexer import Indexer
from ds4.model.linear import DEQUANTIZED, Linear, Norm, fp32_param, kept_fp8_block
from ds4.model.paging import visible_entry_rows
from ds4.model.rope import layer_inv_freq


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str,
        weight_format: str = DEQUANTIZED,
    ):
        super().__init__()
        fp8 = kept_fp8_block(cfg, weight_format)
        d, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
        self.kind, self.ratio = cfg.layer_kinds[layer], cfg.compress_ratios[layer]
        self.heads, self.head_dim, self.rope_dim = heads, hd, cfg.qk_rope_head_dim
        self.groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.window, self.eps, self.fp8 = cfg.sliding_window, cfg.rms_norm_eps, kv_cache_dtype == "fp8"
        self.wq_a = Linear(d, cfg.q_lora_rank, dtype, device, fp8)
        self.q_norm = Norm(cfg.q_lora_rank, device)
        self.wq_b = Linear(cfg.q_lora_rank, heads * hd, dtype, device, fp8)
        self.wkv = Linear(d, hd, dtype, device, fp8)
        self.kv_norm = Norm(hd, device)
        # Grouped low-rank output projection; the reference multiplies it without act_quant.
        in_a, out_a = heads * hd // self.groups, self.groups * self.o_lora_rank
        self.wo_a = Linear(in_a, out_a, dtype, device, fp8, groups=self.groups, quantize_input=False)
        self.wo_b = Linear(self.groups * self.o_lora_rank, d, dtype, device, fp8)
        self.attn_sink = fp32_param(heads, device=device)
        self.register_buffer("inv_freq", layer_inv_freq(cfg, layer).to(device), persistent=False)
        if self.kind != WINDOW:
            self.compressor = Compressor(d, self.ratio, hd, self.kind == CSA, self.eps, device)
        if self.kind == CSA:
            self.indexer = Indexer(cfg, self.ratio, dtype, device, weight_format)

    def _round_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """fp8 KV: the non-RoPE channels go through e4m3 (blocks of 64); RoPE channels stay exact."""
        if not self.fp8:
            return kv
        return torch.cat((fp8_quant_dequant(kv[..., : -self.rope_dim]), kv[..., -self.rope_dim :]), dim=-1)

    def _round_index(self, x: torch.Tensor) -> torch.Tensor:
        """fp8 mode keeps the reference's indexer simulation: Hadamard rotation, then MXFP4."""
        return fp4_quant_dequant(hadamard_rotate(x)) if self.fp8 else x

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, layout: StepLayout | None, cache: LayerCache
    ) -> torch.Tensor:
        """layout None: a decode_only batch (see ForwardBatch)."""
        t, pos = x.shape[0], batch.positions
        qr = rms_norm(self.wq_a(x), self.q_norm.weight, self.eps)
        q = rms_norm(self.wq_b(qr).view(t, self.heads, self.head_dim), None, self.eps)
        q = apply_rope(q, pos, self.inv_freq)
        kv = rms_norm(self.wkv(x), self.kv_norm.weight, self.eps)
        kv = self._round_kv(apply_rope(kv, pos, self.inv_freq))
        if layout is None:
            o = self._attend_decode(x, qr, q, kv, batch, cache)
        else:
            o = self._attend(x, qr, q, kv, batch, layout, cache)
        o = apply_rope(o, pos, self.inv_freq, inverse=True).flatten(1)
        return self.wo_b(self.wo_a(o))

    def _attend(self, x, qr, q, kv, batch: ForwardBatch, layout: StepLayout, cache: LayerCache) -> torch.Tensor:
        key_sets = [self._window_keys(kv, batch, layout, cache)]
        self._snapshot_windows(*key_sets[0], batch, layout, cache)
        if self.kind != WINDOW:
            snapshot = cache.snapshot.compressor if cache.snapshot is not None else None
            self.compressor(
                x, batch, layout, cache.compressor, cache.compressed, self.inv_freq, self._round_kv, snapshot
            )
            if self.kind == CSA:
                rows = self.indexer(x, qr, batch, layout, cache, self.inv_freq, self._round_index)
            else:
                rows = self._all_visible_entries(batch, layout, cache)
            key_sets.append((cache.compressed.view(-1, self.head_dim), rows))
        o = sparse_attention(q, key_sets, self.attn_sink, self.head_dim**-0.5)
        self._store_window(kv, batch, layout, cache)
        return o

    def _attend_decode(self, x, qr, q, kv, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        """One token per request: the ring takes the token first (it replaces one that left the window)."""
        win, ring, pos, slots = self.window, cache.window.shape[1], batch.positions, batch.slots.long()
        cache.window[slots, pos % ring] = kv.to(cache.window.dtype)
        key_pos = pos[:, None] - (win - 1) + torch.arange(win, device=kv.device)[None, :]
        window_rows = torch.where(key_pos >= 0, slots[:, None] * ring + key_pos % ring, -1)
        key_sets = [(cache.window.view(-1, self.head_dim), window_rows)]
        if self.kind != WINDOW:
            self.compressor.decode(x, batch, cache.compressor, cache.compressed, self.inv_freq, self._round_kv)
            if self.kind == CSA:
                rows = self.indexer.decode(x, qr, batch, cache, self.inv_freq, self._round_index)
            else:
                rows = visible_entry_rows(batch.block_tables, pos, self.ratio, cache.compressed.shape[1])
            key_sets.append((cache.compressed.view(-1, self.head_dim), rows))
        return sparse_attention(q, key_sets, self.attn_sink, self.head_dim**-0.5)

    def _window_keys(self, kv, batch: ForwardBatch, layout: StepLayout, cache: LayerCache):
        """Keys = this request's cached ring rows, then the step's fresh kv; [T, window] indices into them."""
        win, ring_rows, req = self.window, cache.window.shape[1], layout.token_requests
        ring = cache.window[batch.slots.long()].view(-1, self.head_dim)
        source = torch.cat((ring, kv.to(ring.dtype)))
        ctx = batch.context_lens.long()[req][:, None]
        start = batch.query_start_loc.long()[req][:, None]
        key_pos = batch.positions[:, None] - (win - 1) + torch.arange(win, device=kv.device)[None, :]
        fresh = start + (key_pos - ctx) + ring.shape[0]
        cached = req[:, None] * ring_rows + key_pos % ring_rows
        rows = torch.where(key_pos >= ctx, fresh, cached)
        return source, torch.where(key_pos >= 0, rows, -1)

    def _snapshot_windows(self, source, rows, batch: ForwardBatch, layout: StepLayout, cache: LayerCache) -> None:
        """The window ring at each snapshot's page end e: the keys of token e - 1's window, in ring order
        (rows of positions below 0 get stand-ins that nothing reads)."""
        if not batch.snapshots:
            return
        dev = source.device
        snaps = batch.snapshots
        tokens = [layout.starts[s.request] + s.position - 1 - layout.context_lens[s.request] for s in snaps]
        ends = torch.tensor([s.position for s in snaps], device=dev)
        ring = (ends[:, None] - self.window + torch.arange(self.window, device=dev)) % self.window
        ids = torch.tensor([s.snapshot for s in snaps], device=dev)
        cache.snapshot.window[ids[:, None], ring] = source[rows[torch.tensor(tokens, device=dev)].clamp_min(0)]

    def _store_window(self, kv, batch: ForwardBatch, layout: StepLayout, cache: LayerCache) -> None:
        """The last `window` tokens of each request go into its ring at position % window."""
        req = layout.token_requests
        end = (batch.context_lens.long() + batch.query_start_loc.long()[1:] - batch.query_start_loc.long()[:-1])[req]
        keep = batch.positions >= end - self.window
        slots = batch.slots.long()[req][keep]
        cache.window[slots, batch.positions[keep] % cache.window.shape[1]] = kv[keep].to(cache.window.dtype)

    def _all_visible_entries(self, batch: ForwardBatch, layout: StepLayout, cache: LayerCache) -> torch.Tensor:
        """HCA: every entry i < (t + 1) // ratio, as rows of the flattened pool [T, max visible] (-1 = none)."""
        visible = (batch.positions + 1) // self.ratio
        width = int(visible.max()) if visible.numel() else 0
        entry = torch.arange(width, device=visible.device)[None, :]
        valid = entry < visible[:, None]
        per_page = cache.compressed.shape[1]
        table = batch.block_tables.long()[layout.token_requests]
        page = torch.gather(table, 1, torch.where(valid, entry // per_page, 0).expand(valid.shape[0], -1))
        if bool((page[valid] < 0).any()):
            raise ValueError("block table: a compressed entry falls on an unassigned page (-1)")
        return torch.where(valid, page * per_page + entry % per_page, -1)
