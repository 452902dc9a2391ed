"""The engine's CUDA-graph decode path, run eagerly on the CPU: padded decode_only batches through DecodeGraphs'
static buffers give each request the tokens it gets alone (a plain loop over the model, no engine), and the
graph keys a step picks."""

import random

import pytest
import torch
from tiny_model import load_tiny_model, use_eager_graphs

from ds4.engine.config import EngineConfig
from ds4.engine.cuda_graphs import DecodeGraphs, GraphKey
from ds4.engine.engine import LLMEngine
from ds4.engine.sampling_params import SamplingParams
from ds4.engine.speculative import MTPDrafter
from ds4.model.batch import ForwardBatch

PAGE = 16


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def alone(model, prompt, max_tokens):
    """Whole prompt, then one token at a time through the general path, fresh cache."""
    cache = model.new_cache(1, 8, PAGE)

    def batch(ids, start):
        i32 = dict(dtype=torch.int32)
        return ForwardBatch(
            torch.tensor(ids),
            torch.arange(start, start + len(ids)),
            torch.tensor([0, len(ids)], **i32),
            torch.tensor([start], **i32),
            torch.zeros(1, **i32),
            torch.arange(8, **i32)[None],
        )

    out = [int(model.compute_logits(model.forward(batch(prompt, 0), cache)[-1:]).argmax())]
    while len(out) < max_tokens:
        out.append(
            int(model.compute_logits(model.forward(batch(out[-1:], len(prompt) + len(out) - 1), cache)).argmax())
        )
    return out


def test_padded_decode_batches_equal_each_request_alone(model):
    eng = LLMEngine(
        model,
        EngineConfig(
            page_size=PAGE,
            max_model_len=128,
            max_num_seqs=5,
            max_num_batched_tokens=48,
            long_prefill_token_threshold=16,
            kv_cache_memory=1 << 24,
        ),
    )
    graphs = use_eager_graphs(eng, model, 4)
    assert graphs.sizes == [1, 2, 4] and graphs.page_buckets == [1, 4, 8]

    rng = random.Random(3)
    # Short and long prompts, so that steps need block tables of 1, up to 4 and up to 8 pages.
    prompts = [[rng.randrange(2, model.cfg.vocab_size) for _ in range(n)] for n in (3, 9, 70, 12, 30, 5, 40)]
    lens = [3 + 3 * i for i in range(7)]
    tokens, pending, step = {}, list(enumerate(prompts)), 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, p = pending.pop(0)
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=lens[i], ignore_eos=True))
            tokens[f"r{i}"] = []
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == alone(model, prompt, lens[i]), f"request r{i}"
    # Decode steps of 5 requests do not fit the largest size (4) and ran unpadded; the others were padded,
    # with block tables widened to a page bucket.
    sizes, buckets = {key.size for key in graphs.runs}, {key.pages for key in graphs.runs}
    assert len(graphs.runs) > 10 and sizes == {1, 2, 4} and buckets == {1, 4, 8}
    assert {key.tokens_per_request for key in graphs.runs} == {1}


def test_a_step_replays_the_smallest_graph_that_holds_it():
    drafter = MTPDrafter(None, None, 3)  # only its k is read here
    graphs = DecodeGraphs(None, None, 20, 40, 0, torch.device("cpu"), drafter=drafter, capture=False)
    assert graphs.sizes == [1, 2, 4, 8, 16, 20] and graphs.page_buckets == [1, 4, 16, 40]
    assert graphs.keys[0] == GraphKey(4, 20, 40) and len(graphs.keys) == 2 * 6 * 4  # captured largest first
    assert graphs.key([1, 1, 1], 3) == GraphKey(1, 4, 4)
    assert graphs.key([1, 4, 2], 5) == GraphKey(4, 4, 16)  # a verification: every request padded to k + 1
    assert graphs.key([2], 1) == GraphKey(4, 1, 1)
    assert graphs.key([5], 1) is None  # longer than k + 1 (a prefill chunk): eager
    assert graphs.key([1] * 21, 1) is None and graphs.key([1], 41) is None
    plain = DecodeGraphs(None, None, 20, 40, 0, torch.device("cpu"), capture=False)
    assert plain.key([2], 1) is None and plain.key([1], 1) == GraphKey(1, 1, 1)
