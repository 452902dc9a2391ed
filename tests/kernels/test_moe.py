"""Routed experts: the reference equals a per-token oracle in both weight formats, and the grouped-GEMM
kernels (interpreted) equal the reference under hash and score routing, uneven and empty experts, and
tokens routed twice to one expert."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from interpreted import interpreted

import ds4.kernels.moe as moe_module
from ds4.checkpoint.quant import E2M1_VALUES, mxfp4_dequantize, mxfp4_quantize, pack_e2m1
from ds4.kernels.fp8_kv import fp8_quant_dequant
from ds4.kernels.moe import (
    ExpertWeights,
    GemmPlan,
    act_quant,
    gemm_plan,
    mxfp4_to_float,
    plan_shared_memory,
    routed_experts_reference,
)


def _dense(e, d, i, gen, dtype=torch.float32):
    w1, w3 = torch.randn(e, i, d, generator=gen) / d**0.5, torch.randn(e, i, d, generator=gen) / d**0.5
    w2 = torch.randn(e, d, i, generator=gen) / i**0.5
    return ExpertWeights(w1.to(dtype), w3.to(dtype), w2.to(dtype))


def _packed(dense: ExpertWeights) -> ExpertWeights:
    """The contract's storage: w13 uint8 [E, 2I, D/2] + e8m0 bytes [E, 2I, D/32], w2 [E, D, I/2] + [E, D, I/32]."""

    def quantize(w):
        pairs = [mxfp4_quantize(m) for m in w.float()]
        return torch.stack([p.view(torch.uint8) for p, _ in pairs]), torch.stack(
            [s.view(torch.uint8) for _, s in pairs]
        )

    w13, s13 = quantize(torch.cat((dense.gate, dense.up), dim=1))
    w2, s2 = quantize(dense.down)
    i = dense.gate.shape[1]
    return ExpertWeights(w13[:, :i], w13[:, i:], w2, s13[:, :i], s13[:, i:], s2)


def _per_token(x, weights, indices, experts: ExpertWeights, limit):
    """Each token alone: sum over its k slots of down(silu(min(gate x, limit)) * clamp(up x) * weight), MXFP4
    weights dequantised by quant.py, activations through fp8_kv's e4m3 rounding (block 128), bf16 outputs."""
    mx = experts.mxfp4

    def weight(name, e):
        w = getattr(experts, name)[e]
        if not mx:
            return w.float()
        scale = getattr(experts, name + "_scale")[e]
        return mxfp4_dequantize(w.view(torch.int8), scale.view(torch.float8_e8m0fnu), torch.float32)

    def rnd(v):
        return v.to(torch.bfloat16).float() if mx else v

    def e4m3(v):  # groups of 128, or one shorter group
        return fp8_quant_dequant(v[None], 128 if v.numel() % 128 == 0 else v.numel())[0] if mx else v

    out = torch.zeros(x.shape[0], experts.down.shape[1])
    for t in range(x.shape[0]):
        xt = e4m3(x[t].float())
        for w, e in zip(weights[t].tolist(), indices[t].tolist()):
            gate = rnd(weight("gate", e) @ xt).clamp(max=limit)
            up = rnd(weight("up", e) @ xt).clamp(-limit, limit)
            h = e4m3(rnd(gate * torch.sigmoid(gate) * up * w))
            out[t] += rnd(weight("down", e) @ h)
    return out


