"""FP8 block-scaled linear: act_quant against hand-worked values, the split-K kernel (interpreted) against the
torch reference, and the reference against a float64 product of the dequantised operands."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.fp8_linear
from ds4.checkpoint.quant import fp8_block_quantize


@pytest.fixture(scope="module")
def fp8():
    return interpreted(ds4.kernels.fp8_linear, "_gemv_kernel")


def test_act_quant_hand_example(fp8):
    x = torch.zeros(2, 256)
    # Row 0, group 0: amax 5.1 -> 5.1/448 = 0.0114 -> scale 2^-6. 5.1 * 64 = 326.4 -> 320 (e4m3 step 32 there);
    # -0.3 * 64 = -19.2 -> -20 (step 2 in [16, 32)).
    x[0, 0], x[0, 1] = 5.1, -0.3
    # Group 1: amax exactly 448 -> scale 1; 0.01 is subnormal in e4m3 (step 2^-9): 5.12 steps -> 5 * 2^-9.
    x[0, 128], x[0, 129] = 448.0, 0.01
    # Row 1, group 0 all zero: amax floored at 1e-4 -> 2.2e-7 -> scale 2^-22. Group 1: 3000/448 = 6.7 -> scale 8,
    # -3000/8 = -375 -> -384 (step 32 in [256, 448]).
    x[1, 130] = -3000.0
    q, s = fp8.act_quant(x)
    assert s.tolist() == [[2.0**-6, 1.0], [2.0**-22, 8.0]]
    assert q.dtype == torch.float8_e4m3fn
    assert q[0, 0].float().item() == 320.0 and q[0, 1].float().item() == -20.0
    assert q[0, 128].float().item() == 448.0 and q[0, 129].float().item() == 5 * 2.0**-9
    assert q[1, 130].float().item() == -384.0 and q[1, :128].float().abs().sum() == 0


def test_act_quant_partial_group_uses_its_own_columns(fp8):
    x = torch.ones(1, 130)
    x[0, 128:] = 100.0
    _, s = fp8.act_quant(x)
    assert s.tolist() == [[2.0**-8, 0.25]]  # 1/448 -> 2^-8; 100/448 = 0.223 -> 2^-2


def exact_inputs(m: int, k: int, generator) -> torch.Tensor:
    """Activations act_quant leaves unchanged: e4m3 values times a power of two per 128-group, each group's
    first element 448 (so its scale is that power of two exactly). The interpreter mis-rounds fp8 stores."""
    q = (torch.randn(m, k, generator=generator) * 80).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    q[:, ::128] = 448.0
    powers = torch.randint(-12, 4, (m, -(-k // 128)), generator=generator).float().exp2()
    return q * powers.repeat_interleave(128, 1)[:, :k]


def weights(n: int, k: int, generator):
    w, s = fp8_block_quantize(torch.randn(n, k, generator=generator) * k**-0.5, (128, 128))
    return w, s.float()


def test_reference_matches_float64_of_dequantised_operands(fp8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g)
    w, s = weights(200, 300, g)
    q, xs = fp8.act_quant(x)
    xd = q.double() * xs.double().repeat_interleave(128, 1)[:, :300]
    wd = fp8.dequantize_weight(w, s).double()
    torch.testing.assert_close(fp8.fp8_linear_reference(x, w, s), (xd @ wd.T).float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "m, n, k, groups, quantize_x",
    [
        (1, 200, 300, 1, True),
        (5, 256, 384, 1, True),
        (3, 80, 160, 2, True),
        (4, 64, 256, 4, False),
        (17, 40, 96, 1, True),
    ],
)
def test_split_k_kernel_matches_reference(fp8, m, n, k, groups, quantize_x):
    g = torch.Generator().manual_seed(m * n + k)
    # Quantisation groups restart at each projection group.
    x = exact_inputs(m * groups, k, g).view(m, -1) if quantize_x else torch.randn(m, groups * k, generator=g)
    w, s = weights(n, k, g)
    want = fp8.fp8_linear_reference(x, w, s, groups, quantize_x)
    plan = fp8.gemv_plan(m, n // groups, groups, k, 4, sms=4, smem=99 << 10)
    got = fp8.fp8_linear(x, w, s, groups, quantize_x, impl="triton", plan=plan)
    # Exact products, fp32 sums in another order.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


def test_plan_fits_shared_memory_and_fills_the_device(fp8):
    small = fp8.gemv_plan(64, 4096, 1, 4096, 2, sms=132, smem=99 << 10)
    large = fp8.gemv_plan(64, 4096, 1, 4096, 2, sms=132, smem=227 << 10)
    for plan, smem in ((small, 99 << 10), (large, 227 << 10)):
        stage = 128 * plan.block_n + plan.block_m * 128 * 2  # fp8 weight tile + bf16 activation tile
        operands = 2 * 128 * (plan.block_n + plan.block_m)  # their bf16 copies for the MMA
        assert plan.num_stages >= 2 and plan.num_stages * stage + operands <= smem
        assert plan.splits * plan.k_blocks_per_split >= 32 > (plan.splits - 1) * plan.k_blocks_per_split
        assert plan.splits * 4096 // plan.block_n >= 132  # at least one program per SM
    assert (small.block_n, small.num_stages) < (large.block_n, large.num_stages)
