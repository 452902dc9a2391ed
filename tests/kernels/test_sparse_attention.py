"""Sparse attention: the reference against a plain softmax, the Triton kernel (interpreted) against the reference."""

import pytest
import torch
from attention_cases import build_case
from interpreted import interpreted

import ds4.kernels.fp8_kv
import ds4.kernels.norm_rope
import ds4.kernels.rmsnorm
import ds4.kernels.rope
import ds4.kernels.sparse_attention as sa
from ds4.kernels.fp8_kv import dequantize_kv
from ds4.kernels.rope import apply_rope_reference, rope_inv_freq

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernel through the CPU interpreter")


def _kernel():
    deps = (ds4.kernels.fp8_kv, ds4.kernels.rmsnorm, ds4.kernels.rope, ds4.kernels.norm_rope)
    return interpreted(sa, "_sparse_attention_kernel", *deps)


def test_reference_is_softmax_with_the_sink_in_the_denominator():
    case = build_case([(10, 3)], heads=3, head_dim=128, kind="csa", fp8=True)
    out = sa.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.1, case.rope_dim)
    for t in range(3):
        keys = torch.cat([dequantize_kv(kv[idx[t][idx[t] >= 0]], 128, 64, torch.float32) for kv, idx in case.key_sets])
        for h in range(3):
            logits = torch.cat([keys @ case.q[t, h] * 0.1, case.sink[h : h + 1]])
            weights = torch.softmax(logits, dim=0)[:-1]  # the sink's share goes nowhere
            assert torch.allclose(out[t, h], weights @ keys, atol=1e-5)


CASES = {
    "window only, prefill from 0": dict(requests=[(0, 11)], kind="window"),
    "window only, decode 1 token x 3 requests": dict(requests=[(3, 1), (20, 1), (0, 1)], kind="window"),
    "CSA, decode 1 token with -1 padding": dict(requests=[(9, 1), (40, 1)], kind="csa"),
    "CSA, 4 tokens a request (speculative verify)": dict(requests=[(13, 4), (30, 4)], kind="csa"),
    "HCA, decode 4 tokens": dict(requests=[(27, 4), (5, 4)], kind="hca", ratio=8),
    "CSA, chunk crossing window and entry boundaries": dict(requests=[(6, 13), (17, 5)], kind="csa"),
    "HCA, chunk after a long context": dict(requests=[(70, 9)], kind="hca", ratio=8),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name, fp8):
    mod = _kernel()
    case = build_case(heads=4, head_dim=128, fp8=fp8, seed=len(name), **CASES[name])
    want = mod.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.09, case.rope_dim)
    got = mod.sparse_attention(case.q, case.key_sets, case.sink, 0.09, case.rope_dim, impl="triton")
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_with_heads_over_several_programs_and_a_token_seeing_nothing(splits):
    """20 heads in programs of 16 (as Pro's 128 in two of 64); a token whose lists are all -1 gets 0 (the sink
    alone), like the reference, also when its keys are split (programs that see no key at all)."""
    mod = _kernel()
    case = build_case([(0, 3), (12, 2)], heads=20, head_dim=128, kind="hca", fp8=True, seed=3)
    case.key_sets = [(kv, torch.where(torch.arange(len(idx))[:, None] == 0, -1, idx)) for kv, idx in case.key_sets]
    plan = mod.AttentionPlan(block_h=16, block_n=16, num_warps=4)
    want = mod.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.09, case.rope_dim)
    got = mod.sparse_attention(
        case.q, case.key_sets, case.sink, 0.09, case.rope_dim, impl="triton", plan=plan, splits=splits
    )
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_head_dim_that_is_not_a_power_of_two(fp8):
    """head_dim 80 = 64 + 16 RoPE (a tiny test config): the kernel pads it to 128 and masks the rest."""
    mod = _kernel()
    case = build_case([(9, 4), (30, 1)], heads=4, head_dim=80, rope_dim=16, kind="hca", fp8=fp8, seed=4)
    want = mod.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.1, case.rope_dim)
    got = mod.sparse_attention(case.q, case.key_sets, case.sink, 0.1, case.rope_dim, impl="triton", splits=2)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_keys_split_over_programs_combine_to_the_reference(splits):
    """A small decode batch spreads each token's key tiles over several programs (the window, the step's keys and
    the entries counted end to end; a split may start inside one list and end in another, or hold only -1)."""
    mod = _kernel()
    case = build_case([(40, 1), (23, 2)], heads=4, head_dim=128, kind="csa", topk=20, fp8=True, seed=splits)
    want = mod.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.09, case.rope_dim)
    got = mod.sparse_attention(case.q, case.key_sets, case.sink, 0.09, case.rope_dim, impl="triton", splits=splits)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_probabilities_exchanged_through_memory_give_the_reference(splits):
    """AttentionPlan.exchange: each tile's probabilities and rescale factors reach the PV product through the
    program's own slot (heads over two programs, a token's keys over several, tiles of -1 skipped)."""
    mod = _kernel()
    case = build_case([(40, 1), (23, 2), (0, 3)], heads=20, head_dim=128, kind="csa", topk=20, fp8=True, seed=7)
    plan = mod.AttentionPlan(block_h=16, block_n=16, num_warps=4, stages=2, exchange=True)
    want = mod.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.09, case.rope_dim)
    got = mod.sparse_attention(
        case.q, case.key_sets, case.sink, 0.09, case.rope_dim, impl="triton", plan=plan, splits=splits
    )
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


