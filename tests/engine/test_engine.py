"""The engine on the tiny model: continuous batching, chunked prefill and preemption change nothing.

The oracle for greedy outputs is a plain loop over the model (one request, whole prompt, then one
token at a time, fresh cache), with no scheduler, allocator or runner involved.
"""

import random

import pytest
import torch
from tiny_model import load_tiny_model

from ds4.engine.config import EngineConfig
from ds4.engine.engine import LLMEngine, RequestRejected
from ds4.engine.sampling_params import SamplingParams
from ds4.model.batch import ForwardBatch

PAGE = 16  # a multiple of the tiny model's ratios (4, 16)


@pytest.fixture(scope="module")
def model():
    return load_tiny_model()


def one_request_batch(ids, start, pages):
    n = len(ids)
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(start, start + n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([start], dtype=torch.int32),
        slots=torch.zeros(1, dtype=torch.int32),
        block_tables=torch.tensor([pages], dtype=torch.int32),
    )


def reference_decode(model, prompt, max_tokens, choose=lambda logits, out: int(logits.argmax()), stop=()):
    """Whole prompt, then one token at a time: (tokens, raw logits [n, vocab] each token was chosen from)."""
    pages = list(range(8))
    cache = model.new_cache(1, len(pages), PAGE)
    logits = model.compute_logits(model.forward(one_request_batch(prompt, 0, pages), cache)[-1:])[0]
    out, seen = [], []
    while True:
        seen.append(logits)
        out.append(choose(logits.clone(), out))
        if len(out) == max_tokens or out[-1] in stop:
            return out, torch.stack(seen)
        pos = len(prompt) + len(out) - 1
        logits = model.compute_logits(model.forward(one_request_batch([out[-1]], pos, pages), cache))[0]


def reference_greedy(model, prompt, max_tokens):
    return reference_decode(model, prompt, max_tokens)[0]


def engine(model, **flags):
    flags.setdefault("page_size", PAGE)
    flags.setdefault("max_model_len", 128)
    flags.setdefault("max_num_seqs", 4)
    flags.setdefault("kv_cache_memory", 1 << 24)
    return LLMEngine(model, EngineConfig(**flags), seed=0)


def run(eng, arrivals, after_step=None):
    """arrivals: {step: [(request_id, prompt, params)]}; returns {request_id: token ids} and the finish reasons.
    after_step(tokens so far), if given, runs after every step."""
    tokens, reasons, step = {}, {}, 0
    while step <= max(arrivals) or eng.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            eng.add_request(rid, prompt, params)
            tokens[rid] = []
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if after_step is not None:
            after_step(tokens)
        step += 1
    return tokens, reasons


