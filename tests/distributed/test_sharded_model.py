"""A sharded model computes what one rank computes: TP=2, TP=4 and EP=2 ranks over gloo against TP=1 on the tiny
official-format checkpoint (fp32), through a mixed prefill of two prompts, the MTP layer and decode steps on the
real caches; each rank reads only its part of the checkpoint, and the collectives move the bytes that
ds4.distributed.traffic computes from the config."""

import pytest
import torch
from spawn import run_ranks

from ds4.checkpoint.reader import ReadStats, load_checkpoint
from ds4.checkpoint.tiny import default_model_dir
from ds4.config import load_config
from ds4.distributed.parallel import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Parallel, ParallelConfig
from ds4.distributed.traffic import forward_traffic
from ds4.model.batch import ForwardBatch
from ds4.model.deepseek_v4 import DeepseekV4Model
from ds4.model.moe import Gate

PAGE, PAGES_PER_REQUEST = 32, 3
PROMPTS = (41, 23)  # past the 16-token window and several ratio-4 / ratio-16 compressed entries
DECODE_STEPS = 3


def _batch(requests, decode_only=False) -> ForwardBatch:
    """requests: (token ids of this step, tokens already cached, slot, block table row)."""
    ids = torch.cat([r[0] for r in requests])
    positions = torch.cat([torch.arange(ctx, ctx + len(t)) for t, ctx, _, _ in requests])
    counts = torch.tensor([0] + [len(r[0]) for r in requests])
    return ForwardBatch(
        ids,
        positions,
        counts.cumsum(0).to(torch.int32),
        torch.tensor([r[1] for r in requests], dtype=torch.int32),
        torch.tensor([r[2] for r in requests], dtype=torch.int32),
        torch.stack([r[3] for r in requests]).to(torch.int32),
        decode_only=decode_only,
    )


def run_model(parallel: Parallel, crowded_half: int | None = None) -> dict:
    """Logits of every step and the collectives' counters per phase, for this rank. crowded_half (0 or 1): every
    router, hash and score layers alike, sends every token to experts of that half only (as if one EP=2 rank got
    all the tokens)."""
    model_dir = default_model_dir()
    cfg = load_config(model_dir)
    stats = ReadStats()
    model = DeepseekV4Model(cfg, torch.float32, "cpu", with_mtp=True, parallel=parallel)
    model.load_weights(load_checkpoint(model_dir, cfg, with_mtp=True, progress=False, lazy=True, stats=stats))
    if crowded_half is not None:
        _crowd(model, cfg.n_routed_experts // 2, crowded_half)
    cache = model.new_cache(num_slots=3, num_pages=2 * PAGES_PER_REQUEST, page_size=PAGE)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen) for n in PROMPTS]
    tables = [torch.arange(PAGES_PER_REQUEST) + r * PAGES_PER_REQUEST for r in range(len(PROMPTS))]
    logits, counters = [], []

    def phase(rows: torch.Tensor) -> None:
        logits.append(rows)
        counters.append((dict(parallel.calls), dict(parallel.bytes_moved)))
        parallel.reset_counters()

    parallel.reset_counters()
    prefill = _batch([(p, 0, slot, tables[slot]) for slot, p in enumerate(prompts)])
    hidden = model(prefill, cache)
    phase(model.compute_logits(hidden))
    nexts = [torch.cat((p[1:], torch.tensor([7]))) for p in prompts]
    mtp_batch = _batch([(n, 0, slot, tables[slot]) for slot, n in enumerate(nexts)])
    phase(model.compute_mtp_logits(model.mtp_forward(mtp_batch, hidden, cache)))
    for step in range(DECODE_STEPS):
        tokens = torch.randint(2, cfg.vocab_size, (len(prompts), 1), generator=gen)
        decode = _batch(
            [(tokens[r], n + step, r, tables[r]) for r, n in enumerate(PROMPTS)],
            decode_only=True,
        )
        phase(model.compute_logits(model(decode, cache)))
    return {"logits": logits, "counters": counters, "read": stats.bytes_read}


