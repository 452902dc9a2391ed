"""Chunked prefill at any boundary and token-by-token decode give the whole-prefill logits."""

import pytest
import torch
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, run_in_chunks, tiny_config, transformers_model


@pytest.fixture(scope="module", params=["mixed_hca8", "yarn_hc2_hca16"])
def setup(request):
    cfg = tiny_config(request.param)
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)))
    ids = torch.randint(0, cfg.vocab_size, (3 * cfg.sliding_window + 13,), generator=torch.Generator().manual_seed(2))
    whole = run_in_chunks(model, model.new_cache(2, 8, 16), ids, [len(ids)], slot=0, table=torch.arange(8))
    return cfg, model, ids, whole


def _chunk_sizes(cfg):
    win = cfg.sliding_window
    ratios = sorted({r for r in cfg.compress_ratios if r})
    return sorted({1, 3, win - 1, win, win + 1} | {r - 1 for r in ratios} | set(ratios))


def test_every_chunk_size_matches_whole_prefill(setup):
    cfg, model, ids, whole = setup
    for size in _chunk_sizes(cfg):
        # A different slot and a shuffled page table each time: state must come only from this request's cache.
        got = run_in_chunks(model, model.new_cache(3, 8, 16), ids, [size], slot=2, table=torch.randperm(8))
        assert max_rel_err(got, whole) <= 1e-5, f"chunk size {size}"


def test_prefill_then_decode_matches_whole_prefill(setup):
    cfg, model, ids, whole = setup
    cut = cfg.sliding_window + 3
    got = run_in_chunks(model, model.new_cache(2, 8, 16), ids, [cut] + [1] * len(ids), slot=1, table=torch.randperm(8))
    assert max_rel_err(got, whole) <= 1e-5


def test_irregular_chunks_match_whole_prefill(setup):
    cfg, model, ids, whole = setup
    got = run_in_chunks(
        model, model.new_cache(2, 8, 16), ids, [5, 1, 11, 2, 17, 1, 1, 6], slot=0, table=torch.randperm(8)
    )
    assert max_rel_err(got, whole) <= 1e-5
