"""The scheduler as a specification: budgets, limits, fairness counted in steps, preemption, page accounting.

A fake runner stands in for the model: running a chunk advances the computed tokens, and a chunk that
reaches the end of the known tokens "samples" token 7.
"""

import random

import pytest

from ds4.engine.config import EngineConfig
from ds4.engine.page_allocator import PageAllocator
from ds4.engine.sampler import Sampler
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.scheduler import RequestRejected, Scheduler
from ds4.engine.sequence import Sequence, SequenceStatus

SAMPLER = Sampler(eos_token_ids=(1,), seed=0)


def make(num_pages=1000, page_size=16, max_model_len=4096, **flags):
    config = EngineConfig(**flags)
    alloc = PageAllocator(num_pages=num_pages, num_slots=config.max_num_seqs, page_size=page_size)
    return Scheduler(config, alloc, max_model_len)


def request(sched, prompt_len, max_tokens=4, name=None):
    prompt, params = [3] * prompt_len, SamplingParams(max_tokens=max_tokens)
    seq = Sequence(name or f"r{random.random()}", prompt, params, SAMPLER.new_request(params, prompt))
    sched.add(seq)
    return seq


def step(sched):
    """Schedule and fake-run one step; return the scheduler output."""
    out = sched.schedule()
    check_invariants(sched, out)
    for chunk in out.chunks:
        seq = chunk.seq
        assert chunk.start == seq.num_computed_tokens
        seq.num_computed_tokens += chunk.num_tokens
        if chunk.samples:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= sched.max_model_len:
                sched.finish(seq, "length")
    return out


def check_invariants(sched, out):
    cfg, alloc = sched.config, sched.allocator
    assert out.num_tokens <= cfg.max_num_batched_tokens
    prefills = [c for c in out.chunks if not (c.num_tokens == 1 and c.start > 0 and c.samples)]
    assert len(prefills) <= cfg.max_num_partial_prefills
    assert len({id(c.seq) for c in out.chunks}) == len(out.chunks)
    assert len(sched.running) <= cfg.max_num_seqs
    held = [p for s in sched.running for p in s.page_table]
    assert len(held) == len(set(held)) and len(held) + alloc.num_free_pages == alloc.num_pages
    assert len({s.slot for s in sched.running}) == len(sched.running)
    assert alloc.num_free_slots + len(sched.running) == alloc.num_slots
    for c in out.chunks:
        assert c.seq.status is SequenceStatus.RUNNING
        assert len(c.seq.page_table) * alloc.page_size >= c.start + c.num_tokens
    for s in sched.waiting:
        assert s.page_table == [] and s.slot is None and s.num_computed_tokens == 0


def test_decodes_first_then_prefill_chunks_within_the_budget():
    sched = make(max_num_batched_tokens=64, max_num_seqs=8, long_prefill_token_threshold=32)
    decoders = [request(sched, 5, max_tokens=100) for _ in range(3)]
    step(sched)
    assert all(s.output_token_ids for s in decoders)
    long = request(sched, 1000)
    out = step(sched)
    assert [c.seq for c in out.chunks[:3]] == decoders and all(c.num_tokens == 1 for c in out.chunks[:3])
    assert out.chunks[3].seq is long and out.chunks[3].num_tokens == 32  # chunk capped by the threshold
    assert not out.chunks[3].samples


def test_max_long_partial_prefills_lets_only_that_many_long_prompts_prefill_per_step():
    sched = make(
        max_num_batched_tokens=256,
        max_num_seqs=8,
        long_prefill_token_threshold=32,
        max_num_partial_prefills=4,
        max_long_partial_prefills=1,
    )
    a, b = request(sched, 500), request(sched, 500)
    for _ in range(5):
        out = step(sched)
        assert [c.seq for c in out.chunks] == [a]
    assert b.num_computed_tokens == 0


def test_max_num_partial_prefills_caps_prompts_per_step():
    sched = make(
        max_num_batched_tokens=256,
        max_num_seqs=8,
        long_prefill_token_threshold=32,
        max_num_partial_prefills=2,
        max_long_partial_prefills=1,
    )
    shorts = [request(sched, 10, max_tokens=50) for _ in range(6)]
    out = step(sched)
    assert [c.seq for c in out.chunks] == shorts[:2]
    out = step(sched)
    assert [c.seq for c in out.chunks] == shorts[:4]  # two decodes, then the next two prompts