def _routing(kind, t, k, e, gen):
    if kind == "score":  # top-k of random scores: distinct experts
        return torch.randn(t, e, generator=gen).topk(k, dim=-1).indices
    if kind == "hash":  # a tid2eid table may repeat an expert within a token's row
        table = torch.randint(0, e, (50, k), generator=gen)
        table[7] = torch.tensor([3] * k)
        ids = torch.randint(0, 50, (t,), generator=gen)
        ids[0] = 7
        return table[ids]
    if kind == "skewed":  # one expert takes most slots; experts 5.. stay empty
        idx = torch.randint(0, 5, (t, k), generator=gen)
        idx[: t // 2 + 1, 0] = 1
        return idx
    raise ValueError(kind)


def test_mxfp4_to_float_equals_quant_dequantize():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 64, generator=gen) * torch.logspace(-6, 3, 64)
    packed, scale = mxfp4_quantize(w)
    codes = torch.arange(16, dtype=torch.uint8).repeat(2, 2)  # every code in both nibbles
    everything = pack_e2m1(codes)
    all_scale = torch.tensor([[100], [140]], dtype=torch.uint8)
    assert torch.equal(
        mxfp4_to_float(packed.view(torch.uint8), scale.view(torch.uint8)),
        mxfp4_dequantize(packed, scale, torch.float32),
    )
    want = mxfp4_dequantize(everything, all_scale.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(mxfp4_to_float(everything.view(torch.uint8), all_scale), want)
    assert torch.equal(want[0, :8] / 2.0**-27, torch.tensor(E2M1_VALUES)) and torch.equal(want[0, 8:16], -want[0, :8])


def test_act_quant_rounds_each_128_group_through_e4m3():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 384, generator=gen) * torch.logspace(-5, 4, 384)
    x[1, :128] = 0.0  # an all-zero group: the 1e-4 floor keeps its scale finite
    assert torch.equal(act_quant(x), fp8_quant_dequant(x, 128))
    assert torch.equal(
        act_quant(x[:, :200]), torch.cat([fp8_quant_dequant(x[:, :128], 128), fp8_quant_dequant(x[:, 128:200], 72)], 1)
    )


@pytest.mark.parametrize("fmt", ["dequantized", "mxfp4"])
def test_reference_equals_the_per_token_oracle(fmt):
    gen = torch.Generator().manual_seed(3)
    e, d, i, t, k = 6, 128, 64, 9, 3
    experts = _dense(e, d, i, gen)
    if fmt == "mxfp4":
        experts = _packed(experts)
    x = torch.randn(t, d, generator=gen)
    for kind in ("score", "hash"):
        indices = _routing(kind, t, k, e, gen)
        weights = torch.rand(t, k, generator=gen) * 2
        want = _per_token(x, weights, indices, experts, 2.0)
        got = routed_experts_reference(x, weights, indices, experts, 2.0)
        tol = 1e-5 if fmt == "dequantized" else 2e-2
        assert (got - want).abs().max() <= tol * want.abs().max(), kind


@pytest.fixture(scope="module")
def kernels():
    return interpreted(moe_module, "_grouped_gemm_kernel")


@pytest.mark.parametrize("kind", ["score", "hash", "skewed"])
def test_interpreted_kernels_equal_the_reference_mxfp4(kernels, kind):
    gen = torch.Generator().manual_seed(4)
    e, d, i, t, k = 8, 256, 96, 7, 3  # I = 96: a partial activation group and partial column tiles
    experts = _packed(_dense(e, d, i, gen))
    x = (torch.randn(t, d, generator=gen) * 3).to(torch.bfloat16)
    indices = _routing(kind, t, k, e, gen)
    weights = torch.rand(t, k, generator=gen)
    want = routed_experts_reference(x, weights, indices, experts, 1.5)
    got = kernels.routed_experts_triton(x, weights, indices, experts, 1.5)
    assert got.dtype == torch.float32 and got.shape == (t, d)
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    assert (got - want).abs().mean() <= 1e-3 * want.abs().mean()


