"""Speculative decoding through the CUDA-graph path, run eagerly on the CPU: verify steps padded to k + 1 tokens a
request (requests with fewer drafts or none among them) and the MTP step through DecodeGraphs' static buffers give
the tokens and the drafts of the unpadded path, and greedy output stays the output without speculation."""

import random

import pytest
from test_engine import greedy, random_prompts, reference_greedy
from test_speculative import run_with_drafts, spec_engine
from tiny_model import load_tiny_model, use_eager_graphs

from ds4.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return load_tiny_model(with_mtp=True)


def record_drafts(eng):
    """Every step's drafts per request, as the runner returns them."""
    drafts = []
    finish = eng.runner.finish

    def recorded(launched):
        results = finish(launched)
        drafts.append({c.seq.request_id: r.draft_token_ids for c, r in zip(launched.chunks, results)})
        return results

    eng.runner.finish = recorded
    return drafts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_padded_verify_and_draft_steps_equal_the_unpadded_path(model, k):
    prompts = random_prompts(5, seed=10 + k, lo=20)
    lengths = [8 + 3 * i for i in range(len(prompts))]
    arrivals, continuations = {}, {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        arrivals.setdefault(i // 2 * 2, []).append((f"r{i}", prompt, greedy(n)))
        continuations[f"r{i}"] = reference_greedy(model, prompt, n)
    # A request with a penalty never speculates: it rides in the verify steps padded to k + 1 tokens.
    penalised = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)
    arrivals[1] = [("p", prompts[0][:7], penalised)]
    runs = []
    for graphs in (False, True):
        eng = spec_engine(model, k, max_num_batched_tokens=48, max_num_seqs=5, long_prefill_token_threshold=13)
        graph_steps = use_eager_graphs(eng, model, 4).runs if graphs else None
        drafts = record_drafts(eng)
        tokens, _ = run_with_drafts(eng, arrivals, continuations, k, random.Random(k), real_drafts={"r0", "r1"})
        runs.append((tokens, drafts, eng.stats().spec_decode))
    (tokens, drafts, stats), (padded_tokens, padded_drafts, padded_stats) = runs
    for i in range(len(prompts)):
        assert padded_tokens[f"r{i}"] == continuations[f"r{i}"], f"request r{i}"
    assert padded_tokens == tokens
    assert padded_drafts == drafts  # the MTP layer's own drafts (r0, r1) included
    assert padded_stats == stats and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(n > 0 for n in stats.accepted_per_position)
    verify_steps = [key for key in graph_steps if key.tokens_per_request == k + 1]
    assert len(verify_steps) > 5 and {key.size for key in verify_steps} >= {2, 4}