def random_prompts(n, seed, lo=1, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(2, 129000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize(
    "flags",
    [
        dict(
            max_num_batched_tokens=64, max_num_seqs=4, long_prefill_token_threshold=24
        ),  # chunked prefill, mixed steps
        dict(max_num_batched_tokens=32, max_num_seqs=3, long_prefill_token_threshold=7, max_num_partial_prefills=2),
        dict(max_num_batched_tokens=64, max_num_seqs=4, kv_cache_memory=None, num_pages=12),  # forced preemption
    ],
    ids=["chunked", "odd-chunks", "preemption"],
)
def test_greedy_under_continuous_batching_equals_each_request_alone(model, flags):
    num_pages = flags.pop("num_pages", None)
    if num_pages is not None:
        from ds4.model.cache import SCRATCH_PAGES, bytes_per_page, bytes_per_slot, bytes_per_snapshot

        flags["prefix_cache_snapshots"] = 4
        flags["kv_cache_memory"] = (
            flags["max_num_seqs"] * bytes_per_slot(model.cfg, model.dtype)
            + 4 * bytes_per_snapshot(model.cfg, model.dtype)
            + (num_pages + SCRATCH_PAGES) * bytes_per_page(model.cfg, PAGE, model.dtype)
        )
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


def collect(eng, requests, arrive_every=1):
    """Add (request_id, prompt, params) one per `arrive_every` steps; return {id: [RequestOutput...]}."""
    outs, pending, step = {}, list(requests), 0
    while pending or eng.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            rid, prompt, params = pending.pop(0)
            eng.add_request(rid, prompt, params)
            outs[rid] = []
        for out in eng.step():
            outs[out.request_id].append(out)
        step += 1
    return outs


def token_ids(outs):
    return [t for o in outs for t in o.new_token_ids]


def test_seeded_sampling_is_the_same_alone_and_among_other_requests(model):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = random_prompts(1, seed=5)[0]
    alone = collect(engine(model, max_num_seqs=4, max_num_batched_tokens=64), [("x", prompt, params)])
    companions = [
        (f"c{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=9, ignore_eos=True))
        for i, p in enumerate(random_prompts(4, seed=6))
    ]
    crowd = companions[:2] + [("x", prompt, params)] + companions[2:]
    crowded = collect(engine(model, max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=9), crowd)
    assert token_ids(crowded["x"]) == token_ids(alone["x"])
    assert len(set(token_ids(alone["x"]))) > 3  # really sampled, not a constant


def test_stop_string_spanning_tokens_ends_the_text_before_it(model):
    from ds4.tokenizer import load_tokenizer

    tok = load_tokenizer()
    prompt = random_prompts(1, seed=8, lo=10, hi=20)[0]
    ref = reference_greedy(model, prompt, 12)
    pieces = [tok.decode(ref[:i]) for i in range(len(ref) + 1)]
    # A stop string made of the last 2 characters of token 5's text and the first 2 of token 6's.
    cut = len(pieces[6])
    stop = pieces[-1][cut - 2 : cut + 2]
    assert len(stop) == 4 and pieces[-1].find(stop) == cut - 2
    eng = LLMEngine(
        model, EngineConfig(page_size=PAGE, max_model_len=128, max_num_seqs=4, kv_cache_memory=1 << 24), tokenizer=tok
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True)
    outs = collect(eng, [("s", prompt, params)])["s"]
    text = "".join(o.new_text for o in outs)
    assert text == pieces[-1][: cut - 2]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert token_ids(outs) == ref[:7]


def test_min_tokens_holds_back_stop_tokens_then_stops_on_one(model):
    prompt = random_prompts(1, seed=9)[0]
    free = reference_greedy(model, prompt, 6)
    stop_id = free[1]
    eos = model.cfg.eos_token_id

    def masked(logits, out):
        if len(out) < 4:
            logits[[stop_id, eos]] = float("-inf")
        return int(logits.argmax())

    expected, _ = reference_decode(model, prompt, 20, masked, stop=(stop_id,))
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=4, stop_token_ids=[stop_id])
    outs = collect(engine(model), [("m", prompt, params)])["m"]
    assert token_ids(outs) == expected and expected[1] != stop_id
    assert outs[-1].finish_reason == ("stop" if expected[-1] == stop_id else "length")


def test_penalties_and_logprobs_match_plain_torch(model):
    rep, freq, pres = 1.3, 0.5, 0.25
    base = random_prompts(1, seed=10, lo=20, hi=30)[0]
    cont = reference_greedy(model, base, 10)
    # The model mostly follows its recent context: after this prompt it wants cont[6] again, a prompt token.
    prompt = base + cont + base[-10:] + cont[:6]

    def penalised(logits, out):
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        seen = counts > 0
        seen[torch.tensor(prompt)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return int((logits - freq * counts - pres * (counts > 0).float()).argmax())

    expected, raw = reference_decode(model, prompt, 10, penalised)
    assert expected != reference_greedy(model, prompt, 10)  # the penalties change the outcome
    params = SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        logprobs=3,
    )
    outs = collect(
        engine(model),
        [("p", prompt, params)] + [(f"o{i}", p, greedy(5)) for i, p in enumerate(random_prompts(3, seed=11))],
    )
    assert token_ids(outs["p"]) == expected
    logprobs = torch.log_softmax(raw, dim=-1)
    for i, entry in enumerate(lp for o in outs["p"] for lp in o.new_logprobs):
        assert entry.token_id == expected[i]
        assert entry.logprob == pytest.approx(float(logprobs[i, expected[i]]), abs=1e-4)
        top = logprobs[i].topk(3)
        assert list(entry.top) == top.indices.tolist()
        assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_prompt_logprobs_survive_chunking_and_preemption(model):
    from ds4.model.cache import SCRATCH_PAGES, bytes_per_page, bytes_per_slot, bytes_per_snapshot

    prompt = random_prompts(1, seed=12, lo=40, hi=50)[0]
    cache = model.new_cache(1, 8, PAGE)
    full = model.compute_logits(model.forward(one_request_batch(prompt, 0, list(range(8))), cache))
    expected = torch.log_softmax(full[:-1], dim=-1)
    memory = (
        3 * bytes_per_slot(model.cfg, model.dtype)
        + 2 * bytes_per_snapshot(model.cfg, model.dtype)
        + (6 + SCRATCH_PAGES) * bytes_per_page(model.cfg, PAGE, model.dtype)
    )
    eng = engine(
        model,
        prefix_cache_snapshots=2,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        kv_cache_memory=memory,
        max_model_len=96,
    )
    others = [(f"o{i}", p, greedy(30)) for i, p in enumerate(random_prompts(2, seed=13, lo=10, hi=20))]
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2, ignore_eos=True)
    outs = collect(eng, others + [("q", prompt, params)])
    assert eng.stats().num_preemptions > 0
    plp = outs["q"][0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs["q"][1:])
    assert len(plp) == len(prompt) and plp[0] is None
    for p, entry in enumerate(plp[1:]):
        assert entry.token_id == prompt[p + 1]
        assert entry.logprob == pytest.approx(float(expected[p, prompt[p + 1]]), abs=1e-4)
        assert list(entry.top) == expected[p].topk(2).indices.tolist()


def test_abort_frees_pages_and_leaves_the_others_unchanged(model):
    eng = engine(model, max_num_seqs=4)
    prompts = random_prompts(3, seed=14)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, greedy(10))
    tokens = {f"r{i}": [] for i in range(3)}
    finished = {}
    for step in range(40):
        if step == 3:
            eng.abort("r1")
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
        if not eng.has_unfinished_requests():
            break
    assert finished == {"r0": "length", "r1": "abort", "r2": "length"}
    assert len(tokens["r1"]) < 10
    assert tokens["r0"] == reference_greedy(model, prompts[0], 10)
    assert tokens["r2"] == reference_greedy(model, prompts[2], 10)
    stats = eng.stats()
    assert stats.num_free_pages == stats.num_pages and stats.num_running == stats.num_waiting == 0


def test_requests_are_rejected_or_cut_at_max_model_len(model):
    eng = engine(model, max_model_len=40)
    with pytest.raises(RequestRejected, match="max_model_len"):
        eng.add_request("big", [5] * 40, greedy(4))
    outs = collect(eng, [("edge", [5] * 30, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))])
    assert len(token_ids(outs["edge"])) == 10 and outs["edge"][-1].finish_reason == "length"
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [5], greedy(1))
        eng.add_request("x", [5], greedy(1))