@triton.jit
def _decode_kernel(words_ptr, scale_ptr, out_ptr, ROWS: tl.constexpr, BK: tl.constexpr, PTX: tl.constexpr):
    r = tl.arange(0, ROWS)
    words = tl.load(words_ptr + r[:, None] * (BK // 8) + tl.arange(0, BK // 8)[None, :])
    scale = tl.load(scale_ptr + r[:, None] * (BK // 32) + tl.arange(0, BK // 32)[None, :])
    w = moe_module._e2m1_tile(words, scale, BK, PTX)
    tl.store(out_ptr + r[:, None] * BK + tl.arange(0, BK)[None, :], w.to(tl.float32))


@pytest.mark.parametrize("bk", [32, 256])
def test_interpreted_decoding_and_activations_share_the_mma_column_order(kernels, bk):
    """Column c of a decoded K step is stored column mma_columns(bk)[c] (every byte value, scale bytes up to
    128), and the expert act_quant kernel stores the activations in that same order, step by step."""
    rows = 8
    packed = torch.arange(rows * bk // 2).remainder(256).to(torch.uint8).view(rows, bk // 2)
    scale = torch.randint(0, 129, (rows, bk // 32), generator=torch.Generator().manual_seed(7), dtype=torch.uint8)
    got = torch.empty(rows, bk)
    _decode_kernel[(1,)](packed.view(torch.int32), scale, got, ROWS=rows, BK=bk, PTX=False)
    columns = kernels.mma_columns(bk)
    assert sorted(columns.tolist()) == list(range(bk))
    want = mxfp4_dequantize(packed.view(torch.int8), scale.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(got, want[:, columns])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).bfloat16()
    stored = kernels._act_quant(x, 3, bk).float()
    steps = torch.arange(256).view(-1, bk)
    assert torch.equal(stored, act_quant(x.float())[:, steps[:, columns].flatten()])


def test_interpreted_kernels_split_a_heavy_expert_into_tiles(kernels):
    """40 tokens send their first slot to expert 2: three 16-row tiles of one expert, experts 5.. empty."""
    gen = torch.Generator().manual_seed(6)
    e, d, i, t, k = 8, 128, 64, 40, 2
    experts = _packed(_dense(e, d, i, gen))
    x = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    indices = torch.stack((torch.full((t,), 2), torch.randint(0, 5, (t,), generator=gen)), dim=1)
    weights = torch.rand(t, k, generator=gen)
    plan = kernels.GemmPlan(bm=16, weight_rows=64, bk=64, warps=4, stages=2)
    want = routed_experts_reference(x, weights, indices, experts, 10.0)
    got = kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (plan, plan))
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()


@pytest.mark.parametrize("bm", [16, 32])
def test_interpreted_tma_plans_read_the_activations_in_expert_order(kernels, bm):
    """A TMA plan: the act_quant pass writes each slot's token row in expert order and the GEMMs read [bm, bk]
    boxes of it (the down pass of h's rows, already in that order); a tile's rows past its expert (the next
    expert's, zeros past the end) are computed and not stored. As the pointer plan, and the reference."""
    gen = torch.Generator().manual_seed(9)
    e, d, i, t, k = 8, 128, 64, 40, 2
    experts = _packed(_dense(e, d, i, gen))
    x = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    indices = torch.stack((torch.full((t,), 2), torch.randint(0, 5, (t,), generator=gen)), dim=1)
    weights = torch.rand(t, k, generator=gen)
    pointers = kernels.GemmPlan(bm=bm, weight_rows=64, bk=64, warps=4, stages=2)
    tma = kernels.GemmPlan(bm=bm, weight_rows=64, bk=64, warps=4, stages=2, tma=True)
    want = routed_experts_reference(x, weights, indices, experts, 10.0)
    got = kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (tma, tma))
    assert torch.equal(got, kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (pointers, pointers)))
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    with pytest.raises(ValueError, match="TMA plans take MXFP4"):
        dense = _dense(e, d, i, gen)
        kernels.routed_experts_triton(x.float(), weights, indices, dense, 10.0, (tma, tma))


@pytest.mark.parametrize("tma", [False, True])
def test_interpreted_two_launch_plans_split_each_expert_into_wide_tiles_and_a_rest(kernels, tma):
    """A pass of two launches (GemmPlan.rest, 32-row wide tiles, rests of up to 16 rows): expert 2's 45 rows take
    one wide tile and a rest of 13, expert 0's 24 one wide tile (a rest over 16), expert 1's 5 a rest alone, experts
    3.. none. Equal to the one-launch plan (each row's sums are the same), and to the reference."""
    gen = torch.Generator().manual_seed(10)
    e, d, i, k = 8, 128, 64, 2
    counts = {2: 45, 0: 24, 1: 5}
    slots = torch.cat([torch.full((n,), expert) for expert, n in counts.items()])
    slots = slots[torch.randperm(slots.numel(), generator=gen)]
    t = slots.numel() // k
    indices = slots[: t * k].view(t, k)
    experts = _packed(_dense(e, d, i, gen))
    x = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    weights = torch.rand(t, k, generator=gen)
    rest = kernels.GemmPlan(bm=16, weight_rows=64, bk=64, warps=4, stages=2, tma=tma)
    two = kernels.GemmPlan(bm=32, weight_rows=64, bk=64, warps=4, stages=2, tma=tma, rest=rest)
    one = kernels.GemmPlan(bm=32, weight_rows=64, bk=64, warps=4, stages=2, tma=tma)
    got = kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (two, two))
    assert torch.equal(got, kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (one, one)))
    want = routed_experts_reference(x, weights, indices, experts, 10.0)
    assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    for other in (replace(rest, bk=32), replace(rest, tma=not tma)):
        mismatched = replace(two, rest=other)
        with pytest.raises(ValueError, match="read the activations alike"):
            kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (mismatched, mismatched))


@pytest.mark.parametrize("loads", ["tight", "random"])
def test_interpreted_two_launch_grids_cover_every_tile(kernels, loads):
    """The launches' grids are bounds computed without reading the routing: at their tightest (every expert a
    remainder of one row more than the rest tiles take: one wide tile each, as many as the bound) and under a random
    skewed load, every row is computed (the slots start as garbage), as by the one-launch plan."""
    gen = torch.Generator().manual_seed(11)
    e, d, i, k = 16, 64, 64, 2
    if loads == "tight":
        counts = torch.full((e,), 17)
    else:
        counts = (torch.rand(e, generator=gen) ** 3 * 80).long()
        counts[0] += counts.sum() % 2  # whole tokens
    slots = torch.repeat_interleave(torch.arange(e), counts)
    slots = slots[torch.randperm(slots.numel(), generator=gen)]
    t = slots.numel() // k
    indices = slots.view(t, k)
    experts = _packed(_dense(e, d, i, gen))
    x = torch.randn(t, d, generator=gen).to(torch.bfloat16)
    weights = torch.rand(t, k, generator=gen)
    rest = kernels.GemmPlan(bm=16, weight_rows=64, bk=64, warps=4, stages=2)
    two = kernels.GemmPlan(bm=32, weight_rows=64, bk=64, warps=4, stages=2, rest=rest)
    one = kernels.GemmPlan(bm=32, weight_rows=64, bk=64, warps=4, stages=2)
    got = kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (two, two))
    assert torch.equal(got, kernels.routed_experts_triton(x, weights, indices, experts, 10.0, (one, one)))


