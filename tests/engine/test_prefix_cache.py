"""Prefix caching changes no output, reuses what it should, and never leaks a page.

Oracle for outputs: the plain model loop of test_engine (whole prompt, then one token at a time, fresh
cache). The tiny model has CSA ratio 4, HCA ratio 16 and a sliding window of 16 tokens.
"""

import random
from types import SimpleNamespace

import pytest
import torch
from test_engine import PAGE, collect, engine, random_prompts, reference_decode, token_ids
from tiny_model import load_tiny_model

from ds4.engine.model_runner import ChunkResult
from ds4.engine.sampling_params import SamplingParams
from ds4.model.cache import SCRATCH_PAGES, bytes_per_page, bytes_per_slot, bytes_per_snapshot


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def with_logprobs(max_tokens, prompt_logprobs=None):
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, prompt_logprobs=prompt_logprobs
    )


def check_against_reference(model, prompt, outs):
    """Greedy tokens equal the oracle's, each chosen token's logprob within 1e-4 of the oracle's."""
    expected, logits = reference_decode(model, prompt, len(token_ids(outs)))
    assert token_ids(outs) == expected
    logprobs = torch.log_softmax(logits, dim=-1)
    got = [lp.logprob for o in outs for lp in o.new_logprobs]
    assert got == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(expected)], abs=1e-4)


def cache_memory(model, num_pages, num_slots, num_snapshots, page_size=PAGE):
    return (
        num_slots * bytes_per_slot(model.cfg, model.dtype)
        + num_snapshots * bytes_per_snapshot(model.cfg, model.dtype)
        + (num_pages + SCRATCH_PAGES) * bytes_per_page(model.cfg, page_size, model.dtype)
    )


