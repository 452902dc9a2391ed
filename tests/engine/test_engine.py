"""The engine on the tiny model: continuous batching, chunked prefill and preemption change nothing.

The oracle for greedy outputs is a plain loop over the model (one request, whole prompt, then one
token at a time, fresh cache), with no scheduler, allocator or runner involved.
"""

import random

import pytest
import torch

from ds4.checkpoint.reader import load_checkpoint
from ds4.checkpoint.tiny import default_model_dir
from ds4.config import load_config
from ds4.engine.config import EngineConfig
from ds4.engine.engine import LLMEngine, RequestRejected
from ds4.engine.sampling_params import SamplingParams
from ds4.model.batch import ForwardBatch
from ds4.model.deepseek_v4 import DeepseekV4Model

PAGE = 16  # a multiple of the tiny model's ratios (4, 16)


@pytest.fixture(scope="module")
def model():
    model_dir = default_model_dir()
    cfg = load_config(model_dir)
    m = DeepseekV4Model(cfg, dtype=torch.float32)
    m.load_weights(load_checkpoint(model_dir, cfg, dtype=torch.float32, progress=False))
    return m


def one_request_batch(ids, start, pages):
    n = len(ids)
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(start, start + n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([start], dtype=torch.int32),
        slots=torch.zeros(1, dtype=torch.int32), block_tables=torch.tensor([pages], dtype=torch.int32))


def reference_greedy(model, prompt, max_tokens):
    pages = list(range(8))
    cache = model.new_cache(1, len(pages), PAGE)
    logits = model.compute_logits(model.forward(one_request_batch(prompt, 0, pages), cache)[-1:])
    out = [int(logits.argmax())]
    while len(out) < max_tokens:
        pos = len(prompt) + len(out) - 1
        logits = model.compute_logits(model.forward(one_request_batch([out[-1]], pos, pages), cache))
        out.append(int(logits.argmax()))
    return out


def engine(model, **flags):
    flags.setdefault("page_size", PAGE)
    flags.setdefault("max_model_len", 128)
    flags.setdefault("kv_cache_memory", 1 << 24)
    return LLMEngine(model, EngineConfig(**flags), seed=0)


def run(eng, arrivals):
    """arrivals: {step: [(request_id, prompt, params)]}; returns {request_id: token ids} and the finish reasons."""
    tokens, reasons, step = {}, {}, 0
    while step <= max(arrivals) or eng.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
            tokens[rid] = []
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return tokens, reasons


def random_prompts(n, seed, lo=1, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(2, 129000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("flags", [
    dict(max_num_batched_tokens=64, max_num_seqs=4, long_prefill_token_threshold=24),  # chunked prefill, mixed steps
    dict(max_num_batched_tokens=32, max_num_seqs=3, long_prefill_token_threshold=7, max_num_partial_prefills=2),
    dict(max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory=None, num_pages=12),  # forced preemption
], ids=["chunked", "odd-chunks", "preemption"])
def test_greedy_under_continuous_batching_equals_each_request_alone(model, flags):
    num_pages = flags.pop("num_pages", None)
    if num_pages is not None:
        from ds4.model.cache import bytes_per_page, bytes_per_slot
        flags["kv_cache_memory"] = (flags["max_num_seqs"] * bytes_per_slot(model.cfg, model.dtype)
                                    + num_pages * bytes_per_page(model.cfg, PAGE, model.dtype))
    eng = engine(model, **flags)
    prompts = random_prompts(7, seed=1)
    arrivals = {}
    for i, prompt in enumerate(prompts):
        arrivals.setdefault(i // 2 * 3, []).append((f"r{i}", prompt, greedy(4 + 3 * i)))
    tokens, reasons = run(eng, arrivals)
    if num_pages is not None:
        assert eng.allocator.num_pages == num_pages and eng.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == reference_greedy(model, prompt, 4 + 3 * i), f"request r{i}"
        assert reasons[f"r{i}"] == "length"
    assert eng.allocator.num_free_pages == eng.allocator.num_pages
