"""MTP speculative decoding in the engine: it changes how fast tokens come, never which tokens come.

Random tiny weights make the MTP layer's drafts nearly always wrong, so most tests replace the drafts
after each step by the oracle's continuation with some tokens corrupted: every request then sees drafts
accepted in full, cut at every position and rejected at once. The oracle is test_engine's plain loop.
"""

import random

import pytest
from test_engine import PAGE, greedy, random_prompts, reference_greedy, run
from tiny_model import load_tiny_model

from ds4.engine.config import EngineConfig, EngineConfigError
from ds4.engine.engine import LLMEngine
from ds4.engine.sampling_params import SamplingParams
from ds4.model.cache import SCRATCH_PAGES, bytes_per_page, bytes_per_slot, bytes_per_snapshot


@pytest.fixture(scope="module")
def model():
    return load_tiny_model(with_mtp=True)


def spec_engine(model, k, **flags):
    flags.setdefault("page_size", PAGE)
    flags.setdefault("max_model_len", 128)
    flags.setdefault("max_num_seqs", 4)
    flags.setdefault("kv_cache_memory", 1 << 24)
    if k:
        flags["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    return LLMEngine(model, EngineConfig(**flags), seed=0)


def run_with_drafts(eng, arrivals, continuations, k, rng, real_drafts=()):
    """test_engine.run, where after every step each running request's drafts become its oracle continuation
    with each token wrong with probability 0.4 (requests in real_drafts keep the MTP layer's)."""

    def replace_drafts(tokens):
        for rid, seq in eng.requests.items():
            if rid in real_drafts or not seq.draft_token_ids:
                continue
            truth = continuations[rid][len(tokens[rid]) : len(tokens[rid]) + k]
            seq.draft_token_ids = [t if rng.random() > 0.4 else (t + 1) % 129280 for t in truth]

    return run(eng, arrivals, replace_drafts)


def cache_memory(model, k, num_seqs, num_pages, num_snapshots):
    slot = bytes_per_slot(model.cfg, model.dtype, with_mtp=True, spare=k)
    snapshots = num_snapshots * bytes_per_snapshot(model.cfg, model.dtype, with_mtp=True)
    page = bytes_per_page(model.cfg, PAGE, model.dtype, with_mtp=True)
    return num_seqs * slot + snapshots + (num_pages + SCRATCH_PAGES) * page


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize(
    "flags",
    [
        dict(max_num_batched_tokens=48, max_num_seqs=4, long_prefill_token_threshold=13),  # chunked, mixed steps
        dict(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=96, num_pages=7),  # forced preemption
    ],
    ids=["chunked", "preemption"],
)
def test_greedy_with_mtp_equals_greedy_without(model, k, flags):
    flags = dict(flags)
    num_pages = flags.pop("num_pages", None)
    if num_pages is not None:
        flags["prefix_cache_snapshots"] = 2
        flags["kv_cache_memory"] = cache_memory(model, k, flags["max_num_seqs"], num_pages, 2)
    eng = spec_engine(model, k, **flags)
    prompts = random_prompts(5, seed=k, lo=30)
    lengths = [6 + 4 * i for i in range(len(prompts))]
    arrivals, continuations = {}, {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        arrivals.setdefault(i // 2 * 2, []).append((f"r{i}", prompt, greedy(n)))
        continuations[f"r{i}"] = reference_greedy(model, prompt, n)
    tokens, reasons = run_with_drafts(eng, arrivals, continuations, k, random.Random(k), real_drafts={"r0"})
    for i in range(len(prompts)):
        assert tokens[f"r{i}"] == continuations[f"r{i}"], f"request r{i}"
        assert reasons[f"r{i}"] == "length"
    stats = eng.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(n > 0 for n in stats.accepted_per_position)
    if num_pages is not None:
        assert eng.allocator.num_pages == num_pages and eng.stats().num_preemptions > 0
    assert eng.allocator.num_free_pages == eng.allocator.num_pages


def test_real_mtp_drafts_change_nothing(model):
    prompts = random_prompts(3, seed=11)
    outs = {}
    for k in (0, 2):
        eng = spec_engine(model, k)
        arrivals = {0: [(f"r{i}", p, greedy(10)) for i, p in enumerate(prompts)]}
        outs[k], _ = run_with_drafts(eng, arrivals, {}, k, random.Random(0), real_drafts={"r0", "r1", "r2"})
    assert outs[2] == outs[0]
    assert eng.stats().spec_decode.num_drafts > 0


def test_drafts_stop_at_max_tokens_and_eos(model):
    """A draft window never runs past max_tokens, and tokens after a stop token are dropped."""
    prompt = random_prompts(1, seed=21)[0]
    truth = reference_greedy(model, prompt, 12)
    eng = spec_engine(model, 3)
    stop = truth[5]
    eng.add_request("m", prompt, greedy(4))
    eng.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], ignore_eos=True))
    tokens = {"m": [], "s": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.finish_reason == ("length" if out.request_id == "m" else "stop")
        for rid, seq in eng.requests.items():
            seq.draft_token_ids = truth[len(tokens[rid]) : len(tokens[rid]) + 3]
    assert tokens["m"] == truth[:4]
    assert tokens["s"] == truth[: truth.index(stop) + 1]


def test_seeded_sampling_with_mtp_is_the_same_alone_and_among_others(model):
    params = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=10, ignore_eos=True)
    prompt = random_prompts(1, seed=5)[0]
    runs = []
    for companions in (0, 3):
        eng = spec_engine(model, 2, max_num_batched_tokens=40)
        others = [
            (f"c{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=7))
            for i, p in enumerate(random_prompts(companions, seed=6))
        ]
        arrivals = {0: others[:1] + [("x", prompt, params)] + others[1:]}
        tokens, _ = run_with_drafts(eng, arrivals, {}, 2, random.Random(0), real_drafts={"x", "c0", "c1", "c2"})
        runs.append(tokens["x"])
    assert runs[0] == runs[1] and len(set(runs[0])) > 3


def test_speculative_config_is_validated(model):
    assert EngineConfig(speculative_config='{"method": "mtp", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    for bad in ('{"method": "ngram"}', '{"num_speculative_tokens": 0}', "{not json", '{"k": 1}'):
        with pytest.raises(EngineConfigError):
            EngineConfig(speculative_config=bad)
    with pytest.raises(EngineConfigError, match="MTP layer"):
        LLMEngine(
            load_tiny_model(), EngineConfig(speculative_config={"num_speculative_tokens": 1}, kv_cache_memory=1 << 24)
        )


def test_penalised_requests_decode_without_drafts_beside_speculating_ones(model):
    prompts = random_prompts(2, seed=31)
    plain = greedy(8)
    penalised = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=0.5)
    outs, drafted = {}, set()
    for k in (0, 2):
        eng = spec_engine(model, k)
        eng.add_request("plain", prompts[0], plain)
        eng.add_request("penalised", prompts[1], penalised)
        tokens = {"plain": [], "penalised": []}
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] += out.new_token_ids
            drafted |= {rid for rid, seq in eng.requests.items() if seq.draft_token_ids}
        outs[k] = tokens
    assert outs[2] == outs[0]
    assert drafted == {"plain"}