def test_e4m3_decoded_from_its_bits_as_on_devices_without_fp8_conversion(monkeypatch):
    """sm_80 has no e4m3 conversion: the kernel then decodes the bits itself (normals and subnormals, signs)."""
    mod = _kernel()
    monkeypatch.setattr(mod, "has_fp8", lambda device: False)
    case = build_case([(12, 3)], heads=4, head_dim=128, kind="csa", fp8=True, seed=9)
    pool, idx = case.key_sets[2]
    pool[:, :64] = torch.arange(256, dtype=torch.uint8).view(-1, 64).repeat(pool.shape[0] // 4 + 1, 1)[: pool.shape[0]]
    pool[:, :64][pool[:, :64] & 0x7F == 0x7F] = 0  # no NaN codes
    want = mod.sparse_attention_reference(case.q, case.key_sets, case.sink, 0.09, case.rope_dim)
    got = mod.sparse_attention(case.q, case.key_sets, case.sink, 0.09, case.rope_dim, impl="triton")
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5)


def test_bad_inputs_are_refused():
    case = build_case([(4, 2)], heads=2, head_dim=128, kind="hca", fp8=True)
    with pytest.raises(ValueError, match="rope_dim"):
        sa.sparse_attention(case.q, case.key_sets, case.sink, 0.1)
    mixed = [case.key_sets[0], (torch.zeros(4, 128), case.key_sets[1][1])]
    with pytest.raises(ValueError, match="mix"):
        sa.sparse_attention(case.q, mixed, case.sink, 0.1, 64)
    pool, idx = case.key_sets[0]
    shifted = torch.empty(pool.numel() + 1, dtype=torch.uint8)[1:].view(pool.shape)
    with pytest.raises(ValueError, match="8 bytes"):
        sa.sparse_attention(case.q, [(shifted, idx)], case.sink, 0.1, 64, impl="triton")
    wide = build_case([(4, 2)], heads=2, head_dim=256, rope_dim=128, kind="hca", fp8=True)
    with pytest.raises(ValueError, match="RoPE dims in one block"):
        sa.sparse_attention(wide.q, wide.key_sets, wide.sink, 0.1, 128, impl="triton")