def test_interpreted_kernels_equal_the_reference_dequantized(kernels):
    gen = torch.Generator().manual_seed(5)
    e, d, i, t, k = 5, 96, 80, 6, 2
    experts = _dense(e, d, i, gen)
    x = torch.randn(t, d, generator=gen)
    indices = _routing("hash", t, k, e, gen)
    weights = torch.rand(t, k, generator=gen)
    want = routed_experts_reference(x, weights, indices, experts, 0.0)
    got = kernels.routed_experts_triton(x, weights, indices, experts, 0.0)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_plans_follow_the_device():
    """Decode rows get narrow row tiles and weight tiles small enough for two programs an SM; prefill rows wide
    row tiles; the pipelined tiles fit the device's shared memory, with fewer stages or narrower K steps
    where it has less; K steps divide K."""
    one_token = gemm_plan(6, 256, 2048, 4096, True, True, 2, 132, 232448)
    assert one_token.bm == 16 and 6 * 2048 // (one_token.weight_rows // 2) >= 2 * 132
    batch = gemm_plan(384, 256, 2048, 4096, True, True, 2, 132, 232448)
    assert batch.bm == 16 and batch.weight_rows > one_token.weight_rows
    big = gemm_plan(49152, 256, 2048, 4096, True, True, 2, 132, 232448)
    small = gemm_plan(49152, 256, 2048, 4096, True, True, 2, 188, 101376)
    assert big.bm == 256 and big.stages >= 3 and big.tma and not batch.tma
    for plan, smem in ((big, 232448), (small, 101376)):  # an expert's rest of up to 128 rows in a second launch
        assert plan.rest.bm == 128 and plan.rest.bk == plan.bk and plan.rest.tma == plan.tma
        assert plan_shared_memory(plan.rest, True, 2) <= smem
    assert batch.rest is None and one_token.rest is None
    assert not gemm_plan(49152, 256, 2048, 4096, True, True, 2, 108, 166912, tma=False).tma  # sm_80
    for plan, smem in ((big, 232448), (small, 101376)):
        assert plan_shared_memory(plan, True, 2) <= smem
    assert plan_shared_memory(small, True, 2) < plan_shared_memory(big, True, 2)
    dense = gemm_plan(49152, 256, 2048, 4096, True, False, 2, 188, 101376)
    assert plan_shared_memory(dense, False, 2) <= 101376 and dense.stages >= 2 and not dense.tma
    assert 96 % gemm_plan(6, 8, 64, 96, False, True, 2, 132, 232448).bk == 0