# Shared prefix lengths: inside a CSA window (37, 50), on a CSA boundary (44), inside the sliding window of a
# page (21, 40), on an HCA boundary / the end of a 16-token window / a page end (16, 32, 48, 64), and a
# prompt cached whole but for its last token (49 + nothing).
@pytest.mark.parametrize("page_size", [16, 32])
def test_outputs_with_cached_prefixes_equal_the_model_alone(model, page_size):
    rng = random.Random(page_size)
    base = random_prompts(1, seed=20, lo=90, hi=90)[0]
    eng = engine(
        model, page_size=page_size, max_num_batched_tokens=40, long_prefill_token_threshold=23, max_model_len=128
    )
    donor = base[:64]
    outs = collect(eng, [("donor", donor, with_logprobs(18))])["donor"]
    check_against_reference(model, donor, outs)
    conversation = donor + token_ids(outs)[:17] + base[64:70]
    cases = {f"shared{n}": base[:n] + fresh(rng, 7) for n in (16, 21, 32, 37, 40, 44, 48, 50)}
    cases.update(whole=base[:49], same=donor, conversation=conversation)
    for rid, prompt in cases.items():
        before = eng.stats().prefix_cache_hit_tokens
        outs = collect(eng, [(rid, prompt, with_logprobs(3))])[rid]
        check_against_reference(model, prompt, outs)
        shared = next(i for i, (a, b) in enumerate(zip(prompt + [-1], conversation + [-2])) if a != b)
        hit = min(shared, len(prompt) - 1) // page_size * page_size
        assert eng.stats().prefix_cache_hit_tokens - before == hit, rid
    # Several requests on one prefix at once, and a prompt-logprobs request that must not use the cache.
    family = [(f"f{i}", base[:40] + fresh(rng, 5 + i), with_logprobs(6)) for i in range(3)]
    wants_prompt_logprobs = ("p", base[:40] + [7, 8, 9], with_logprobs(3, prompt_logprobs=1))
    before = eng.stats().prefix_cache_hit_tokens
    outs = run_together(eng, family + [wants_prompt_logprobs])
    assert eng.stats().prefix_cache_hit_tokens - before == 3 * (40 // page_size * page_size)
    for rid, prompt, _ in family + [wants_prompt_logprobs]:
        check_against_reference(model, prompt, outs[rid])
    prompt = wants_prompt_logprobs[1]
    _, logits = reference_decode(model, prompt, 1)
    plp = outs["p"][0].prompt_logprobs
    full = model.compute_logits(model.forward(_batch(prompt), model.new_cache(1, 4, PAGE)))
    expected = torch.log_softmax(full[:-1], dim=-1)
    assert len(plp) == len(prompt) and plp[0] is None
    assert [e.logprob for e in plp[1:]] == pytest.approx(
        [float(expected[p, prompt[p + 1]]) for p in range(len(prompt) - 1)], abs=1e-4
    )
    assert eng.allocator.num_free_pages == eng.allocator.num_pages


def run_together(eng, requests):
    """Add every (request_id, prompt, params) at once, step until done; {id: [RequestOutput...]}."""
    outs = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs[out.request_id].append(out)
    return outs


def _batch(prompt):
    from test_engine import one_request_batch

    return one_request_batch(prompt, 0, list(range(4)))


def fresh(rng, n):
    return [rng.randrange(2, 129000) for _ in range(n)]


def test_scripted_workload_hits_and_evicts_as_counted_by_hand(model):
    """Six pages of 16 tokens, one request at a time, each generating one token (so only prompts are cached)."""
    eng = engine(
        model,
        max_num_seqs=1,
        max_num_batched_tokens=128,
        long_prefill_token_threshold=96,
        max_model_len=96,
        prefix_cache_snapshots=16,
        kv_cache_memory=cache_memory(model, num_pages=6, num_slots=1, num_snapshots=16),
    )
    assert eng.allocator.num_pages == 6
    rng = random.Random(3)
    a = fresh(rng, 40)
    d = fresh(rng, 90)
    script = [
        ("A", a, 0, 0),  # caches pages 0-1 of A (its 3rd page is partial)
        ("B", a[:35] + fresh(rng, 10), 32, 0),  # shares A's first 32 tokens
        ("C", fresh(rng, 20), 0, 0),  # caches 1 page: 3 cached, 3 free
        ("D", d, 0, 3),  # needs all 6 pages: 3 free, 3 cached ones evicted; caches D's pages 0-4
        ("E", a, 0, 2),  # A's pages are gone; 1 free page + D's two tail pages evicted
        ("F", d, 48, 2),  # D's pages 0-2 remain; 1 free page + E's two cached pages evicted
    ]
    for rid, prompt, hit, evictions in script:
        before = eng.stats()
        outs = collect(eng, [(rid, prompt, with_logprobs(1))])[rid]
        check_against_reference(model, prompt, outs)
        after = eng.stats()
        assert after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == hit, rid
        assert after.prefix_cache_evicted_pages - before.prefix_cache_evicted_pages == evictions, rid
    stats = eng.stats()
    assert stats.prefix_cache_queried_tokens == 40 + 45 + 20 + 90 + 40 + 90
    assert stats.prefix_cache_hit_rate == pytest.approx(80 / 325)
    assert stats.num_cached_pages == 5 and stats.num_free_pages == 6  # F's 5 pages (E's were evicted), reclaimable


def test_preemption_and_eviction_under_shared_prefixes_change_no_output(model):
    rng = random.Random(5)
    families = [fresh(rng, 40), fresh(rng, 40)]
    eng = engine(
        model,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=12,
        max_model_len=64,
        prefix_cache_snapshots=4,
        kv_cache_memory=cache_memory(model, num_pages=7, num_slots=3, num_snapshots=4),
    )
    requests = []
    for i in range(6):
        prompt = families[i % 2][: rng.randint(20, 40)] + fresh(rng, rng.randint(3, 10))
        requests.append((f"r{i}", prompt, with_logprobs(rng.randint(8, 14))))
    outs = collect(eng, requests)
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_evicted_pages > 0 and stats.prefix_cache_hit_tokens > 0
    for rid, prompt, _ in requests:
        check_against_reference(model, prompt, outs[rid])
    assert eng.allocator.num_free_pages == eng.allocator.num_pages


class ScriptedRunner:
    """Stands in for the model runner: each sampling chunk yields a token that depends only on the request's tokens.
    Its steps replay no CUDA graph, so none runs ahead."""

    def launch(self, chunks, snapshots=None, after=None):
        return SimpleNamespace(chunks=chunks, step=SimpleNamespace(graph_key=None))

    def finish(self, launched):
        return [
            ChunkResult(token_ids=[2 + hash(tuple(c.seq.token_ids(0, c.seq.num_tokens))) % 1000] if c.samples else [])
            for c in launched.chunks
        ]


def test_no_page_or_snapshot_leaks_after_1000_random_requests(model):
    rng = random.Random(7)
    eng = engine(
        model,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=20,
        max_model_len=96,
        prefix_cache_snapshots=12,
        kv_cache_memory=cache_memory(model, num_pages=24, num_slots=6, num_snapshots=12),
    )
    eng.runner = ScriptedRunner()
    families = [fresh(rng, 64) for _ in range(5)]
    alloc, cache = eng.allocator, eng.prefix_cache
    added = 0
    while added < 1000 or eng.has_unfinished_requests():
        for _ in range(rng.choice((0, 0, 1, 2))):
            if added < 1000:
                prompt = rng.choice(families)[: rng.randint(0, 64)] + fresh(rng, rng.randint(1, 12))
                eng.add_request(f"q{added}", prompt, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True))
                added += 1
        if eng.requests and rng.random() < 0.05:
            eng.abort(rng.choice(sorted(eng.requests)))
        eng.step()
        held = {p for s in eng.scheduler.running for p in s.page_table}
        assert len(held) + alloc.num_free_pages == alloc.num_pages
        assert cache.num_kept_snapshots + cache.num_free_snapshots == cache.num_snapshots
    stats = eng.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_evicted_pages > 0 and stats.prefix_cache_hit_rate > 0.2
    assert alloc.num_free_pages == alloc.num_pages and alloc.num_free_slots == alloc.num_slots
    assert cache.num_reclaimable_pages == cache.num_cached_pages > 0


