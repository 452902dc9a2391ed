"""Which RoPE each layer uses: window-only layers plain rope_theta; compressed layers compress_rope_theta + YaRN."""

from __future__ import annotations

import torch

from ds4.config import WINDOW, ModelConfig
from ds4.kernels.rope import rope_inv_freq


def layer_inv_freq(cfg: ModelConfig, layer: int) -> torch.Tensor:
    if cfg.layer_kinds[layer] == WINDOW:
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    if cfg.yarn is None:
        return rope_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta)
    y = cfg.yarn
    return rope_inv_freq(
        cfg.qk_rope_head_dim,
        cfg.compress_rope_theta,
        y.factor,
        y.original_max_position_embeddings,
        y.beta_fast,
        y.beta_slow,
    )