@pytest.mark.parametrize("seed", range(8))
def test_fairness_short_request_gets_its_first_token_in_the_step_after_it_arrives(seed):
    """The bound stated in scheduler.py: 1 step, whatever long prompts are prefilling."""
    rng = random.Random(seed)
    budget = rng.choice([128, 256, 512])
    threshold = rng.choice([16, 64, budget // 2, budget])
    partial = rng.randint(1, 4)
    sched = make(
        num_pages=4000,
        max_model_len=40000,
        max_num_batched_tokens=budget,
        max_num_seqs=16,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=partial,
        max_long_partial_prefills=rng.randint(1, partial),
    )
    longs = [request(sched, rng.randint(5000, 20000), max_tokens=3) for _ in range(rng.randint(1, 3))]
    for _ in range(rng.randint(0, 6)):
        request(sched, rng.randint(1, threshold), max_tokens=rng.randint(1, 200))
    for _ in range(rng.randint(1, 10)):
        step(sched)
    for _ in range(5):
        for _ in range(rng.randint(0, 5)):
            step(sched)
        assert any(s.num_computed_tokens < s.num_prompt_tokens for s in longs)
        n_decoding = sum(1 for s in sched.running if s.num_uncomputed_tokens == 1)
        short = request(sched, rng.randint(1, min(threshold, budget - n_decoding)), max_tokens=2)
        step(sched)
        assert short.output_token_ids, "short request not finished prefilling in the step after it arrived"


def test_without_short_first_ordering_the_short_request_would_wait():
    """The fairness test can fail: with the threshold above the prompt, the 'long' prompt is short too and
    goes first by arrival, so a later short request waits behind it."""
    sched = make(
        num_pages=4000,
        max_model_len=40000,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        long_prefill_token_threshold=20000,
        max_num_partial_prefills=1,
        max_long_partial_prefills=1,
    )
    request(sched, 10000)
    step(sched)
    short = request(sched, 8)
    steps = 0
    while not short.output_token_ids:
        step(sched)
        steps += 1
    assert steps > 30


def test_preemption_takes_the_newest_request_and_it_resumes_from_zero():
    sched = make(num_pages=6, page_size=4, max_model_len=24, max_num_batched_tokens=64, max_num_seqs=3)
    seqs = [request(sched, 6, max_tokens=12, name=f"r{i}") for i in range(3)]
    step(sched)  # each prompt takes 2 pages: all 6 used
    assert sched.allocator.num_free_pages == 0
    out = step(sched)  # r0..r2 decode position 6 within their second page
    assert out.preempted == []
    step(sched)
    out = step(sched)  # position 8 needs a third page for r0: the newest (r2) goes
    assert out.preempted == [seqs[2]] and seqs[2].status is SequenceStatus.WAITING
    assert seqs[2].num_computed_tokens == 0 and seqs[2].page_table == [] and seqs[2].slot is None
    assert len(seqs[2].output_token_ids) == 3 and sched.num_preemptions == 1
    restarts = []
    while sched.num_unfinished:
        out = step(sched)
        restarts += [c for c in out.chunks if c.seq is seqs[2] and c.start == 0]
    assert [c.num_tokens for c in restarts] == [6 + 3]  # the prompt and the 3 kept tokens, recomputed at once
    assert all(len(s.output_token_ids) == 12 for s in seqs)
    assert sched.allocator.num_free_pages == 6


def test_a_cache_that_cannot_hold_max_model_len_is_refused():
    # A prompt of max_model_len tokens is refused by the engine (test_engine, test_async_engine).
    with pytest.raises(RequestRejected, match="cache holds"):
        make(num_pages=5, page_size=16, max_model_len=100)


def test_requests_reaching_max_model_len_stop_and_everything_finishes_under_a_tiny_cache():
    sched = make(
        num_pages=8,
        page_size=4,
        max_model_len=32,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        long_prefill_token_threshold=8,
    )
    seqs = [request(sched, random.Random(i).randint(1, 31), max_tokens=1000) for i in range(12)]
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        step(sched)
    assert sched.num_unfinished == 0 and sched.num_preemptions > 0
    assert all(s.num_tokens == 32 for s in seqs)
    assert sched.allocator.num_free_pages == 8 and sched.allocator.num_free_slots == 4


def test_thousand_random_requests_with_aborts_leave_every_page_free():
    rng = random.Random(0)
    sched = make(
        num_pages=64,
        page_size=8,
        max_model_len=256,
        max_num_batched_tokens=96,
        max_num_seqs=12,
        long_prefill_token_threshold=24,
        max_num_partial_prefills=3,
        max_long_partial_prefills=1,
    )
    pending = [(rng.randint(1, 200), rng.randint(1, 40)) for _ in range(1000)]
    live, aborted, finished = [], 0, 0
    while pending or sched.num_unfinished:
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt_len, max_tokens = pending.pop()
                live.append(request(sched, prompt_len, max_tokens=max_tokens))
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            if not victim.is_finished:
                sched.finish(victim, "abort")
                aborted += 1
        step(sched)
        finished += sum(1 for s in live if s.is_finished)
        live = [s for s in live if not s.is_finished]
    assert aborted > 50 and sched.num_preemptions > 0
    assert sched.allocator.num_free_pages == 64 and sched.allocator.num_free_slots == 12
