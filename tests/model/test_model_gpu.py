"""On CUDA the model gives the CPU logits (fp32, auto and fp8 KV), and runs in bf16 with the fp8 KV cache."""

import pytest
import torch
import torch.nn.functional as F
from dsv4_tiny import max_rel_err, official_tensors, run_in_chunks, tiny_config, transformers_model

from ds4.model.deepseek_v4 import DeepseekV4Model


def _logits(cfg, tensors, ids, device, dtype, kv_cache_dtype, chunks):
    model = DeepseekV4Model(cfg, dtype, device, kv_cache_dtype=kv_cache_dtype)
    model.load_weights(tensors)
    table = torch.arange(6, device=device)
    return run_in_chunks(model, model.new_cache(2, 6, 16), ids.to(device), chunks, slot=1, table=table).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixed_hca8", "yarn_hc2_hca16"])
def test_cuda_matches_cpu(name):
    cfg = tiny_config(name)
    tensors = official_tensors(transformers_model(cfg))
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(9))
    cpu = _logits(cfg, tensors, ids, "cpu", torch.float32, "auto", [70])
    gpu = _logits(cfg, tensors, ids, "cuda", torch.float32, "auto", [9, 1, 30])
    assert max_rel_err(gpu, cpu) <= 1e-4
    bf16 = _logits(cfg, tensors, ids, "cuda", torch.bfloat16, "fp8", [33, 1])
    assert torch.isfinite(bf16).all() and F.cosine_similarity(bf16, cpu, dim=-1).mean() >= 0.9


@pytest.mark.gpu
def test_fp8_mode_indexer_kernels_match_the_cpu_reference():
    """fp8 mode with 128-dim indexer keys: the packed e4m3 cache read by the Triton indexer and top-k on
    CUDA gives the CPU run's logits (the kernels' torch references); fp8 tensor-core sums differ in order."""
    cfg = tiny_config("yarn_hc2_hca16")
    tensors = official_tensors(transformers_model(cfg))
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(10))
    cpu = _logits(cfg, tensors, ids, "cpu", torch.float32, "fp8", [70])
    gpu = _logits(cfg, tensors, ids, "cuda", torch.float32, "fp8", [9, 1, 30])
    assert max_rel_err(gpu, cpu) <= 1e-3
