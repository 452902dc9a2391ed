"""Tiny DeepSeek-V4 configs, a randomly initialised transformers oracle, helpers to drive ds4's model step by step."""

from __future__ import annotations

import torch

from ds4.checkpoint.hf_names import memory_state_to_official
from ds4.config import ModelConfig, load_config
from ds4.model.batch import ForwardBatch
from ds4.model.deepseek_v4 import DeepseekV4Model

_COMMON = dict(
    vocab_size=320,
    o_lora_rank=16,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    routed_scaling_factor=1.5,
    torch_dtype="float32",
    rms_norm_eps=1e-6,
)

# Each differs in layer mix, ratios, heads, hc_mult and YaRN; windows and index_topk are small so that
# sequences of a few dozen tokens leave the window and make the indexer drop entries.
CONFIGS = {
    "mixed_hca8": dict(
        _COMMON,
        hidden_size=64,
        num_hidden_layers=4,
        compress_ratios=[0, 4, 8, 4, 0],
        num_attention_heads=4,
        head_dim=80,
        qk_rope_head_dim=16,
        q_lora_rank=32,
        o_groups=2,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=3,
        n_routed_experts=4,
        num_hash_layers=2,
        sliding_window=8,
        hc_mult=4,
    ),
    "yarn_hc2_hca16": dict(
        _COMMON,
        hidden_size=128,
        num_hidden_layers=5,
        compress_ratios=[16, 4, 0, 16, 4, 0],
        num_attention_heads=8,
        head_dim=128,
        qk_rope_head_dim=64,
        q_lora_rank=48,
        o_groups=4,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=5,
        n_routed_experts=6,
        num_hash_layers=1,
        sliding_window=16,
        hc_mult=2,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1),
    ),
    "csa_heavy_yarn": dict(
        _COMMON,
        hidden_size=96,
        num_hidden_layers=3,
        compress_ratios=[4, 4, 8, 0],
        num_attention_heads=2,
        head_dim=64,
        qk_rope_head_dim=32,
        q_lora_rank=24,
        o_groups=1,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=2,
        n_routed_experts=5,
        num_hash_layers=1,
        sliding_window=5,
        hc_mult=4,
        rope_scaling=dict(type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=16, beta_slow=1),
    ),
}


def tiny_config(name: str) -> ModelConfig:
    return load_config(dict(CONFIGS[name]))


def transformers_model(cfg: ModelConfig, seed: int = 0):
    """transformers' DeepseekV4ForCausalLM in fp32 with every parameter and table perturbed, so all of them matter."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**cfg.to_hf_dict())).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 or "position_bias" in name else 0.05))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(
                    torch.stack(
                        [torch.randperm(cfg.n_routed_experts)[: cfg.num_experts_per_tok] for _ in range(cfg.vocab_size)]
                    )
                )
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


def official_tensors(hf_model) -> dict[str, torch.Tensor]:
    return memory_state_to_official(hf_model.state_dict())


def ds4_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], kv_cache_dtype: str = "auto", with_mtp: bool = False):
    model = DeepseekV4Model(cfg, torch.float32, "cpu", kv_cache_dtype=kv_cache_dtype, with_mtp=with_mtp)
    model.load_weights(tensors)
    return model


def step_batch(requests: list[tuple[torch.Tensor, int, int, torch.Tensor]]) -> ForwardBatch:
    """requests: (token ids of this step, context length, slot, block table row)."""
    ids = torch.cat([r[0] for r in requests])
    dev = ids.device
    positions = torch.cat([torch.arange(ctx, ctx + len(t), device=dev) for t, ctx, _, _ in requests])
    counts = torch.tensor([len(r[0]) for r in requests], device=dev)
    loc = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), counts.cumsum(0)])
    batch = ForwardBatch(
        ids,
        positions,
        loc,
        torch.tensor([r[1] for r in requests], device=dev),
        torch.tensor([r[2] for r in requests], device=dev),
        torch.stack([r[3] for r in requests]).to(dev),
    )
    batch.validate()
    return batch


def run_in_chunks(model, cache, ids: torch.Tensor, chunks: list[int], slot: int, table: torch.Tensor) -> torch.Tensor:
    """Feed one request's ids in steps of the given sizes (cycled); returns fp32 logits of every position."""
    logits, done, i = [], 0, 0
    while done < len(ids):
        n = min(chunks[i % len(chunks)], len(ids) - done)
        batch = step_batch([(ids[done : done + n], done, slot, table)])
        logits.append(model.compute_logits(model(batch, cache)))
        done, i = done + n, i + 1
    return torch.cat(logits)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()
