"""The cache plan counts the bytes the cache really takes: FP8 entries of 200 B for the tiny model's 128-dim head."""

import torch

from ds4.checkpoint.tiny import default_model_dir
from ds4.config import load_config
from ds4.engine.cache_plan import plan_cache
from ds4.engine.config import EngineConfig
from ds4.model.deepseek_v4 import DeepseekV4Model


def test_fp8_cache_plan_by_hand():
    cfg = load_config(default_model_dir())  # layers: window, CSA 4, HCA 16, CSA 4; window 16; 128-dim heads
    model = DeepseekV4Model(cfg, torch.float32, "cpu", kv_cache_dtype="fp8")
    config = EngineConfig(
        page_size=16, max_model_len=100000, max_num_seqs=2, kv_cache_memory=1 << 20, enable_prefix_caching=False
    )
    plan = plan_cache(model, config, torch.device("cpu"), num_slots=3)
    entry, index_entry = 64 + 2 * 64 + 1 + 7, 128 + 4  # e4m3 + bf16 RoPE + 1 scale, padded to 8; e4m3 + fp32 scale
    page = 2 * 4 * (entry + index_entry) + 1 * entry  # per 16-token page: CSA 4 entries + keys, HCA 1 entry
    # per slot: 4 windows of 16 entries, fp32 kv + score rings: CSA 8 x 256 (compressor and indexer), HCA 16 x 128
    slot = 4 * 16 * entry + 2 * 2 * (2 * 8 * 256 * 4) + 2 * 16 * 128 * 4
    assert (plan.page_bytes, plan.slot_bytes) == (page, slot)
    assert plan.num_pages == (config.kv_cache_memory - 3 * slot) // page - 1  # one scratch page
    assert f"KV cache (fp8): {plan.num_pages} pages" in plan.describe()
    assert f"{page / 16:.0f} bytes a token" in plan.describe()
