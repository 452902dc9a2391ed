"""The model with its layer kernels (mHC, hc_post with the next hc_pre in one launch, RMSNorm, RoPE, the entries'
norm + RoPE + FP8 form, gated pooling, ring writes) run by the Triton interpreter on the CPU gives the logits of
their torch references: the kernels fit the model's own calls (shapes, strides, dtypes), with either cache dtype."""

from collections import Counter

import pytest
import torch
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, run_in_chunks, tiny_config, transformers_model

import ds4.model.attention
import ds4.model.block
import ds4.model.compressor
import ds4.model.deepseek_v4
import ds4.model.indexer
import ds4.model.linear
from ds4.kernels import gated_pool, hyper_connections, norm_rope, ring_write, rmsnorm, rope
from ds4.model.batch import ForwardBatch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="with CUDA the model runs the kernels (model GPU tests)"
)


def _hc_post_pre(out, streams, post, comb, fn, scale, base, weight, hc, iters, hc_eps, norm_eps):
    """hc_post_pre as on CUDA: one launch for a few tokens, else hc_post's, hc_pre's and rms_norm's."""
    gates, mhc = (fn, scale, base), (hc, iters, hc_eps, norm_eps)
    if streams.shape[0] <= hyper_connections.POST_PRE_TOKENS:
        return hyper_connections.hc_post_pre_triton(out, streams, post, comb, *gates, weight, *mhc)
    new = hyper_connections.hc_post_triton(out, streams, post, comb)
    x, post, comb = hyper_connections.hc_pre_triton(new, *gates, *mhc)
    return new, rmsnorm.rms_norm_triton(x, weight, norm_eps), post, comb


KERNELS = [
    (ds4.model.block, "hc_pre", hyper_connections.hc_pre_triton),
    (ds4.model.block, "hc_post", hyper_connections.hc_post_triton),
    (ds4.model.block, "hc_post_pre", _hc_post_pre),
    (ds4.model.deepseek_v4, "hc_head", hyper_connections.hc_head_triton),
    (ds4.model.block, "rms_norm", rmsnorm.rms_norm_triton),
    (ds4.model.linear, "rms_norm", rmsnorm.rms_norm_triton),  # q_norm, by the query projection
    (ds4.model.deepseek_v4, "rms_norm", rmsnorm.rms_norm_triton),
    (ds4.model.indexer, "apply_rope", rope.apply_rope_triton),
    (ds4.model.attention, "norm_rope", norm_rope.norm_rope_triton),
    (ds4.model.compressor, "pooled_entries", gated_pool.pooled_entries_triton),
    (ds4.model.attention, "write_rings", ring_write.write_rings_triton),
    (ds4.model.compressor, "write_rings", ring_write.write_rings_triton),
]


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_interpreted_layer_kernels_give_the_reference_logits(monkeypatch, kv_cache_dtype):
    cfg = tiny_config("mixed_hca8")  # hc 4; CSA (overlapping windows of 4) and HCA (8) layers
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype)
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    table = torch.arange(8).flip(0)

    def run():
        cache = model.new_cache(2, 8, 16)
        logits = [run_in_chunks(model, cache, ids[:14], [9, 1, 4], slot=1, table=table)]
        for p in (14, 15):  # decode_only steps beside a padding row: a window left unfinished, then completed
            batch = ForwardBatch(
                torch.stack([ids[p], ids[0]]),
                torch.tensor([p, 0]),
                torch.tensor([0, 1, 2]),
                torch.tensor([p, 0]),
                torch.tensor([1, 0]),
                torch.stack([table, torch.full_like(table, -1)]),
                decode_only=True,
            )
            logits.append(model.compute_logits(model(batch, cache))[:1])
        return torch.cat(logits)

    want = run()
    calls = Counter()
    for module, name, kernel in KERNELS:

        def counted(*args, _kernel=kernel, _key=(module.__name__, name), **kwargs):
            calls[_key] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    got = run()
    assert len(calls) == len(KERNELS), f"never called: {[k for k in KERNELS if (k[0].__name__, k[1]) not in calls]}"
    assert max_rel_err(got, want) <= 1e-5
