"""Async decode: a plain decode step launched before the previous one's tokens reach the host changes no output.

The engines here take the CUDA-graph decode path run eagerly (tiny_model.use_eager_graphs), the path on which steps
launch ahead on CUDA; the oracle is the same engine with async decode off, each step waiting for its tokens (the
engine tests check that path against a plain loop over the model).
"""

import random

import pytest
from tiny_model import load_tiny_model, use_eager_graphs

from ds4.engine.config import EngineConfig
from ds4.engine.engine import LLMEngine
from ds4.engine.sampling_params import SamplingParams

PAGE = 16


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


@pytest.fixture(scope="module")
def tokenizer():
    from ds4.tokenizer import load_tokenizer

    return load_tokenizer()


def prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, 129000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


class Recorder:
    """Counts the engine's steps launched ahead, those among them that keep a page-end snapshot, and those that ran
    a row of a request that had finished (or was aborted) by the time they were read back."""

    def __init__(self, eng):
        self.ahead = self.ahead_snapshots = self.dropped_rows = 0
        launch, finish = eng.runner.launch, eng.runner.finish

        def launched(chunks, snapshots=None, after=None):
            self.ahead += after is not None
            self.ahead_snapshots += after is not None and snapshots is not None and bool(snapshots.save_slots)
            return launch(chunks, snapshots, after)

        def finished(step):
            self.dropped_rows += sum(c.ahead and c.seq.is_finished for c in step.chunks)
            return finish(step)

        eng.runner.launch, eng.runner.finish = launched, finished


def new_engine(model, async_decode, tokenizer=None, eos=None, **flags):
    """An engine on the CUDA-graph decode path run eagerly; `eos` replaces the model's EOS token."""
    config = dict(page_size=PAGE, max_model_len=96, max_num_seqs=6, kv_cache_memory=1 << 24) | flags
    eng = LLMEngine(model, EngineConfig(async_decode=async_decode, **config), tokenizer=tokenizer, seed=0)
    use_eager_graphs(eng, model, 8)
    if eos is not None:
        eng.sampler.eos_token_ids = (eos,)
    return eng


def run_on(eng, arrivals, aborts=None):
    """arrivals: {step: [(request_id, prompt, params)]}, aborts: {request_id: abort once it has this many tokens};
    every output of each request, in order."""
    outs, step = {}, 0
    while step <= max(arrivals) or eng.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
            outs[rid] = []
        for out in eng.step():
            outs[out.request_id].append(out)
        for rid, n in (aborts or {}).items():
            if rid in eng.requests and sum(len(o.new_token_ids) for o in outs[rid]) >= n:
                assert not eng.config.async_decode or eng._ahead is not None, "the abort should land while ahead"
                eng.abort(rid)
        step += 1
    for rid, request_outs in outs.items():
        # Exactly one finished output per request, the last: nothing is emitted after a finish.
        assert [o.finished for o in request_outs] == [False] * (len(request_outs) - 1) + [True], rid
    stats, cache = eng.stats(), eng.prefix_cache
    assert stats.num_free_pages == stats.num_pages and stats.num_running == stats.num_waiting == 0
    assert eng.allocator.num_free_slots == eng.allocator.num_slots
    assert cache.num_kept_snapshots + cache.num_free_snapshots == cache.num_snapshots
    return outs


def run(model, async_decode, arrivals, tokenizer=None, aborts=None, eos=None, **flags):
    """A new engine's outputs for these arrivals (see run_on), the engine and its Recorder."""
    eng = new_engine(model, async_decode, tokenizer, eos, **flags)
    recorder = Recorder(eng)
    return eng, run_on(eng, arrivals, aborts), recorder


def summary(outs):
    """Per request: its tokens, text, finish and stop reasons."""
    return {
        rid: (
            [t for o in request_outs for t in o.new_token_ids],
            "".join(o.new_text for o in request_outs),
            request_outs[-1].finish_reason,
            request_outs[-1].stop_reason,
        )
        for rid, request_outs in outs.items()
    }


