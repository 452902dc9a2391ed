"""One DeepSeek-V4 block: mHC-wrapped attention, then mHC-wrapped MoE."""

from __future__ import annotations

import torch
from torch import nn

from ds4.config import ModelConfig
from ds4.distributed.parallel import Parallel
from ds4.kernels.hyper_connections import hc_post, hc_post_pre, hc_pre
from ds4.kernels.rmsnorm import rms_norm
from ds4.model.attention import Attention
from ds4.model.batch import ForwardBatch, StepLayout
from ds4.model.cache import LayerCache
from ds4.model.linear import DEQUANTIZED, Norm, fp32_param
from ds4.model.moe import MoE

# A sub-layer's normalised input, post and comb (from hc_pre and the sub-layer's RMSNorm).
Mixed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Block(nn.Module):
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
        """parallel: this rank's shard of the attention and the MoE (mHC and the norms are replicated)."""
        super().__init__()
        hc, d = cfg.hc_mult, cfg.hidden_size
        self.hc, self.iters, self.hc_eps, self.eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.attn = Attention(cfg, layer, dtype, device, kv_cache_dtype, weight_format, parallel)
        self.ffn = MoE(cfg, cfg.is_hash_layer(layer), dtype, device, weight_format, parallel)
        self.attn_norm = Norm(d, device)
        self.ffn_norm = Norm(d, device)
        mix = (2 + hc) * hc
        self.hc_attn_fn, self.hc_ffn_fn = fp32_param(mix, hc * d, device=device), fp32_param(mix, hc * d, device=device)
        self.hc_attn_base, self.hc_ffn_base = fp32_param(mix, device=device), fp32_param(mix, device=device)
        self.hc_attn_scale, self.hc_ffn_scale = fp32_param(3, device=device), fp32_param(3, device=device)

    def forward(
        self,
        h: torch.Tensor,
        batch: ForwardBatch,
        layout: StepLayout | None,
        cache: LayerCache,
        mixed: Mixed | None = None,
        following: Block | None = None,
    ) -> tuple[torch.Tensor, Mixed | None]:
        """h: the hc_mult residual streams [T, hc, D]; layout None for a decode_only batch (the capturable path).
        Returns the new streams and, when `following` (the next block) is given, its attention's normalised input,
        post and comb from them, which it takes as `mixed`: each hc_post, the hc_pre after it and that sub-layer's
        RMSNorm are one step (one launch at decode)."""
        if mixed is None:
            x, post, comb = hc_pre(h, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, *self._mhc())
            x = rms_norm(x, self.attn_norm.weight, self.eps)
        else:
            x, post, comb = mixed
        x = self.attn(x, batch, layout, cache)
        h, x, post, comb = hc_post_pre(x, h, post, comb, *self._ffn_pre(), *self._mhc())
        x = self.ffn(x, batch.input_ids)
        if following is None:
            return hc_post(x, h, post, comb), None
        h, *mixed = hc_post_pre(x, h, post, comb, *following._attn_pre(), *following._mhc())
        return h, tuple(mixed)

    def _attn_pre(self) -> tuple[torch.Tensor, ...]:
        return self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.attn_norm.weight

    def _ffn_pre(self) -> tuple[torch.Tensor, ...]:
        return self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm.weight

    def _mhc(self) -> tuple[int, int, float, float]:
        return self.hc, self.iters, self.hc_eps, self.eps