@pytest.mark.parametrize("smem,tma", [(101376, True), (166912, False)], ids=["sm_120", "sm_80"])
def test_register_operand_devices_keep_the_accumulator_small(smem, tma):
    """Where the MMA takes both operands from registers (mma.sync), each tier's fp32 accumulator takes at most 64
    registers a thread and the widest tiles' K steps stay at 64 (beside the accumulator they hold the decoded
    weights' and the activations' fragments), at every batch from one token to a prefill."""
    for rows in (6, 384, 256 * 20, 256 * 50, 256 * 100, 49152):
        for gated, n, k in ((True, 2048, 4096), (False, 4096, 2048)):
            plan = gemm_plan(rows, 256, n, k, gated, True, 2, 188, smem, tma, registers_hold_operands=True)
            for launch in (plan, plan.rest) if plan.rest else (plan,):
                assert launch.bm * launch.weight_rows // (32 * launch.warps) <= 64, launch
                assert launch.bm < 256 or launch.bk <= 64, launch
                assert plan_shared_memory(launch, True, 2) <= smem
            wgmma = gemm_plan(rows, 256, n, k, gated, True, 2, 188, smem, tma)
            assert plan.bm == wgmma.bm  # the same row tiles: only the register budget differs


def test_a_plan_whose_compiled_kernel_overflows_shared_memory_steps_down_once():
    """A plan the compiler's own buffers push past the device's shared memory loses stages (down to two), then
    halves its K step; the result is kept, so a later call compiles nothing."""
    compiled = []

    def compile_plan(plan, part, split):
        assert (part, split) == ("all", (0, 0))
        compiled.append(plan)
        return SimpleNamespace(metadata=SimpleNamespace(shared=plan.stages * plan.bk * 1000 + 100_000))

    plan = GemmPlan(bm=32, weight_rows=128, bk=256, warps=4, stages=4)
    fitted = moe_module._fitted(plan, ("test", 1), compile_plan, 260_000, mxfp4=True)
    assert fitted == GemmPlan(bm=32, weight_rows=128, bk=64, warps=4, stages=2)
    assert [(p.stages, p.bk) for p in compiled] == [(4, 256), (3, 256), (2, 256), (2, 128), (2, 64)]
    assert moe_module._fitted(plan, ("test", 1), compile_plan, 260_000, mxfp4=True) == fitted
    assert len(compiled) == 5
    roomy = moe_module._fitted(plan, ("test", 2), compile_plan, 10**7, mxfp4=True)
    assert roomy == plan and len(compiled) == 6
    with pytest.raises(RuntimeError, match="no grouped-GEMM plan fits"):
        moe_module._fitted(plan, ("test", 3), compile_plan, 100_000, mxfp4=True)