def _crowd(model, half: int, which: int) -> None:
    for gate in (m for m in model.modules() if isinstance(m, Gate)):
        if gate.tid2eid is not None:
            gate.tid2eid.copy_(which * half + gate.tid2eid % half)
        else:  # the bias only chooses experts: their weights still come from the scores
            gate.bias[which * half : (which + 1) * half] += 1e3


@pytest.fixture(scope="module")
def one_rank():
    return run_model(Parallel.single())


@pytest.mark.parametrize("world, expert_parallel", [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "ep2"])
def test_sharded_model_equals_one_rank(one_rank, world, expert_parallel):
    ranks = run_ranks(run_model, world, expert_parallel=expert_parallel)
    cfg = load_config(default_model_dir())
    pc = ParallelConfig(world, expert_parallel)
    d, v = cfg.hidden_size, cfg.vocab_size
    for rank, out in enumerate(ranks):
        for phase, (got, want) in enumerate(zip(out["logits"], one_rank["logits"], strict=True)):
            # As chunked prefill against whole prefill: max error relative to the largest logit.
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= 1e-5, f"rank {rank}, phase {phase}: logits differ by {err} (relative)"
            assert torch.equal(got.argmax(-1), want.argmax(-1)), f"rank {rank}, phase {phase}: greedy tokens differ"

        # Each rank read its 1 / world of the vocabulary, heads and experts (whole experts, or the rows of every
        # expert's w1: w2's columns are read in whole MXFP4 groups of 32), and all of the rest.
        read, full = out["read"], one_rank["read"]
        assert read["head.weight"] * world == full["head.weight"]
        assert read["layers.3.attn.wq_b.weight"] * world == full["layers.3.attn.wq_b.weight"]
        assert read["layers.3.attn.wkv.weight"] == full["layers.3.attn.wkv.weight"]
        experts = [n for n in full if ".experts." in n and (expert_parallel or ".w1." in n)]
        assert sum(read.get(n, 0) for n in experts) * world == sum(full[n] for n in experts)
        assert all(n in read for n in experts) != expert_parallel

        # The counters, by hand: per forward of T tokens through L blocks, all-reduces of [T, D] fp32 activations
        # (the embedding, then attention and MoE per block) and one all-gather of [rows, V / world] fp32 logits.
        def forward(tokens, blocks, rows):
            reduces = 1 + 2 * blocks
            calls = {ALL_REDUCE: reduces, ALL_GATHER: 1, REDUCE_SCATTER: 0}
            return calls, {ALL_REDUCE: reduces * tokens * d * 4, ALL_GATHER: rows * v // world * 4, REDUCE_SCATTER: 0}

        t, b, layers = sum(PROMPTS), len(PROMPTS), cfg.num_hidden_layers
        hand = [forward(t, layers, t), forward(t, 1, t)] + [forward(b, layers, b)] * DECODE_STEPS
        assert out["counters"] == hand
        # ds4.distributed.traffic computes the same from the config.
        main, both = forward_traffic(cfg, pc, t, t, 4), forward_traffic(cfg, pc, t, t, 4, mtp=True)
        assert (main.calls, main.payload) == hand[0]
        assert {k: both.payload[k] - main.payload[k] for k in main.payload} == hand[1][1]
        step = forward_traffic(cfg, pc, b, b, 4)
        assert (step.calls, step.payload) == hand[2]


@pytest.mark.parametrize("crowded_half", [0, 1])
def test_expert_parallel_with_every_token_on_one_rank_equals_one_rank(one_rank, crowded_half):
    """Uneven loads: every token's experts are on one EP rank, the other computes none of its own."""
    want = run_model(Parallel.single(), crowded_half)["logits"]
    assert not torch.allclose(want[0], one_rank["logits"][0])  # the routing did change
    for rank, out in enumerate(run_ranks(run_model, 2, crowded_half, expert_parallel=True)):
        for phase, (got, ref) in enumerate(zip(out["logits"], want, strict=True)):
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            assert err <= 1e-5, f"rank {rank}, phase {phase}: logits differ by {err} (relative)"
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"rank {rank}, phase {phase}: greedy tokens differ"
