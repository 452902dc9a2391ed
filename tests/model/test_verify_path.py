"""A verify step on the decode path (decode_only, k + 1 tokens a request: the shape CUDA graphs capture) equals the
general path: requests with fewer drafts are padded with tokens past their last draft, absent requests with
padding rows, and every step then gives each real row the general path's logits, whatever was kept before.

The general path is the oracle (tested against transformers); the padded tokens are rejected tokens of a kind,
which test_rejected_tokens shows leave nothing behind, and the live state compared at the end shows it too.
"""

import random

import pytest
import torch
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, step_batch, tiny_config, transformers_model
from test_rejected_tokens import _live_state

from ds4.kernels.fp8_kv import dequantize_kv, kv_entry_bytes
from ds4.model.batch import ForwardBatch

PAGE, TABLE_WIDTH = 16, 6


@pytest.fixture(scope="module", params=[("mixed_hca8", "auto"), ("yarn_hc2_hca16", "fp8")], ids="-".join)
def model(request):
    name, kv_cache_dtype = request.param
    cfg = tiny_config(name)
    return ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype=kv_cache_dtype)


def verify_batch(steps, k, pad_requests, scratch_slot):
    """steps: (tokens, context length, slot, block table) per request, each padded to k + 1 tokens (ids 0 at the
    positions after its last token), then `pad_requests` padding requests of k + 1 tokens at the scratch slot."""
    n, ids, positions, tables = k + 1, [], [], []
    for tokens, ctx, _, table in steps:
        ids += tokens.tolist() + [0] * (n - len(tokens))
        positions += range(ctx, ctx + n)
        tables.append(torch.cat((table, torch.full((TABLE_WIDTH - len(table),), -1))))
    ids += [0] * (n * pad_requests)
    positions += [0] * (n * pad_requests)
    tables += [torch.full((TABLE_WIDTH,), -1)] * pad_requests
    r, i32 = len(steps) + pad_requests, dict(dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        query_start_loc=torch.arange(r + 1, **i32) * n,
        context_lens=torch.tensor([s[1] for s in steps] + [0] * pad_requests, **i32),
        slots=torch.tensor([s[2] for s in steps] + [scratch_slot] * pad_requests, **i32),
        block_tables=torch.stack(tables).to(torch.int32),
        decode_only=True,
        tokens_per_request=n,
    )


@pytest.mark.parametrize("k", [1, 3])
def test_padded_verify_steps_equal_the_general_path(model, k):
    cfg, rng = model.cfg, random.Random(k)
    gen = torch.Generator().manual_seed(k)
    slots, scratch_slot = [2, 0, 1], 3
    tables = [torch.tensor([4, 1, 6, -1]), torch.tensor([0, 5, 2, 8]), torch.tensor([3, 7, -1, -1])]
    prompt_lens = [cfg.sliding_window + 5, 2 * PAGE + 1, 6]
    caches = [model.new_cache(4, 9, PAGE, spare=k) for _ in range(2)]  # general, padded
    context = list(prompt_lens)
    for cache in caches:
        for r, n in enumerate(prompt_lens):
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(r))
            model(step_batch([(ids, 0, slots[r], tables[r])]), cache)
    last = [int(t) for t in torch.randint(0, cfg.vocab_size, (3,), generator=gen)]
    for step in range(6):
        # Draft counts 0..k (0: a request that does not speculate); the pages hold every real token.
        drafts = [torch.randint(0, cfg.vocab_size, ((step + r) % (k + 1),), generator=gen) for r in range(3)]
        steps = [(torch.cat((torch.tensor([last[r]]), drafts[r])), context[r], slots[r], tables[r]) for r in range(3)]
        assert all(c + len(t) <= PAGE * int((table >= 0).sum()) for t, c, _, table in steps)
        expected = model.compute_logits(model(step_batch(steps), caches[0]))
        hidden = model(verify_batch(steps, k, pad_requests=2, scratch_slot=scratch_slot), caches[1])
        rows = [r * (k + 1) + j for r, (t, *_) in enumerate(steps) for j in range(len(t))]
        # fp8: the two paths sum the projections in other orders (1e-7), which can move a stored value across a
        # bf16 (RoPE) or e4m3 rounding boundary: one ulp of one channel.
        tolerance = 1e-3 if model.kv_cache_dtype == "fp8" else 1e-5
        assert max_rel_err(model.compute_logits(hidden[rows]), expected) <= tolerance, f"step {step}"
        for r in range(3):  # keep a random prefix of the drafts, and one more token
            kept = rng.randint(0, len(drafts[r]))
            context[r] += kept + 1
            last[r] = rng.randrange(cfg.vocab_size)
    for r in range(3):
        general = _live_state(model, caches[0], context[r], tables[r], slots[r])
        padded = _live_state(model, caches[1], context[r], tables[r], slots[r])
        for a, b in zip(general, padded):
            if a.dtype == torch.uint8 and a.shape[-1] == kv_entry_bytes(cfg.head_dim, cfg.qk_rope_head_dim):
                # FP8 entries: compare the values; one may sit one e4m3 step (1/8) or bf16 step apart (see above).
                a, b = (dequantize_kv(x, cfg.head_dim, cfg.qk_rope_head_dim, torch.float32) for x in (a, b))
                assert torch.allclose(b, a, rtol=0.125, atol=1e-3), f"request {r}"
                continue
            assert torch.allclose(b.float(), a.float(), rtol=tolerance, atol=tolerance), f"request {r}"


def test_validate_knows_tokens_per_request():
    i32 = dict(dtype=torch.int32)
    batch = ForwardBatch(
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([5, 6, 0, 1]),
        torch.tensor([0, 2, 4], **i32),
        torch.tensor([5, 0], **i32),
        torch.tensor([0, 1], **i32),
        torch.tensor([[0], [1]], **i32),
        decode_only=True,
        tokens_per_request=2,
    )
    batch.validate()
    batch.tokens_per_request = 1
    with pytest.raises(ValueError, match="exactly 1 token"):
        batch.validate()