def test_flags_turn_prefix_caching_on_by_default_and_off_on_request(model):
    import argparse

    from ds4.engine.config import add_engine_args, engine_flags_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_flags_from_args(parser.parse_args([]))["enable_prefix_caching"] is True
    assert engine_flags_from_args(parser.parse_args(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False
    assert engine_flags_from_args(parser.parse_args(["--prefix-cache-snapshots", "3"]))["prefix_cache_snapshots"] == 3
    assert engine(model).prefix_cache is not None
    off = engine(model, enable_prefix_caching=False)
    assert off.prefix_cache is None and off.plan.num_snapshots == 0


def test_pages_and_snapshots_of_the_cuda_graph_decode_path_serve_later_requests(model):
    """Decode steps through DecodeGraphs' padded decode_only batches (run eagerly) fill pages whose page-end
    snapshots are copied after the step; a later conversation resumes from them."""
    from tiny_model import EagerDecodeGraphs

    eng = engine(model, max_num_seqs=2, max_num_batched_tokens=48, long_prefill_token_threshold=16)
    cache = model.new_cache(eng.plan.num_slots + 1, eng.plan.num_pages, PAGE, eng.plan.num_snapshots)
    eng.cache = eng.runner.cache = cache
    graphs = EagerDecodeGraphs(model, cache, 2, 8, padding_slot=eng.plan.num_slots, device=torch.device("cpu"))
    eng.runner.graphs = graphs
    rng = random.Random(11)
    donor = fresh(rng, 40)
    outs = collect(eng, [("donor", donor, with_logprobs(30))])["donor"]
    check_against_reference(model, donor, outs)
    assert len(graphs.runs) >= 29
    conversation = donor + token_ids(outs)[:26] + fresh(rng, 4)
    outs = collect(eng, [("turn2", conversation, with_logprobs(8))])["turn2"]
    check_against_reference(model, conversation, outs)
    assert eng.stats().prefix_cache_hit_tokens == 64