def test_logprobs_of_accepted_drafts_equal_those_without_speculation(model):
    prompt = random_prompts(1, seed=41)[0]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3)
    truth = reference_greedy(model, prompt, 9)
    got = {}
    for k in (0, 3):
        eng = spec_engine(model, k)
        eng.add_request("x", prompt, params)
        entries, steps = [], 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                entries += out.new_logprobs
                steps += 1
            for seq in eng.requests.values():
                seq.draft_token_ids = truth[len(entries) : len(entries) + k] if k else []
        got[k] = entries, steps
    (plain, plain_steps), (spec, spec_steps) = got[0], got[3]
    assert [e.token_id for e in spec] == [e.token_id for e in plain] == truth
    assert spec_steps < plain_steps  # several tokens a step
    for a, b in zip(spec, plain):
        assert abs(a.logprob - b.logprob) < 1e-4 and a.top.keys() == b.top.keys()


def test_prefix_caching_with_mtp_equals_greedy_without(model):
    """Requests resume from cached pages (and snapshots taken around draft windows) and still decode exactly;
    the outputs (generated pages included) extend the prefix the next request reuses."""
    rng = random.Random(51)
    shared = [rng.randrange(2, 129000) for _ in range(40)]
    prompts = [shared + [rng.randrange(2, 129000) for _ in range(n)] for n in (3, 9, 17)]
    eng = spec_engine(model, 2, enable_prefix_caching=True, prefix_cache_snapshots=8, max_num_seqs=1)
    for i, prompt in enumerate(prompts):
        truth = reference_greedy(model, prompt, 20)
        arrivals = {0: [(f"p{i}", prompt, greedy(20))]}
        tokens, _ = run_with_drafts(eng, arrivals, {f"p{i}": truth}, 2, random.Random(i))
        assert tokens[f"p{i}"] == truth, f"request p{i}"
    stats = eng.stats()
    assert stats.prefix_cache_hit_tokens >= 2 * 32 and stats.spec_decode.num_accepted_tokens > 0