def test_a_two_launch_plans_launches_are_fitted_to_one_k_step():
    """The wide launch's compiled kernel fits only with K steps of 64: the rest launch takes them too (the
    activations are stored in the column order of one K step), each compiled for its part of the pass."""
    parts = []

    def compile_plan(plan, part, split):
        parts.append((part, split))
        return SimpleNamespace(metadata=SimpleNamespace(shared=plan.bm * plan.bk * 8 * plan.stages // 2))

    rest = GemmPlan(bm=128, weight_rows=128, bk=128, warps=4, stages=2)
    plan = GemmPlan(bm=256, weight_rows=128, bk=128, warps=8, stages=2, rest=rest)
    fitted = moe_module._fitted(plan, ("test", 2), compile_plan, 200_000, mxfp4=True)
    assert (fitted.bk, fitted.rest.bk, fitted.rest.bm) == (64, 64, 128)
    assert set(parts) == {("wide", (256, 128)), ("rest", (256, 128))}


@triton.jit
def _e4m3_decode_kernel(codes_ptr, out_ptr, ROWS: tl.constexpr, BK: tl.constexpr, PTX: tl.constexpr):
    r = tl.arange(0, ROWS)
    codes = tl.load(codes_ptr + r[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :])
    w = moe_module._e2m1_e4m3_tile(codes, BK, PTX)
    tl.store(out_ptr + r[:, None] * BK + tl.arange(0, BK)[None, :], w.to(tl.float32))


def test_interpreted_e4m3_decoding_and_activations_share_the_column_order(kernels):
    """Every byte value decodes to its two codes' values times 2^-6, column c of a K step holding the row's column
    e4m3_mma_columns(bk)[c]; the e4m3 act_quant stores the activations' e4m3 values in that same order, with the
    128-group scales beside: act_quant's values."""
    bk, rows = 64, 8
    packed = torch.arange(rows * bk // 2).remainder(256).to(torch.uint8).view(rows, bk // 2)
    got = torch.empty(rows, bk)
    _e4m3_decode_kernel[(1,)](packed, got, ROWS=rows, BK=bk, PTX=False)
    columns = kernels.e4m3_mma_columns(bk)
    assert sorted(columns.tolist()) == list(range(bk))
    ones = torch.full((rows, bk // 32), 127, dtype=torch.uint8)
    want = mxfp4_dequantize(packed.view(torch.int8), ones.view(torch.float8_e8m0fnu), torch.float32) / 64
    assert torch.equal(got, want[:, columns])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8)).bfloat16() * 5
    a, scales = kernels._e4m3_activations(3, 512, x.device)
    kernels._act_quant(x, 3, 512, a, scales=scales)
    values = a[:, kernels.e4m3_mma_columns(512).argsort()]
    assert torch.equal(values * scales.repeat_interleave(128, dim=1), act_quant(x.float()))
    assert torch.all(values.abs() <= 448) and torch.equal(values, values.to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("columns, inter", [(16, 256), (16, 512), (8, 256), (4, 256)])
def test_interpreted_column_group_plans_equal_the_reference(kernels, columns, inter):
    """The e4m3 MMA's plans (one, two or four rows a tile, the rest of its 16 columns 32-groups) under score and
    hash routing (a token sent twice to one expert: two one-row tiles); x's 128-groups of unlike scales, so that
    each column's activation scale counts. At inter 512 the down pass takes one-row tiles too."""
    gen = torch.Generator().manual_seed(10)
    e, d, t, k = 8, 512, 3, 3
    experts = _packed(_dense(e, d, inter, gen))
    spread = 2.0 ** torch.randint(-4, 5, (t, d // 128), generator=gen).repeat_interleave(128, dim=1)
    x = (torch.randn(t, d, generator=gen) * spread).to(torch.bfloat16)  # 128-groups of unlike scales
    down_columns = min(columns, inter // 32)  # a K step of the down pass within its K
    plan1 = GemmPlan(bm=16 // columns, weight_rows=64, bk=32 * columns, warps=4, stages=2, column_groups=columns)
    plan2 = replace(plan1, bm=16 // down_columns, bk=32 * down_columns, column_groups=down_columns)
    for kind in ("score", "hash"):
        indices = _routing(kind, t, k, e, gen)
        weights = torch.rand(t, k, generator=gen)
        want = routed_experts_reference(x, weights, indices, experts, 1.5)
        got = kernels.routed_experts_triton(x, weights, indices, experts, 1.5, (plan1, plan2))
        assert (got - want).abs().max() <= 1e-2 * want.abs().max(), kind
        assert (got - want).abs().mean() <= 1e-3 * want.abs().mean(), kind


def test_e4m3_devices_take_column_group_plans_at_decode_sizes():
    """One token: one-row tiles (16 groups a K step); batches of 8 or more tokens and prefill the bf16 MMA's tiles;
    a K that 512 does not divide, or a device without e4m3, keeps them too."""
    flash = (256, 2048, 4096, True, True, 2, 132, 232448)

    def plan(rows, **kw):
        return gemm_plan(rows, *flash, **kw)

    assert plan(6, e4m3_mma=True).column_groups == 16 and plan(6, e4m3_mma=True).bm == 1
    assert [plan(r, e4m3_mma=True).bm for r in (48, 384, 49152)] == [16, 16, 256]
    assert not any(plan(r, e4m3_mma=True).column_groups for r in (48, 384, 49152))
    assert plan(6).column_groups == 0
    assert gemm_plan(6, 256, 2048, 256, True, True, 2, 132, 232448, e4m3_mma=True).column_groups == 0
    with pytest.raises(ValueError, match="column-group plan"):
        GemmPlan(bm=2, weight_rows=64, bk=512, warps=4, stages=2, column_groups=16)