def test_async_decode_changes_no_output_whatever_ends_the_requests(model, tokenizer):
    """Greedy and seeded requests, finishing mid-batch by max_tokens, EOS and a stop string, one aborted while a
    step runs ahead, others arriving mid-decode: the same tokens, texts and reasons with async decode on and off."""
    ps = prompts(7, seed=1)
    greedy = dict(temperature=0.0, ignore_eos=True)
    seeded = dict(temperature=0.8, top_p=0.9, ignore_eos=True)
    free = {0: [("probe", ps[1], SamplingParams(max_tokens=12, **greedy))]}
    _, probe, _ = run(model, False, free, tokenizer)
    probe_tokens, probe_text, _, _ = summary(probe)["probe"]
    # The stop string: two characters either side of the end of the probe's fifth token's text.
    cut = len(tokenizer.decode(probe_tokens[:5]))
    stop = probe_text[cut - 2 : cut + 2]
    assert probe_text.find(stop) == cut - 2
    # The model's EOS: the first token the probe (and the "eos" request, same prompt) makes past its fifth.
    first = next(j for j in range(5, 12) if probe_tokens[j] not in probe_tokens[:j])
    eos = probe_tokens[first]
    arrivals = {
        0: [
            ("length", ps[0], SamplingParams(max_tokens=9, **greedy)),
            ("stop", ps[1], SamplingParams(max_tokens=20, stop=[stop], **greedy)),
            ("eos", ps[1], SamplingParams(max_tokens=20, temperature=0.0)),
            ("seeded", ps[2], SamplingParams(max_tokens=25, seed=7, **seeded)),
        ],
        5: [("late", ps[3], SamplingParams(max_tokens=14, **greedy))],
        9: [("late-seeded", ps[4], SamplingParams(max_tokens=11, seed=3, **seeded))],
        12: [("aborted", ps[5], SamplingParams(max_tokens=30, **greedy))],
    }
    aborts = {"aborted": 6}
    _, sync, _ = run(model, False, arrivals, tokenizer, aborts, eos)
    _, overlapped, recorder = run(model, True, arrivals, tokenizer, aborts, eos)
    want = summary(sync)
    assert summary(overlapped) == want
    assert want["stop"][2:] == ("stop", stop) and want["stop"][1] == probe_text[: cut - 2]
    assert want["eos"][0] == probe_tokens[: first + 1] and want["eos"][2] == "stop"
    assert want["length"][2] == want["late"][2] == "length" and want["aborted"][2] == "abort"
    assert len(want["aborted"][0]) == 6
    assert len(set(want["seeded"][0])) > 5  # really sampled
    # Steps ran ahead, and some of them ran rows of requests that had just ended (length, stop, EOS, abort).
    assert recorder.ahead >= 10 and recorder.dropped_rows >= 3


def test_decode_steps_wait_for_their_tokens_while_a_request_needs_its_history(model):
    """A request with penalties (its next token depends on its last) or logprobs keeps every decode step
    synchronous while it runs; the outputs stay those of the synchronous engine."""
    ps = prompts(3, seed=2)
    arrivals = {
        0: [
            ("plain", ps[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
            ("penalised", ps[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, presence_penalty=1)),
            ("logprobs", ps[2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)),
        ]
    }
    _, sync, _ = run(model, False, arrivals)
    _, overlapped, recorder = run(model, True, arrivals)
    assert summary(overlapped) == summary(sync)
    assert [o.new_logprobs for o in overlapped["logprobs"]] == [o.new_logprobs for o in sync["logprobs"]]
    # Only "plain" decodes alone after the others end (at 8 and 10 tokens): those steps run ahead.
    assert 0 < recorder.ahead <= 2


def test_page_end_snapshots_of_steps_launched_ahead_serve_later_requests(model):
    """Decode steps launched ahead reach page ends and keep their states (keyed once the page's last token is
    known); a later request resumes from one, with the outputs of the synchronous engine."""
    donor, fresh = prompts(2, seed=3)
    first = {0: [("donor", donor[:5], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))]}
    results = []
    for async_decode in (False, True):
        eng, outs, recorder = run(model, async_decode, first)
        conversation = donor[:5] + summary(outs)["donor"][0][:30] + fresh[:3]
        second = {0: [("turn2", conversation, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]}
        outs2 = run_on(eng, second)
        results.append((summary(outs), summary(outs2), eng.stats().prefix_cache_hit_tokens))
    assert results[1] == results[0]
    assert results[0][2] == 32  # resumed at the page end of token 32, which a decode step reached
    assert recorder.ahead_snapshots == 2  # the page ends at 16 and 32, both reached by steps launched ahead


def test_async_decode_is_on_by_default_and_off_by_flag():
    import argparse

    from ds4.engine.config import add_engine_args, engine_flags_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig().async_decode and engine_flags_from_args(parser.parse_args([]))["async_decode"] is True
    assert engine_flags_from_args(parser.parse_args(["--no-async-decode"]))["async_decode"] is False