@pytest.mark.parametrize("smem", [232448, 101376, 49152])
def test_plan_fits_the_shared_memory_and_the_accumulator_the_registers(smem, monkeypatch):
    """Query tile and key tile (bf16), and a split's fp32 partial result, within the device's shared memory per
    block; warps enough that the fp32 accumulator [heads, dims] takes at most 128 registers a thread (of 255)."""
    monkeypatch.setattr(sa, "shared_memory_per_block", lambda device: smem)
    monkeypatch.setattr(sa, "mma_operands_in_registers", lambda device: False)  # MMA from shared memory
    monkeypatch.setattr(sa, "mma_is_warpgroup", lambda device: False)  # sm_100-like: no exchange
    for heads, head_dim in ((64, 512), (128, 512), (4, 128)):
        plan = sa.attention_plan(torch.device("cuda"), heads, head_dim)
        assert (plan.block_h + plan.block_n) * head_dim * 2 <= smem and plan.block_h * head_dim * 4 <= smem
        # key tiles in flight only beside the tiles: their rows (bf16 at most) fit too
        in_flight = plan.stages * plan.block_n * head_dim * 2 if plan.stages > 1 else 0
        assert (plan.block_h + plan.block_n) * head_dim * 2 + in_flight <= smem
        assert plan.block_h * head_dim // (plan.num_warps * 32) <= 128
        assert plan.num_warps in (4, 8) and plan.block_h >= 16
    flash = sa.attention_plan(torch.device("cuda"), 64, 512)
    assert (flash.stages == sa.KEY_STAGES) == (smem == 232448)  # an H200 holds Flash's tiles in flight, smaller not


