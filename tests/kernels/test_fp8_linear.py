"""FP8 block-scaled linear: act_quant against hand-worked values, the Triton kernel (interpreted: FMA and tl.dot,
split and whole K, grouped, tiles across scale blocks, K tails, several row tiles) against the torch reference,
its launch plans, and the reference against a float64 product of the dequantised operands."""

from dataclasses import replace

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.fp8_kv
import ds4.kernels.fp8_linear
import ds4.kernels.norm_rope
import ds4.kernels.rmsnorm
import ds4.kernels.rope
import ds4.kernels.swiglu
from ds4.checkpoint.quant import fp8_block_quantize


@pytest.fixture(scope="module")
def fp8():
    deps = (ds4.kernels.fp8_kv, ds4.kernels.rmsnorm, ds4.kernels.rope, ds4.kernels.norm_rope, ds4.kernels.swiglu)
    return interpreted(ds4.kernels.fp8_linear, "_fp8_linear_kernel", *deps)


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
    "m, n, k, groups, quantize_x, use_dot",
    [
        (1, 200, 300, 1, True, False),  # FMA, K tail inside a 512 chunk, split K
        (1, 256, 1024, 2, False, False),  # FMA, grouped without act_quant, split K
        (1, 64, 256, 4, True, False),  # FMA, weight scales per row (groups of 16 rows in one 128-row block)
        (1, 64, 300, 4, True, False),  # FMA, weight scales per row, K tail
        (5, 256, 384, 1, True, True),  # tl.dot, split K
        (3, 80, 160, 2, True, True),  # tl.dot, 40-row groups: a tile crosses weight scale blocks
        (4, 64, 256, 4, False, True),
        (17, 40, 96, 1, True, True),
        (70, 48, 256, 1, True, True),  # two row tiles of 64
    ],
)
def test_triton_kernel_matches_reference(fp8, m, n, k, groups, quantize_x, use_dot):
    g = torch.Generator().manual_seed(m * n + k)
    # Quantisation groups restart at each projection group.
    x = exact_inputs(m * groups, k, g).view(m, -1) if quantize_x else torch.randn(m, groups * k, generator=g)
    w, s = weights(n, k, g)
    want = fp8.fp8_linear_reference(x, w, s, groups, quantize_x)
    plan = fp8.linear_plan(m, n // groups, groups, k, 4, sms=4, smem=99 << 10, use_dot=use_dot)
    got = fp8.fp8_linear(x, w, s, groups, quantize_x, impl="triton", plan=plan)
    # Exact products, fp32 sums in another order.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    # The last program of each tile resets its arrival counter for the next launch.
    assert plan.use_dot == use_dot and not fp8.arrival_counters(x.device).any()


@pytest.mark.parametrize(
    "n, k, groups, quantize_x",
    [(200, 1300, 1, True), (64, 1300, 1, True), (256, 1024, 2, False), (64, 300, 4, True)],  # K tail, split K,
)  # grouped without act_quant, row scales
def test_prefetching_gemv_matches_the_plain_loads(fp8, n, k, groups, quantize_x):
    """The M = 1 kernel loading the next chunk's weights ahead computes what it computes without: the reference's
    values, the same sums in the same order (bit-identical), over several chunks a split and partial last chunks."""
    g = torch.Generator().manual_seed(n + k)
    x = exact_inputs(groups, k, g).view(1, -1) if quantize_x else torch.randn(1, groups * k, generator=g)
    w, s = weights(n, k, g)
    tiles = fp8.TileSettings(block_n=64, block_k=256, programs_per_sm=1, max_stages=1, num_warps=4)
    plain = fp8.linear_plan(1, n // groups, groups, k, 4, sms=2, smem=99 << 10, tiles=tiles, use_dot=False)
    ahead = fp8.linear_plan(
        1, n // groups, groups, k, 4, sms=2, smem=99 << 10, tiles=replace(tiles, prefetch=True), use_dot=False
    )
    assert ahead.prefetch and not plain.prefetch and ahead.chunks_per_split > 1
    assert ahead.splits > 1 or n != 64 or k != 1300
    got = fp8.fp8_linear(x, w, s, groups, quantize_x, impl="triton", plan=ahead)
    assert torch.equal(got, fp8.fp8_linear(x, w, s, groups, quantize_x, impl="triton", plan=plain))
    want = fp8.fp8_linear_reference(x, w, s, groups, quantize_x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("m, use_dot", [(1, False), (5, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_input_is_the_gate_and_up_activation(fp8, m, use_dot, dtype):
    """swiglu_up: the kernel's input is swiglu(x, up) in x's dtype, computed as it loads them (the shared expert's
    w2 takes w1's and w3's outputs so); gate and up may be row slices of one buffer. Without act_quant here: the
    interpreter does not round e4m3 as the GPU does (the GPU test runs the model's act_quant'ed form)."""
    g = torch.Generator().manual_seed(m)
    k = 256
    stacked = (torch.randn(m, 2 * k, generator=g) * 4).to(dtype)
    gate, up = stacked[:, :k], stacked[:, k:]
    w, s = weights(128, k, g)
    plan = fp8.linear_plan(m, 128, 1, k, stacked.element_size(), sms=4, smem=99 << 10, use_dot=use_dot)
    args = dict(swiglu_up=up, swiglu_limit=7.0, out_dtype=torch.float32)  # the interpreter truncates bf16 stores
    got = fp8.fp8_linear(gate, w, s, 1, False, impl="triton", plan=plan, **args)
    want = fp8.fp8_linear_reference(fp8.swiglu(gate, up, 7.0).to(dtype), w, s, 1, False, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8.fp8_linear(gate, w, s, 1, False, impl="torch", **args), want)
    with pytest.raises(ValueError, match="SwiGLU"):
        fp8.fp8_linear(gate, w, s, swiglu_up=stacked)


@pytest.mark.parametrize("m, use_dot", [(1, False), (5, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalised_input_is_the_rms_norm_of_x(fp8, m, use_dot, dtype):
    """norm: the kernel's input is rms_norm(x, weight, eps) in x's dtype, normalised as the M = 1 kernel loads it
    (wq_b takes q_a so, its q_norm fused in), by rms_norm first for tl.dot; K split over programs (each sums the
    whole row's squares) and a K tail. Without act_quant, as the SwiGLU test above."""
    g = torch.Generator().manual_seed(m)
    k = 320  # two chunks of 256 columns, the second partial
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    norm = (torch.rand(k, generator=g) + 0.5, 1e-6)
    w, s = weights(128, k, g)
    plan = fp8.linear_plan(m, 128, 1, k, x.element_size(), sms=8, smem=99 << 10, use_dot=use_dot)
    assert plan.splits > 1
    args = dict(norm=norm, out_dtype=torch.float32)  # the interpreter truncates bf16 stores
    got = fp8.fp8_linear(x, w, s, 1, False, impl="triton", plan=plan, **args)
    want = fp8.fp8_linear_reference(fp8.rms_norm(x, *norm), w, s, 1, False, torch.float32)
    # the sum of squares in another order: an inverse one ulp apart may round a bf16 input the other way
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fp8.fp8_linear(x, w, s, 1, False, impl="torch", **args), want)
    unnormalised = fp8.fp8_linear_reference(x, w, s, 1, False, torch.float32)
    assert not torch.allclose(got, unnormalised, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="normalised"):
        fp8.fp8_linear(x, w, s, norm=(norm[0][:-1], 1e-6))


def test_split_runs_are_bit_identical_and_write_the_output_dtype(fp8):
    g = torch.Generator().manual_seed(3)
    x = exact_inputs(2, 512, g)
    w, s = weights(128, 512, g)
    plan = fp8.linear_plan(2, 128, 1, 512, 4, sms=8, smem=99 << 10)
    assert plan.splits > 1
    first = fp8.fp8_linear(x, w, s, impl="triton", plan=plan)
    assert torch.equal(first, fp8.fp8_linear(x, w, s, impl="triton", plan=plan)) and first.dtype == torch.float32


def test_plans_fit_shared_memory_and_fill_the_device(fp8):
    for m in (1, 16, 64):
        small = fp8.linear_plan(m, 4096, 1, 4096, 2, sms=132, smem=99 << 10)
        large = fp8.linear_plan(m, 4096, 1, 4096, 2, sms=132, smem=227 << 10)
        assert small.use_dot == large.use_dot == next(row[1] for row in fp8.TILE_TABLE if m <= row[0])
        for plan, smem in ((small, 99 << 10), (large, 227 << 10)):
            stage = plan.block_k * plan.block_n + plan.block_m * plan.block_k * 2  # fp8 weight + bf16 activations
            operands = 2 * plan.block_k * (plan.block_n + plan.block_m) if plan.use_dot else 0  # MMA's bf16 copies
            assert plan.num_stages * stage + operands <= smem - fp8.SMEM_RESERVE
            chunks = 4096 // plan.block_k
            assert plan.splits * plan.chunks_per_split >= chunks > (plan.splits - 1) * plan.chunks_per_split
            tiles = -(-4096 // plan.block_n) * -(-m // plan.block_m)
            assert plan.splits * tiles >= 132  # at least one program per SM
            # fp32 partials (written and read) stay a small share of the weight's bytes
            assert plan.splits == 1 or 2 * 4 * plan.splits * plan.block_m * 4096 <= 4096 * 4096
    # Wide rows fill the device without splitting K.
    assert fp8.linear_plan(1, 32768, 1, 1024, 2, sms=132, smem=227 << 10).splits == 1


def test_weights_asked_early_stay_within_the_budget_and_the_split(fp8):
    """The M = 1 kernel launched early asks for its first chunks: all programs' chunks together within the budget
    (wo_b at M = 1: 64 rows x 256 columns a chunk, 448 programs, 7.3 MB a chunk of all), never past its split."""
    plan = fp8.linear_plan(1, 4096, 1, 8192, 2, sms=132, smem=227 << 10)
    grid = (4096 // plan.block_n, 1, plan.splits)
    per_chunk = plan.block_n * plan.block_k * grid[0] * grid[2]
    for budget in (0, per_chunk - 1, per_chunk, 3 * per_chunk + 5, 1 << 40):
        chunks = fp8.chunks_asked_early(plan, grid, budget)
        assert chunks * per_chunk <= budget and chunks <= plan.chunks_per_split
        assert chunks == plan.chunks_per_split or (chunks + 1) * per_chunk > budget  # as many as fit


def test_auto_takes_triton_at_decode_sizes_and_cublas_where_it_is_faster(fp8):
    assert fp8.prefers_triton(1, 32768, 1024, 1, True)  # M = 1: the Triton kernel at every size
    assert fp8.prefers_triton(16, 1536, 4096, 1, True)  # 6 MB of weight (attention's wq_a + wkv)
    assert not fp8.prefers_triton(16, 2048, 4096, 1, True)  # 8 MB: cuBLAS from M = 2
    assert not fp8.prefers_triton(16, 32768, 1024, 1, True)  # 32 MB: cuBLAS from M = 2
    assert fp8.prefers_triton(64, 512, 4096, 1, True) and not fp8.prefers_triton(65, 512, 4096, 1, True)
    assert fp8.prefers_triton(128, 8 * 1024, 4096, 8, False)  # grouped: cuBLAS does not fit
    assert fp8.prefers_triton(4, 200, 300, 1, True)  # partial blocks: cuBLAS does not fit
    # off sm_90 (no blockwise recipe: cuBLAS dequantises the weight per call) decode sizes stay with the kernel
    assert fp8.prefers_triton(16, 32768, 1024, 1, True, blockwise=False)
    assert not fp8.prefers_triton(17, 32768, 1024, 1, True, blockwise=False)


@pytest.mark.parametrize("n, k", [(256, 640), (384, 128)])
def test_weight_dequantization_kernel_matches_the_reference(fp8, n, k):
    """The cuBLAS path's one-pass dequantisation (whole 128 x 128 blocks) equals dequantize_weight exactly: e4m3
    values times powers of two are exact in bf16."""
    g = torch.Generator().manual_seed(n + k)
    w, s = weights(n, k, g)
    s = s * torch.randint(-3, 4, s.shape, generator=g).float().exp2()
    got = fp8._dequantize_aligned(w, s, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, fp8.dequantize_weight(w, s).to(torch.bfloat16))


def test_grouped_projection_over_the_dequantised_weight_matches_the_reference(fp8):
    """Without act_quant, above CUBLAS_MIN_M_DEQUANTIZED rows: the weight dequantised once, a GEMM batched over the
    groups written in [M, groups, rows] order (wo_a's path at prefill)."""
    g = torch.Generator().manual_seed(11)
    m, groups, rows, k = fp8.CUBLAS_MIN_M_DEQUANTIZED + 3, 2, 128, 256
    w, s = weights(groups * rows, k, g)
    x = torch.randn(m, groups * k, generator=g).bfloat16()
    got = fp8.fp8_linear(x, w, s, groups, quantize_x=False, out_dtype=torch.float32, impl="cublas")
    want = fp8.fp8_linear_reference(x, w, s, groups, quantize_x=False, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # bf16 products summed as the GEMM rounds them
