"""Sparse attention on CUDA at DeepSeek-V4 shapes: the Triton kernel against the torch reference, graph capture,
a bounded JIT cache.

Tolerance: q, the keys (exact in bf16 once dequantised) and the output are bf16 and the kernel rounds the
softmax weights to bf16 for the PV product, so outputs (weighted means of keys of magnitude ~1-4) agree
with the fp32 reference within 2e-2 absolute + 2e-2 relative (one to two bf16 ulps).
"""

import pytest
import torch
from attention_cases import build_case

from ds4.kernels import sparse_attention as sa
from ds4.kernels.norm_rope import EntryForm
from ds4.kernels.rope import rope_inv_freq

pytestmark = pytest.mark.gpu
FLASH = dict(heads=64, head_dim=512, window=128, topk=512, dtype=torch.bfloat16, device="cuda")


def _check(case, scale=512**-0.5):
    want = sa.sparse_attention_reference(case.q, case.key_sets, case.sink, scale, case.rope_dim)
    got = sa.sparse_attention(case.q, case.key_sets, case.sink, scale, case.rope_dim)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()


# (kind, ratio, entries a 256-token page), requests as (context, new tokens)
LAYERS = {"window": ("window", 4, 64), "csa": ("csa", 4, 64), "hca": ("hca", 128, 2)}
BATCHES = {
    "decode 1 token, contexts to 128K": [(0, 1), (127, 1), (5000, 1), (65536, 1), (131071, 1)],
    "decode 4 tokens (speculative verify)": [(126, 4), (40000, 4), (131068, 4)],
    "prefill chunk crossing window and entries": [(100, 160), (0, 37)],
    "prefill chunk at 128K": [(130000, 64)],
}


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8-cache", "bf16-cache"])
@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_flash_shapes_match_the_reference(batch, layer, fp8):
    kind, ratio, per_page = LAYERS[layer]
    _check(build_case(BATCHES[batch], kind=kind, ratio=ratio, per_page=per_page, fp8=fp8, seed=7, **FLASH))


@pytest.mark.parametrize("batch", ["decode 1 token, contexts to 128K", "prefill chunk crossing window and entries"])
def test_e4m3_decoded_from_its_bits(batch, monkeypatch):
    """The FP8 cache read as a part without e4m3 (sm_80) reads it, its e4m3 bytes decoded by the kernel, run here."""
    monkeypatch.setattr(sa, "has_fp8", lambda device: False)
    _check(build_case(BATCHES[batch], kind="csa", ratio=4, per_page=64, fp8=True, seed=9, **FLASH))


@pytest.mark.parametrize("requests", [[(3000, 1), (70, 3), (0, 20)], [(3000, 1), (70, 3)]], ids=["64+64", "8x16"])
def test_pro_heads_in_two_programs(requests):
    """Pro's 128 heads: two programs of 64 a token, or (a batch of few tokens) eight of 16."""
    case = build_case(requests, kind="csa", ratio=4, per_page=64, fp8=True, **{**FLASH, "heads": 128})
    _check(case)


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("splits", [1, 4])
def test_plans_exchanging_the_probabilities_through_memory(block_n, splits):
    """The sweep's AttentionPlan.exchange candidates at Flash shapes (the rotary queries' path, as the model runs
    it): a prefill chunk and a decode batch, its keys split or not; the same tolerance."""
    case = build_case([(100, 160), (5000, 1), (70, 3)], kind="csa", ratio=4, per_page=64, fp8=True, seed=5, **FLASH)
    positions = torch.tensor([p for c, n in [(100, 160), (5000, 1), (70, 3)] for p in range(c, c + n)]).cuda()
    form = EntryForm(None, rope_inv_freq(64, 160000.0, 16.0, 65536).cuda(), 1e-6, torch.bfloat16)
    rotary = sa.RotaryQueries(form, positions)
    q = case.q * 30
    plan = sa.AttentionPlan(64, block_n, 8, 1, exchange=True)
    want = sa.sparse_attention_reference(q, case.key_sets, case.sink, 512**-0.5, 64, rotary)
    got = sa.sparse_attention(q, case.key_sets, case.sink, 512**-0.5, 64, plan=plan, splits=splits, rotary=rotary)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("smem", [101376, 49152], ids=["99KB-sm120", "48KB"])
