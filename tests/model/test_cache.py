"""Cache storage: page size validation and the byte counts an engine sizes its pools from."""

import pytest
import torch
from dsv4_tiny import tiny_config

from ds4.model.cache import SCRATCH_PAGES, ModelCache, bytes_per_page, bytes_per_slot


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("with_mtp", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
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
    assert slots == 3 * bytes_per_slot(cfg, torch.bfloat16, with_mtp)


def test_page_size_must_be_a_multiple_of_every_ratio():
    cfg = tiny_config("yarn_hc2_hca16")  # ratios 4 and 16
    with pytest.raises(ValueError, match=r"not of \[16\]"):
        ModelCache(cfg, num_slots=1, num_pages=1, page_size=8, dtype=torch.float32)


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ModelCache(tiny_config("mixed_hca8"), 1, 1, 16, torch.float32, kv_cache_dtype="int4")
