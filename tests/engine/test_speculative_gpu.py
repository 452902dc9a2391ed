"""Speculative decoding on CUDA with graphs: replayed verify and MTP steps equal the same padded steps run eagerly
(which never sync with the host), and greedy output with MTP equals greedy output without it (up to a near tie:
verify steps run k + 1 tokens a request through batch-shaped kernels, see test_engine_gpu)."""

import random

import pytest
import torch
from test_engine_gpu import random_prompts, reference_greedy
from test_speculative import run_with_drafts
from tiny_model import load_tiny_model

from ds4.engine.config import EngineConfig
from ds4.engine.cuda_graphs import DecodeGraphs
from ds4.engine.engine import LLMEngine
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.speculative import MTPDrafter
from ds4.model.batch import ForwardBatch

pytestmark = pytest.mark.gpu
PAGE = 16


@pytest.fixture(scope="module")
def model():
    return load_tiny_model("cuda", with_mtp=True)


def _prefill(model, cache, prompts, tables):
    for r, prompt in enumerate(prompts):
        n, i32 = len(prompt), dict(dtype=torch.int32, device="cuda")
        model.forward(
            ForwardBatch(
                torch.tensor(prompt, device="cuda"),
                torch.arange(n, device="cuda"),
                torch.tensor([0, n], **i32),
                torch.zeros(1, **i32),
                torch.tensor([r], **i32),
                torch.tensor([tables[r]], **i32),
            ),
            cache,
        )


@pytest.mark.parametrize("k", [1, 2, 3])
def test_verify_and_draft_graphs_replay_the_eager_steps(model, k):
    """Two requests (slot 2: the scratch slot) verify 0..k drafts a step, keep a random prefix; the captured graphs
    give the streams and drafts the same padded steps give eagerly, under sync debug mode "error"."""
    gen = torch.Generator().manual_seed(k)
    vocab = model.cfg.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (37, 20)]
    tables = [[3, 0, 5, 1], [2, 6, 4, 7]]
    runs = []
    for capture in (False, True):
        cache = model.new_cache(3, 8, PAGE, spare=k)
        _prefill(model, cache, prompts, tables)
        drafter = MTPDrafter(model, cache, k)
        runs.append(DecodeGraphs(model, cache, 2, 4, 2, torch.device("cuda"), drafter=drafter, capture=capture))
    eager, graphs = runs
    rng = random.Random(k)
    context, last = [len(p) - 1 for p in prompts], [p[-1] for p in prompts]
    n = k + 1
    for step in range(6):
        drafts = [[rng.randrange(vocab) for _ in range((step + r) % n)] for r in range(2)]
        ids, positions = [], []
        for r in range(2):
            ids += [last[r]] + drafts[r] + [0] * (k - len(drafts[r]))
            positions += range(context[r], context[r] + n)
        key = graphs.key([1 + len(d) for d in drafts], 4)
        kept = [drafts[r][: rng.randint(0, len(drafts[r]))] + [rng.randrange(vocab)] for r in range(2)]
        next_ids = [0] * (2 * n)
        for r in range(2):
            next_ids[r * n : r * n + len(kept[r])] = kept[r]
        last_rows = [r * n + len(kept[r]) - 1 for r in range(2)]
        batch = (key, ids, positions, context, [0, 1], [p for table in tables for p in table])
        torch.cuda.set_sync_debug_mode("error")
        try:
            expected = [out.clone() for out in eager.run(eager.inputs.load(*batch), key)]
            expected_drafts = eager.draft(next_ids, last_rows, key).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for got, want in zip(graphs.run(graphs.inputs.load(*batch), key), expected):  # streams, logits
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), f"step {step}"
        assert torch.equal(graphs.draft(next_ids, last_rows, key), expected_drafts), f"step {step}"
        for r in range(2):
            context[r] += len(kept[r])
            last[r] = kept[r][-1]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_mtp_and_graphs_equals_greedy_without(model, k):
    flags = dict(page_size=PAGE, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=48)
    flags.update(long_prefill_token_threshold=13, kv_cache_memory=1 << 26)
    eng = LLMEngine(model, EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": k}, **flags))
    keys = []
    run = eng.runner.graphs.run

    def recorded(batch, key):
        keys.append(key)
        return run(batch, key)

    eng.runner.graphs.run = recorded
    prompts = random_prompts(5, seed=k)
    lengths = [6 + 4 * i for i in range(len(prompts))]
    arrivals, continuations = {}, {}
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        greedy = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        arrivals.setdefault(i // 2 * 2, []).append((f"r{i}", prompt, greedy))
        continuations[f"r{i}"] = reference_greedy(model, prompt, n)
    # r0 and r1 keep the MTP layer's drafts; the others get their continuation with tokens corrupted.
    tokens, _ = run_with_drafts(eng, arrivals, continuations, k, random.Random(k), real_drafts={"r0", "r1"})
    for i in range(len(prompts)):  # equal up to a near tie (see test_engine_gpu)
        assert continuations[f"r{i}"].disagreement(tokens[f"r{i}"]) is None, f"request r{i}"
    stats = eng.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(key.tokens_per_request == k + 1 for key in keys) > 5
    assert eng.allocator.num_free_pages == eng.allocator.num_pages