def test_plan_for_a_smaller_shared_memory_runs_here(smem, monkeypatch):
    """The plan a device with less shared memory per block gets (sm_120 / GB10: 99 KB), run on this one."""
    monkeypatch.setattr(sa, "shared_memory_per_block", lambda device: smem)
    monkeypatch.setattr(sa, "mma_operands_in_registers", lambda device: smem < 200 << 10)  # sm_120-like: mma.sync
    plan = sa.attention_plan(torch.device("cuda"), 64, 512)
    assert (plan.block_h + plan.block_n) * 512 * 2 <= smem and plan.block_h * 512 * 4 <= smem
    case = build_case([(3000, 1), (70, 3), (0, 40)], kind="csa", ratio=4, per_page=64, fp8=True, seed=11, **FLASH)
    want = sa.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.05, case.rope_dim)
    got = sa.sparse_attention(case.q, case.key_sets, case.sink, 0.05, case.rope_dim, plan=plan)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("requests", [[(5000, 1)], [(70, 3), (131071, 1)], [(100, 160)]], ids=["b1", "b2", "prefill"])
def test_rotary_queries_at_flash_shapes(requests):
    """The projection's q finished in the kernel and the output turned back (split or not) against norm_rope's
    reference before the attention and apply_rope's (inverse) after it (tolerance as above)."""
    case = build_case(requests, kind="csa", ratio=4, per_page=64, fp8=True, seed=3, **FLASH)
    positions = torch.cat([torch.arange(c, c + n) for c, n in requests]).cuda()
    form = EntryForm(None, rope_inv_freq(64, 160000.0, 16.0, 65536).cuda(), 1e-6, torch.bfloat16)
    rotary = sa.RotaryQueries(form, positions)
    q = case.q * 30  # the projection's scale: the norm matters
    want = sa.sparse_attention_reference(q, case.key_sets, case.sink, 512**-0.5, 64, rotary)
    got = sa.sparse_attention(q, case.key_sets, case.sink, 512**-0.5, 64, rotary=rotary)
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2), (got.float() - want.float()).abs().max()


def test_cuda_graph_replay_follows_new_indices():
    case = build_case([(900, 1)] * 8, kind="hca", ratio=128, per_page=2, fp8=True, seed=1, **FLASH)
    (ring, ring_idx), (fresh, fresh_idx), (pool, entry_idx) = case.key_sets
    out = sa.sparse_attention(case.q, case.key_sets, case.sink, 0.05, 64)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sa.sparse_attention(case.q, case.key_sets, case.sink, 0.05, 64)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for _ in range(3):
        case.q.copy_(torch.randn(case.q.shape, device="cuda", generator=gen))
        entry_idx.copy_(torch.where(torch.rand(entry_idx.shape, device="cuda", generator=gen) < 0.3, -1, entry_idx))
        graph.replay()
        eager = sa.sparse_attention(case.q, case.key_sets, case.sink, 0.05, 64)
        assert torch.equal(out, eager)


def test_two_hundred_shapes_compile_few_variants():
    kernel = sa._sparse_attention_kernel
    before = sum(len(cache[0]) for cache in kernel.device_caches.values())
    gen = torch.Generator().manual_seed(5)
    for i in range(200):
        new = 1 + (i * 7) % 23
        context = int(torch.randint(0, 3000, (1,), generator=gen))
        kind = ("window", "csa", "hca")[i % 3]
        ratio = 128 if kind == "hca" else 4
        case = build_case(
            [(context, new)] * (1 + i % 3),
            kind=kind,
            ratio=ratio,
            per_page=256 // ratio,
            fp8=i % 2 == 0,
            seed=i,
            **{**FLASH, "window": 8 + i % 120, "topk": 1 + i % 64},
        )
        out = sa.sparse_attention(case.q, case.key_sets, case.sink, 0.05, case.rope_dim)
        if i % 40 == 0:
            _check(case, 0.05)
        assert out.isfinite().all()
    after = sum(len(cache[0]) for cache in kernel.device_caches.values())
    # fp8 or bf16 pools x split or not x 16 or 64 heads a program (few tokens or more): not per shape
    assert after - before <= 8, after - before
