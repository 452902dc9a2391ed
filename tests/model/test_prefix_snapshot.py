"""Resuming a request from a page-end snapshot (prefix caching) gives the logits of one whole prefill.

The first request runs in chunks that start inside compressor windows; the model keeps the state at every
page end inside a chunk, the slot is saved at a chunk that ends on one. A second request, in another
slot, shares the first one's pages up to a page end, takes the snapshot and computes only the rest.
"""

import pytest
import torch
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, step_batch, tiny_config, transformers_model

from ds4.model.batch import BoundarySnapshot

PAGE = 8


# windows of 8 (= a page) and 5; the FP8 cache's entries (80 = 64 e4m3 + 16 bf16 RoPE dims) snapshot as rows
@pytest.mark.parametrize(
    "name,kv_cache_dtype", [("mixed_hca8", "bf16"), ("csa_heavy_yarn", "bf16"), ("mixed_hca8", "fp8")]
)
def test_resuming_after_shared_pages_from_a_snapshot_matches_whole_prefill(name, kv_cache_dtype):
    cfg = tiny_config(name)
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype=kv_cache_dtype)
    ids = torch.randint(0, cfg.vocab_size, (6 * PAGE + 3,), generator=torch.Generator().manual_seed(3))
    pages = torch.arange(7)
    whole_cache = model.new_cache(1, 7, PAGE)
    whole = model.compute_logits(model(step_batch([(ids, 0, 0, pages)]), whole_cache))

    cache = model.new_cache(2, 16, PAGE, num_snapshots=6)
    table = torch.randperm(16)[:7]
    for start, stop in ((0, 5), (5, 24), (24, len(ids))):
        batch = step_batch([(ids[start:stop], start, 0, table)])
        ends = range((start // PAGE + 1) * PAGE, stop, PAGE)
        batch.snapshots = tuple(BoundarySnapshot(0, end, end // PAGE - 1) for end in ends)
        model(batch, cache)
        if stop % PAGE == 0:
            cache.save_snapshots([0], [stop // PAGE - 1], [stop])

    own = [p for p in range(16) if p not in table.tolist()]
    for end in range(PAGE, len(ids), PAGE):
        shared = end // PAGE
        other = torch.tensor(table[:shared].tolist() + own[: 7 - shared])
        cache.restore_snapshots([shared - 1], [1], [end])
        logits = []
        for start, stop in ((end, end + 3), (end + 3, len(ids))):
            if start < stop:
                logits.append(model.compute_logits(model(step_batch([(ids[start:stop], start, 1, other)]), cache)))
        # fp8: other chunkings sum in other orders (1e-7), which can move a stored value across a rounding boundary
        tolerance = 1e-3 if kv_cache_dtype == "fp8" else 1e-5
        assert max_rel_err(torch.cat(logits), whole[end:]) <= tolerance, f"resumed at {end}"
