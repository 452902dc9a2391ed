"""The fp8 model with the indexer's query, key and picked-rows kernels run by the Triton interpreter on the CPU gives
the logits of their torch references bit for bit (the kernels are exact, and fit the model's own calls), over
prefill chunks, one-token steps and a padded decode_only step of 1 + 1 tokens a request."""

from collections import Counter

import pytest
import torch
from dsv4_tiny import ds4_model, official_tensors, step_batch, tiny_config, transformers_model

import ds4.model.cache
import ds4.model.indexer
from ds4.kernels import fp4_act, indexer
from ds4.model.batch import ForwardBatch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the model runs the kernels")

KERNELS = [
    (ds4.model.indexer, "rotate_fp4_rows", fp4_act.rotate_fp4_rows),
    (ds4.model.indexer, "index_queries", indexer.index_queries),
    (ds4.model.indexer, "entry_rows", indexer.entry_rows),
    (ds4.model.cache, "write_indexer_keys", indexer.write_indexer_keys),
]


def _steps(model, cache, ids):
    """Logits of a prefill in chunks of 24 and 12 tokens and of one-token steps, then of a decode_only step of two
    tokens for each of two requests plus a padding request (slot 2, no pages). Past 20 tokens a token sees more
    entries than index_topk (5): the picks matter."""
    table = torch.tensor([3, 0, 2, 1])
    out, done = [], 0
    for n in (24, 12, 1, 1):
        out.append(model.compute_logits(model(step_batch([(ids[done : done + n], done, 0, table)]), cache)))
        done += n
    model(step_batch([(ids[:29], 0, 1, torch.tensor([5, 4]))]), cache)
    tables = torch.tensor([[3, 0, 2, 1], [5, 4, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    context = [done, 29, 0]
    batch = ForwardBatch(
        input_ids=ids[done : done + 6],
        positions=torch.tensor([p + i for p in context for i in range(2)]),
        query_start_loc=torch.arange(0, 7, 2, dtype=torch.int32),
        context_lens=torch.tensor(context, dtype=torch.int32),
        slots=torch.tensor([0, 1, 2], dtype=torch.int32),
        block_tables=tables,
        decode_only=True,
        tokens_per_request=2,
    )
    out.append(model.compute_logits(model(batch, cache)[:4]))
    return torch.cat(out)


def test_interpreted_indexer_kernels_give_the_reference_logits(monkeypatch):
    cfg = tiny_config("yarn_hc2_hca16")  # 128-dim indexer keys: the packed e4m3 cache
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype="fp8")
    ids = torch.randint(0, cfg.vocab_size, (44,), generator=torch.Generator().manual_seed(3))
    want = _steps(model, model.new_cache(3, 8, 16, spare=1), ids)
    calls = Counter()
    for module, name, kernel in KERNELS:

        def interpreted(*args, _kernel=kernel, _key=name, **kwargs):
            calls[_key] += 1
            return _kernel(*args, **kwargs, impl="triton")

        monkeypatch.setattr(module, name, interpreted)
    got = _steps(model, model.new_cache(3, 8, 16, spare=1), ids)
    assert set(calls) == {name for _, name, _ in KERNELS}
    assert torch.equal(got, want)
