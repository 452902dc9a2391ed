"""Cache storage: page size validation and the byte counts an engine sizes its pools from."""

import pytest
import torch
from dsv4_tiny import tiny_config

from ds4.config import load_config
from ds4.configs import config_dict
from ds4.model.cache import SCRATCH_PAGES, ModelCache, bytes_per_page, bytes_per_slot, bytes_per_snapshot


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("with_mtp", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_byte_counts_match_the_allocation(with_mtp, kv_cache_dtype):
    cfg = tiny_config("yarn_hc2_hca16")  # 128-dim indexer keys: packed e4m3 in fp8 mode
    cache = ModelCache(
        cfg,
        num_slots=3,
        num_pages=5,
        page_size=32,
        dtype=torch.bfloat16,
        with_mtp=with_mtp,
        kv_cache_dtype=kv_cache_dtype,
        spare=2,
        num_snapshots=4,
    )
    assert len(cache.layers) == cfg.num_hidden_layers + with_mtp
    pages = _bytes(t for layer in cache.layers for t in (layer.compressed, layer.index_keys))
    states = [s for layer in cache.layers for s in (layer.compressor, layer.indexer) if s is not None]
    slots = _bytes([layer.window for layer in cache.layers] + [t for s in states for t in (s.kv, s.score)])
    # The pools hold the 5 pages plus the scratch page that padding and unfinished windows write to.
    assert pages == (5 + SCRATCH_PAGES) * bytes_per_page(cfg, 32, torch.bfloat16, with_mtp, kv_cache_dtype)
    assert (kv_cache_dtype == "fp8") == any(
        layer.index_keys.dtype == torch.uint8 for layer in cache.layers if layer.index_keys is not None
    )
    assert slots == 3 * bytes_per_slot(cfg, torch.bfloat16, with_mtp, 2, kv_cache_dtype)
    kept = [layer.snapshot for layer in cache.layers]
    states = [s for k in kept for s in (k.compressor, k.indexer) if s is not None]
    snapshots = _bytes([k.window for k in kept] + [t for s in states for t in (s.kv, s.score)])
    assert snapshots == 4 * bytes_per_snapshot(cfg, torch.bfloat16, with_mtp, kv_cache_dtype)
    # fp8: window and compressed entries are rows of bytes (head_dim 128 = 64 e4m3 + 64 bf16 RoPE + 1 scale
    # byte, padded to 200), not of the compute dtype.
    entry = 200 if kv_cache_dtype == "fp8" else 128 * 2
    assert all(layer.window.shape[-1] * layer.window.element_size() == entry for layer in cache.layers)


def test_flash_fp8_cache_bytes_per_token_of_context():
    """DeepSeek-V4-Flash with the FP8 cache, counted by hand: per 256-token page, each of the 21 CSA layers holds
    64 entries of 584 B (448 e4m3 + 64 bf16 RoPE + 7 scales + 1 pad) and 64 indexer keys of 132 B, each of the
    20 HCA layers 2 entries; the 2 window layers (and the MTP layer) hold nothing paged. The published figure is
    about 3.4-3.9 KB a token."""
    cfg = load_config(config_dict("flash"))
    per_page = 21 * 64 * (584 + 132) + 20 * 2 * 584
    for with_mtp in (False, True):
        assert bytes_per_page(cfg, 256, torch.bfloat16, with_mtp, "fp8") == per_page
    assert per_page / 256 == 3850.25
    # Per request: 43 windows of 128 entries of 584 B besides the fp32 compressor states.
    assert bytes_per_snapshot(cfg, torch.bfloat16, False, "fp8") == 43 * 128 * 584 + 21 * 2 * 4 * 2 * (512 + 128) * 4


def test_page_size_must_be_a_multiple_of_every_ratio():
    cfg = tiny_config("yarn_hc2_hca16")  # ratios 4 and 16
    with pytest.raises(ValueError, match=r"not of \[16\]"):
        ModelCache(cfg, num_slots=1, num_pages=1, page_size=8, dtype=torch.float32)


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ModelCache(tiny_config("mixed_hca8"), 1, 1, 16, torch.float32, kv_cache_dtype="int4")
