"""The multi-token-prediction layer: one more block fed the main model's streams and the next token's embedding.

x = e_proj(enorm(embed(next_id))) + h_proj(hnorm(h)) per stream, then a block (its own cache layer),
then its own hc_head and norm before the shared output head.
"""

from __future__ import annotations

import torch

from ds4.config import ModelConfig
from ds4.distributed.parallel import Parallel
from ds4.kernels.rmsnorm import rms_norm
from ds4.model.block import Block
from ds4.model.linear import DEQUANTIZED, Linear, Norm, fp32_param, kept_fp8_block


class MTPBlock(Block):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str,
        weight_format: str = DEQUANTIZED,
        parallel: Parallel | None = None,
    ):
        """parallel: the block splits as the main ones; e_proj and h_proj are replicated (D x D, before the
        block's input, which every rank needs whole)."""
        super().__init__(cfg, cfg.num_hidden_layers, dtype, device, kv_cache_dtype, weight_format, parallel)
        d, hc = cfg.hidden_size, cfg.hc_mult
        fp8 = kept_fp8_block(cfg, weight_format)
        self.e_proj = Linear(d, d, dtype, device, fp8)
        self.h_proj = Linear(d, d, dtype, device, fp8)
        self.enorm, self.hnorm, self.norm = Norm(d, device), Norm(d, device), Norm(d, device)
        self.hc_head_fn = fp32_param(hc, hc * d, device=device)
        self.hc_head_base = fp32_param(hc, device=device)
        self.hc_head_scale = fp32_param(1, device=device)

    def embed_inputs(self, token_embeddings: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, D] embeddings of the next tokens and [T, hc, D] main-model streams -> the block's input streams."""
        e = self.e_proj(rms_norm(token_embeddings, self.enorm.weight, self.eps))
        return (e.unsqueeze(1) + self.h_proj(rms_norm(h, self.hnorm.weight, self.eps))).to(h.dtype)
