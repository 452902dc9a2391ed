"""Tokens run past what a request keeps (speculative drafts the verification rejects) leave no trace.

For every split of a 4-token verification window (1..4 tokens kept) at window starts around the
compressor boundaries, a cache that ran the rejected tokens and one that never saw them give the same
logits for the tokens that follow (general and decode path), hold the same sliding-window rows,
compressor and indexer states and compressed / indexer entries for every position the request can
still read, and the MTP layer, which also drafted past the kept tokens, gives the same drafts.
"""

import pytest
import torch
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, step_batch, tiny_config, transformers_model
from test_mtp import _mtp_tensors

from ds4.config import CSA, WINDOW
from ds4.kernels.fp8_kv import dequantize_kv, kv_entry_bytes

K = 3  # drafts per window: the window is the last kept token plus K drafts
PAGES = 4


@pytest.fixture(scope="module")
def model(request):
    cfg = tiny_config("mixed_hca8")  # ratios 4 and 8, window 8, index_topk 3
    tensors = {**official_tensors(transformers_model(cfg)), **_mtp_tensors(cfg)}
    return ds4_model(cfg, tensors, with_mtp=True, kv_cache_dtype=getattr(request, "param", "bf16"))


def _main(model, cache, ids, start, table, decode=False):
    batch = step_batch([(ids, start, 0, table)])
    batch.decode_only = decode
    return model(batch, cache)


def _mtp(model, cache, next_ids, start, hidden, table, decode=False):
    batch = step_batch([(next_ids, start, 0, table)])
    batch.decode_only = decode
    return model.mtp_forward(batch, hidden, cache)


def _live_state(model, cache, n, table, slot=0):
    """What a request of n cached tokens in `slot` can still read: window rows of the last `window` positions,
    compressor ring rows of the unfinished window (and the one before, with overlap), entries below n // ratio."""
    cfg, out = model.cfg, []
    for layer in cache.layers:
        rows = layer.window.shape[1]
        out.append(layer.window[slot, torch.arange(max(0, n - cfg.sliding_window), n) % rows])
        if layer.kind == WINDOW:
            continue
        windows = 2 if layer.kind == CSA else 1  # CSA pools overlapping windows (its indexer too)
        needed = torch.arange(max(0, (n // layer.ratio - windows + 1) * layer.ratio), n)
        for state in (layer.compressor, layer.indexer):
            if state is not None:
                out += [state.kv[slot, needed % state.kv.shape[1]], state.score[slot, needed % state.kv.shape[1]]]
        entries = torch.arange(n // layer.ratio)
        for pool in (layer.compressed, layer.index_keys):
            if pool is not None:
                per_page = pool.shape[1]
                out.append(pool[table[entries // per_page].long(), entries % per_page])
    return out


@pytest.mark.parametrize("start", [13, 15])
@pytest.mark.parametrize("kept", [1, 2, 3, 4])
def test_rejected_tokens_leave_no_trace(model, start, kept):
    (clean, clean_mtp, clean_state), (got, got_mtp, got_state) = _clean_and_rejected(model, start, kept)
    assert max_rel_err(got, clean) <= 1e-5
    assert max_rel_err(got_mtp, clean_mtp) <= 1e-5
    for a, b in zip(got_state, clean_state, strict=True):
        assert a.numel() == 0 or max_rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("model", ["fp8"], indirect=True)
def test_rejected_tokens_leave_no_trace_in_the_fp8_cache(model):
    """The same over the FP8 cache (rows of e4m3 + bf16 RoPE entries). Its windows run other batch sizes, whose
    sums in other orders (1e-7) can move a stored value across a rounding boundary: logits within 1e-3, stored
    entries within one e4m3 step (1/8) of each other, fp32 states within 1e-3."""
    cfg = model.cfg
    (clean, clean_mtp, clean_state), (got, got_mtp, got_state) = _clean_and_rejected(model, 13, 2)
    assert max_rel_err(got, clean) <= 1e-3
    assert max_rel_err(got_mtp, clean_mtp) <= 1e-3
    entry = kv_entry_bytes(cfg.head_dim, cfg.qk_rope_head_dim)
    for a, b in zip(got_state, clean_state, strict=True):
        if a.dtype == torch.uint8 and a.shape[-1] == entry:
            a, b = (dequantize_kv(x, cfg.head_dim, cfg.qk_rope_head_dim, torch.float32) for x in (a, b))
            assert torch.allclose(a, b, rtol=0.125, atol=1e-3)
        else:
            assert a.numel() == 0 or max_rel_err(a.float(), b.float()) <= 1e-3


def _clean_and_rejected(model, start, kept):
    """(logits, MTP logits, live state) of a request whose speculative window kept `kept` tokens, run without
    and with rejected drafts (and the MTP layer's own drafts past them)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(start * 10 + kept)
    ids = torch.randint(0, cfg.vocab_size, (start + kept + 10,), generator=gen)
    junk = torch.randint(0, cfg.vocab_size, (K + 1 - kept,), generator=gen)  # rejected drafts
    drafted = torch.randint(0, cfg.vocab_size, (K - 1,), generator=gen)  # the MTP layer's own further drafts
    table = torch.tensor([2, 0, 3, 1])
    n = start + kept  # tokens cached after the window
    results = {}
    for run in ("clean", "rejected"):
        cache = model.new_cache(1, PAGES, 16, spare=K)
        hidden = _main(model, cache, ids[:start], 0, table)
        mtp = _mtp(model, cache, ids[1 : start + 1], 0, hidden, table)
        window = ids[start:n]
        if run == "rejected":
            # The MTP layer drafts K - 1 positions past the last one it verified (on its own streams).
            streams = mtp[-1:]
            for j in range(K - 1):
                streams = _mtp(model, cache, drafted[j : j + 1], start + j, streams, table, decode=True)
            window = torch.cat((window, junk))
        hidden = _main(model, cache, window, start, table)[:kept]
        # The MTP layer catches up over the kept positions, then everything continues from n.
        mtp_logits = [model.compute_mtp_logits(_mtp(model, cache, ids[start + 1 : n + 1], start, hidden, table))]
        state = [t.clone() for t in _live_state(model, cache, n, table)]
        logits, done = [], n
        for size, decode in [(1, True), (1, True), (5, False), (1, True), (1, True)]:
            hidden = _main(model, cache, ids[done : done + size], done, table, decode)
            logits.append(model.compute_logits(hidden))
            nxt = ids[done + 1 : done + size + 1]
            mtp_logits.append(
                model.compute_mtp_logits(_mtp(model, cache, nxt, done, hidden[: len(nxt)], table, decode))
            )
            done += size
        results[run] = torch.cat(logits), torch.cat(mtp_logits), state
    return results["clean"], results["rejected"]


def test_decode_path_keeps_spare_rows_apart():
    """Ring rows are position % (window + spare) on both paths: a decode step after a chunk reads what the chunk
    wrote, with spare rows present."""
    cfg = tiny_config("mixed_hca8")
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)))
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    table = torch.arange(PAGES)
    out = {}
    for spare in (0, 5):
        cache = model.new_cache(1, PAGES, 16, spare=spare)
        _main(model, cache, ids[:21], 0, table)
        logits = [
            model.compute_logits(_main(model, cache, ids[p : p + 1], p, table, decode=True)) for p in range(21, 30)
        ]
        out[spare] = torch.cat(logits)
    assert max_rel_err(out[5], out[0]) <= 1e-5