def test_few_tokens_take_programs_of_16_heads(monkeypatch):
    """A batch of at most SMs / SMALL_BATCH_SHARE tokens splits 64 heads over four programs, without key tiles in
    flight; larger ones keep one program and read KEY_STAGES tiles ahead."""
    monkeypatch.setattr(sa, "num_sms", lambda device: 132)
    monkeypatch.setattr(sa, "shared_memory_per_block", lambda device: 232448)
    monkeypatch.setattr(sa, "mma_operands_in_registers", lambda device: False)
    monkeypatch.setattr(sa, "mma_is_warpgroup", lambda device: False)
    device = torch.device("cuda")
    assert sa.attention_plan(device, 64, 512, tokens=1) == sa.AttentionPlan(16, 32, 4, 1)
    assert sa.attention_plan(device, 64, 512, tokens=132 // sa.SMALL_BATCH_SHARE) == sa.AttentionPlan(16, 32, 4, 1)
    assert sa.attention_plan(device, 64, 512, tokens=64) == sa.AttentionPlan(64, 32, 8, sa.KEY_STAGES)
    assert sa.attention_plan(device, 64, 512) == sa.AttentionPlan(64, 32, 8, sa.KEY_STAGES)


def test_warpgroup_mma_devices_exchange_the_probabilities_of_64_head_programs(monkeypatch):
    """Where a warpgroup issues the MMA (sm_90), programs of 64 heads over 8 warps take the exchange through memory,
    64 keys a tile, no tiles in flight (Pro's two 64-head programs a token as Flash's one); a small batch's 16-head
    programs and programs of fewer heads do not."""
    monkeypatch.setattr(sa, "num_sms", lambda device: 132)
    monkeypatch.setattr(sa, "shared_memory_per_block", lambda device: 232448)
    monkeypatch.setattr(sa, "mma_operands_in_registers", lambda device: False)
    monkeypatch.setattr(sa, "mma_is_warpgroup", lambda device: True)
    device = torch.device("cuda")
    exchanging = sa.AttentionPlan(64, 64, 8, 1, exchange=True)
    assert sa.attention_plan(device, 64, 512, tokens=8192) == exchanging
    assert sa.attention_plan(device, 128, 512, tokens=64) == exchanging
    assert sa.attention_plan(device, 64, 512, tokens=1) == sa.AttentionPlan(16, 32, 4, 1)
    assert not sa.attention_plan(device, 16, 128, tokens=8192).exchange  # 16 heads: no duplicated QK product


@pytest.mark.parametrize("smem, stages", [(166912, 2), (101376, 1)], ids=["sm80", "sm120"])
def test_register_operand_devices_take_16_heads_over_8_warps(smem, stages, monkeypatch):
    """Where the MMA reads the query tile from registers (mma.sync devices), every batch takes 16 heads a program
    over 8 warps (the plans that compile without spills there), key tiles in flight where shared memory holds them
    and the batch is not small."""
    monkeypatch.setattr(sa, "num_sms", lambda device: 108)
    monkeypatch.setattr(sa, "shared_memory_per_block", lambda device: smem)
    monkeypatch.setattr(sa, "mma_operands_in_registers", lambda device: True)
    monkeypatch.setattr(sa, "mma_is_warpgroup", lambda device: False)
    assert sa.attention_plan(torch.device("cuda"), 64, 512, 1) == sa.AttentionPlan(16, 32, 8, 1)
    assert sa.attention_plan(torch.device("cuda"), 64, 512, None) == sa.AttentionPlan(16, 32, 8, stages)


def _positions(requests):
    return torch.cat([torch.arange(context, context + new) for context, new in requests])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rope,splits", [(128, 64, 1), (128, 64, 3), (80, 16, 2), (72, 16, 1)])
def test_rotary_queries_are_finished_and_the_output_turned_back(dtype, head_dim, rope, splits):
    """RotaryQueries: the projection's q is normalised and rotated at its position in the kernel, and the output's
    RoPE pairs turned back (in the kernel, or with splits in the combining launch), as norm_rope before the
    attention and apply_rope(inverse) after it. 72 channels with 8 frequencies do not tile: the separate launches."""
    mod = _kernel()
    requests = [(40, 1), (5, 3)]
    fp8 = (head_dim - rope) % 64 == 0  # else plain rows (the FP8 entries take blocks of 64)
    case = build_case(requests, heads=4, head_dim=head_dim, rope_dim=rope, kind="csa", topk=20, fp8=fp8, seed=5)
    q = (case.q * 10.0 ** torch.randint(-2, 2, (case.q.shape[0], 4, 1))).to(dtype)
    positions = _positions(requests) * 997  # angles of large positions too
    form = ds4.kernels.norm_rope.EntryForm(None, rope_inv_freq(rope, 10000.0, 8.0, 4096), 1e-6, dtype)
    rotary = mod.RotaryQueries(form, positions)
    finished = form.reference(q, positions)
    want = mod.sparse_attention_reference(finished, case.key_sets, case.sink, 0.09, case.rope_dim)
    want = apply_rope_reference(want, positions, form.inv_freq, inverse=True)
    assert torch.equal(mod.sparse_attention_reference(q, case.key_sets, case.sink, 0.09, case.rope_dim, rotary), want)
    got = mod.sparse_attention(
        q, case.key_sets, case.sink, 0.09, case.rope_dim, impl="triton", splits=splits, rotary=rotary
    )
    assert got.dtype == dtype
    # fp32: the norm's sum in another order; bf16: that can move a query value one bf16 step (2^-8 relative)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_rotary_queries_refuse_a_form_they_do_not_take():
    case = build_case([(4, 2)], heads=2, head_dim=128, kind="hca", fp8=True)
    inv_freq = rope_inv_freq(64, 10000.0)
    positions = _positions([(4, 2)])
    for form, n in (
        (ds4.kernels.norm_rope.EntryForm(torch.ones(128), inv_freq, 1e-6, torch.float32), 2),
        (ds4.kernels.norm_rope.EntryForm(None, inv_freq, 1e-6, torch.bfloat16), 2),
        (ds4.kernels.norm_rope.EntryForm(None, inv_freq, 1e-6, torch.float32), 3),
    ):
        rotary = sa.RotaryQueries(form, positions[:n] if n <= 2 else torch.arange(n))
        with pytest.raises(ValueError, match="rotary queries"):
            sa.sparse_attention(case.q, case.key_sets, case.sink, 0.1, 64, rotary=rotary)
