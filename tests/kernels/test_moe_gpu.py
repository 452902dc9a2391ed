"""Routed experts on the GPU at Flash sizes (256 MXFP4 experts x 2048, hidden 4096, top-6) against an
expert-by-expert oracle (quant.py's dequantisation, fp8_kv's e4m3 rounding); graph replay equals eager. The
router's logits and routing kernels against the CPU path; the whole layer under graph replay."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import ds4.kernels.moe as moe
import ds4.kernels.moe_routing as routing_module
from ds4.bench.moe import FLASH_CONFIG, moe_layer
from ds4.checkpoint.quant import mxfp4_dequantize
from ds4.config import load_config
from ds4.kernels.fp8_kv import fp8_quant_dequant
from ds4.model.moe import expert_weights

pytestmark = pytest.mark.gpu

E, D, INTER, K, LIMIT = 256, 4096, 2048, 6, 10.0


def flash_experts(seed: int = 0) -> moe.ExpertWeights:
    """Random stored-form experts: any byte is two valid e2m1 codes; scales 2^-9 .. 2^-6."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * INTER, D // 2), device="cuda", generator=g, dtype=torch.uint8)
    s13 = torch.randint(118, 122, (E, 2 * INTER, D // 32), device="cuda", generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, D, INTER // 2), device="cuda", generator=g, dtype=torch.uint8)
    s2 = torch.randint(118, 122, (E, D, INTER // 32), device="cuda", generator=g, dtype=torch.uint8)
    return moe.ExpertWeights(w13[:, :INTER], w13[:, INTER:], w2, s13[:, :INTER], s13[:, INTER:], s2)


@pytest.fixture(scope="module")
def experts():
    return flash_experts()


def oracle(x, weights, indices, experts: moe.ExpertWeights):
    """The official MoE loop: expert by expert, fp32 products of the dequantised operands, bf16 outputs."""

    def deq(name, e):
        w = getattr(experts, name)[e].contiguous().view(torch.int8)
        return mxfp4_dequantize(
            w, getattr(experts, name + "_scale")[e].contiguous().view(torch.float8_e8m0fnu), torch.float32
        )

    y = torch.zeros(x.shape[0], D, device="cuda")
    for e in indices.unique().tolist():
        token, slot = (indices == e).nonzero(as_tuple=True)
        a = fp8_quant_dequant(x[token].float(), 128)
        gate = (a @ deq("gate", e).T).bfloat16().float().clamp(max=LIMIT)
        up = (a @ deq("up", e).T).bfloat16().float().clamp(-LIMIT, LIMIT)
        h = (torch.nn.functional.silu(gate) * up * weights[token, slot, None]).bfloat16().float()
        out = (fp8_quant_dequant(h, 128) @ deq("down", e).T).bfloat16().float()
        y.index_put_((token,), out, accumulate=True)
    return y


def routing(tokens: int, seed: int, hashed: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if hashed:  # a tid2eid-like table: rows may repeat an expert
        indices = torch.randint(0, E, (tokens, K), device="cuda", generator=g)
        indices[0] = 17
    else:
        scores = torch.randn(tokens, E, device="cuda", generator=g)
        scores[:, :3] += 2.0  # uneven loads: experts 0-2 take most tokens
        indices = scores.topk(K, dim=-1).indices
    weights = torch.rand(tokens, K, device="cuda", generator=g) + 0.1
    x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
    return x, weights, indices


def assert_close(got, want):
    err = (got - want).abs()
    assert err.max() <= 1e-2 * want.abs().max(), (err.max(), want.abs().max())
    assert err.mean() <= 2e-3 * want.abs().mean(), (err.mean(), want.abs().mean())


@triton.jit
def _decode_kernel(words_ptr, scale_ptr, out_ptr, ROWS: tl.constexpr, BK: tl.constexpr):
    r = tl.arange(0, ROWS)
    words = tl.load(words_ptr + r[:, None] * (BK // 8) + tl.arange(0, BK // 8)[None, :])
    scale = tl.load(scale_ptr + r[:, None] * (BK // 32) + tl.arange(0, BK // 32)[None, :])
    w = moe._e2m1_tile(words, scale, BK, True)
    tl.store(out_ptr + r[:, None] * BK + tl.arange(0, BK)[None, :], w.to(tl.float32))


@pytest.mark.parametrize("bk", [64, 256])
def test_e2m1_tile_decodes_every_code_in_the_mma_column_order(bk):
    """Every byte value (both nibbles: all 16 codes, the subnormal 0.5 among them) with scale bytes 0 .. 128;
    column c of a decoded K step is stored column mma_columns(bk)[c] (as the interpreter shows on the CPU)."""
    rows = 64
    packed = torch.arange(rows * bk // 2, device="cuda").remainder(256).to(torch.uint8).view(rows, bk // 2)
    scale = torch.randint(0, 129, (rows, bk // 32), device="cuda", dtype=torch.uint8)
    scale[0, 0], scale[1, 0] = 0, 128
    got = torch.empty(rows, bk, device="cuda")
    _decode_kernel[(1,)](packed.view(torch.int32), scale, got, ROWS=rows, BK=bk)
    want = mxfp4_dequantize(packed.view(torch.int8), scale.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(got, want[:, moe.mma_columns(bk).cuda()])


@pytest.mark.parametrize("tokens", [1, 8, 64, 1024, 8192])
def test_flash_sizes_match_the_oracle(experts, tokens):
    x, weights, indices = routing(tokens, tokens)
    assert_close(moe.routed_experts(x, weights, indices, experts, LIMIT), oracle(x, weights, indices, experts))


@pytest.mark.parametrize("smem", [None, 101376], ids=["H200", "99KB"])
def test_prefill_tma_plan_equals_the_pointer_plan(experts, smem, monkeypatch):
    """Prefill's plan reads the activations by TMA, in expert order: the same bits as reading them by row
    pointers (the plan otherwise the same), also in the plan a ~99 KB part gets."""
    if smem is not None:
        monkeypatch.setattr(moe, "shared_memory_per_block", lambda device: smem)
    monkeypatch.setattr(moe, "_FITTED", {})  # only this call's plans
    x, weights, indices = routing(8192, 11)
    routes = moe.group_by_expert(indices, experts.gate.shape[0])
    tma = moe.routed_experts(x, weights, indices, experts, LIMIT, routes)
    fitted = {key[1]: plan for key, plan in moe._FITTED.items() if key[0].tma and key[-1] == x.device}
    assert set(fitted) == {"gate-up", "down"}, "the 8K prefill did not take TMA plans"
    pointers = tuple(
        dataclasses.replace(plan, tma=False, rest=plan.rest and dataclasses.replace(plan.rest, tma=False))
        for plan in (fitted["gate-up"], fitted["down"])
    )
    assert all(plan.rest for plan in pointers), "the 8K prefill did not take two-launch passes"
    got = moe.routed_experts_triton(x, weights, indices, experts, LIMIT, pointers, routes)
    assert torch.equal(tma, got)


def test_hash_routing_with_repeated_experts(experts):
    x, weights, indices = routing(64, 3, hashed=True)
    assert_close(moe.routed_experts(x, weights, indices, experts, LIMIT), oracle(x, weights, indices, experts))


@pytest.mark.parametrize("tokens", [4096, 8192])  # 96 and 192 rows an expert
def test_small_shared_memory_plan(experts, tokens, monkeypatch):
    """The plans a ~99 KB part whose MMA reads registers (sm_120, GB10) gets, run on this GPU: the 128- and 256-row
    tiers of _REGISTER_OPERAND_TIERS."""
    monkeypatch.setattr(moe, "shared_memory_per_block", lambda device: 101376)
    monkeypatch.setattr(moe, "mma_operands_in_registers", lambda device: True)
    x, weights, indices = routing(tokens, 5)
    assert_close(moe.routed_experts(x, weights, indices, experts, LIMIT), oracle(x, weights, indices, experts))


def test_reference_at_real_size(experts):
    """The torch reference (the CPU path) is the same op: checked on a few tokens at Flash sizes."""
    x, weights, indices = routing(2, 6)
    ref = moe.routed_experts_reference(x, weights, indices, experts, LIMIT)
    assert_close(ref, oracle(x, weights, indices, experts))


def test_graph_replay_equals_eager(experts):
    x, weights, indices = routing(8, 7)
    static = [t.clone() for t in (x, weights, indices)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe.routed_experts(*static, experts, LIMIT)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.routed_experts(*static, experts, LIMIT)
    for seed in (8, 9):
        for buffer, value in zip(static, routing(8, seed)):
            buffer.copy_(value)
        graph.replay()
        assert torch.equal(out, moe.routed_experts(*routing(8, seed), experts, LIMIT))


def test_token_counts_compile_few_variants(experts):
    before = sum(len(c[0]) for c in moe._grouped_gemm_kernel.device_caches.values())
    for tokens in range(1, 200, 7):
        moe.routed_experts(*routing(tokens, tokens), experts, LIMIT)
    after = sum(len(c[0]) for c in moe._grouped_gemm_kernel.device_caches.values())
    assert after - before <= 16, after - before


@pytest.mark.parametrize("tokens", [1, 8, 64, 200])
@pytest.mark.parametrize("kind", ["score", "hash", "expert_parallel"])
def test_routing_matches_the_reference(tokens, kind):
    """Flash's router (256 experts, top-6, sqrt-softplus) on the device against the CPU reference on the same
    logits: the same experts, weights within fp32 rounding, the same grouping (sorted by the routing kernel up to
    8 tokens, by the group kernel up to GROUP_MAX_SLOTS slots: 64 tokens, by torch at 200)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, E, device="cuda", generator=g) * 2
    bias = torch.randn(E, device="cuda", generator=g) * 0.1
    tid2eid = torch.randint(0, E, (1000, K), device="cuda", generator=g)
    ids = torch.randint(0, 1000, (tokens,), device="cuda", generator=g)
    hashed = kind == "hash"
    local = (64, 64) if kind == "expert_parallel" else None
    got = routing_module.route(logits, bias, tid2eid if hashed else None, ids, K, "sqrtsoftplus", 1.5, local)
    want = routing_module.route(
        logits.cpu(), bias.cpu(), tid2eid.cpu() if hashed else None, ids.cpu(), K, "sqrtsoftplus", 1.5, local
    )
    assert torch.equal(got.indices.cpu(), want.indices)
    torch.testing.assert_close(got.weights.cpu(), want.weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.order.cpu().long(), want.order) and torch.equal(got.bounds.cpu(), want.bounds)


def test_moe_layer_graph_replay_equals_eager_and_the_reference():
    """The whole layer (router GEMM, routing kernel, routed experts, shared expert, slot sum) captured in a CUDA
    graph equals its eager call, and matches the routed-experts reference plus the shared expert."""
    layer = moe_layer(load_config(FLASH_CONFIG))
    layer.gate.bias.normal_(0.0, 0.1)
    ids = torch.zeros(8, dtype=torch.long, device="cuda")
    static = torch.zeros(8, D, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(static, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static, ids)
    for seed in (12, 13):
        x = routing(8, seed)[0]
        static.copy_(x)
        graph.replay()
        eager = layer(x, ids)
        assert torch.equal(out, eager)
        routes = layer.gate(x, ids)
        routed = moe.routed_experts_reference(x, routes.weights, routes.indices, expert_weights(layer.experts), LIMIT)
        assert_close(eager.float(), (routed + layer.shared_experts(x).float()).bfloat16().float())


@triton.jit
def _e4m3_decode_kernel(codes_ptr, out_ptr, ROWS: tl.constexpr, BK: tl.constexpr):
    r = tl.arange(0, ROWS)
    codes = tl.load(codes_ptr + r[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :])
    w = moe._e2m1_e4m3_tile(codes, BK, True)
    tl.store(out_ptr + r[:, None] * BK + tl.arange(0, BK)[None, :], w.to(tl.float32))


@pytest.mark.parametrize("bk", [128, 512])
def test_e4m3_decoding_of_every_code_in_the_column_order(bk):
    """The PTX decoding (sm_89+): every byte value gives its two codes' values times 2^-6 (the subnormal 0.5
    among them), column c of a K step holding the row's column e4m3_mma_columns(bk)[c]."""
    rows = 64
    packed = torch.arange(rows * bk // 2, device="cuda").remainder(256).to(torch.uint8).view(rows, bk // 2)
    got = torch.empty(rows, bk, device="cuda")
    _e4m3_decode_kernel[(1,)](packed, got, ROWS=rows, BK=bk)
    ones = torch.full((rows, bk // 32), 127, dtype=torch.uint8, device="cuda")
    want = mxfp4_dequantize(packed.view(torch.int8), ones.view(torch.float8_e8m0fnu), torch.float32) / 64
    assert torch.equal(got, want[:, moe.e4m3_mma_columns(bk).cuda()])


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_column_group_plans_match_the_oracle(experts, tokens):
    """Each column-group plan (one, two, four rows a tile) at Flash sizes, whichever the batch would pick."""
    x, weights, indices = routing(tokens, 3)
    want = oracle(x, weights, indices, experts)
    for columns in (16, 8, 4):
        plan = moe.GemmPlan(bm=16 // columns, weight_rows=64, bk=32 * columns, warps=4, stages=3, column_groups=columns)
        got = moe.routed_experts_triton(x, weights, indices, experts, LIMIT, (plan, plan))
        assert_close(got, want)
