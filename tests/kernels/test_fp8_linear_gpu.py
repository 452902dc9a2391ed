"""FP8 linear on the GPU: device act_quant bit-exact with the torch spec, cuBLAS and the Triton kernel against
the reference over M from 1 to 8192, the Triton kernel at every Flash decode shape (bit-identical run to run and
in a CUDA graph), the small-shared-memory plan, graph replay, and a bounded JIT cache."""

import pytest
import torch

from ds4.bench.linear import SHAPES
from ds4.checkpoint.quant import fp8_block_quantize
from ds4.kernels import fp8_linear as fl

pytestmark = pytest.mark.gpu


def weights(n, k, g):
    w, s = fp8_block_quantize(torch.randn(n, k, device="cuda", generator=g) * k**-0.5, (128, 128))
    return w, s.float()


def rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_device_act_quant_is_bit_exact():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 4096, device="cuda", generator=g).to(torch.bfloat16)
    x[3] = 0  # floored amax
    x[5, :128] *= 1e4  # large groups
    x[7, 128:256] = 448.0 * 2.0**-3  # amax exactly at a power of two times 448
    q, s = fl.act_quant_triton(x)
    q_ref, s_ref = fl.act_quant(x)
    assert torch.equal(s, s_ref) and s.stride() == (1, 1000)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 7, 16, 33, 65, 1000, 8192])
@pytest.mark.parametrize("n, k", [(4096, 4096), (32768, 1024)])
def test_fp8_linear_matches_reference_over_m(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w, s = weights(n, k, g)
    want = fl.fp8_linear_reference(x, w, s, out_dtype=torch.float32)
    got = fl.fp8_linear(x, w, s)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # Same act_quant, exact products, fp32 sums in another order; the output rounds to bf16 (2^-9 relative).
    assert rel_err(got, want) < 3e-3
    assert rel_err(fl.fp8_linear(x, w, s, out_dtype=torch.float32), want) < 2e-3
    if m <= 64:
        assert rel_err(fl.fp8_linear(x, w, s, out_dtype=torch.float32, impl="triton"), want) < 1e-5


@pytest.mark.parametrize("m", [17, 1000, 8192])
def test_parts_without_the_blockwise_recipe_dequantise_both_operands(m, monkeypatch):
    """torch runs the blockwise FP8 _scaled_mm on sm_90 only: elsewhere (run here) the cuBLAS path dequantises
    act_quant's values and the weight to bf16 (exact) for one bf16 GEMM into fp32: the reference's products, fp32
    sums."""
    monkeypatch.setattr(fl, "has_blockwise_fp8_gemm", lambda device: False)
    monkeypatch.setattr(fl, "DEQUANTIZED_PIECE_BYTES", 1 << 20)  # pieces of 64 rows: several at 1000 and 8192
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w, s = weights(2048, 4096, g)
    want = fl.fp8_linear_reference(x, w, s, out_dtype=torch.float32)
    assert rel_err(fl.fp8_linear(x, w, s, out_dtype=torch.float32, impl="cublas"), want) < 1e-5


@pytest.mark.parametrize("m", [1, 8, 64, 1000])
def test_swiglu_input_matches_swiglu_then_the_linear(m):
    """The shared expert's w2 (2048 -> 4096) taking w1's and w3's outputs (row slices of one product): the kernel's
    SwiGLU + act_quant as it loads them (decode sizes), swiglu_to then cuBLAS above; against the reference."""
    g = torch.Generator(device="cuda").manual_seed(m)
    stacked = (torch.randn(m, 2 * 2048, device="cuda", generator=g) * 3).to(torch.bfloat16)
    gate, up = stacked[:, :2048], stacked[:, 2048:]
    w, s = weights(4096, 2048, g)
    h = fl.swiglu(gate, up, 10.0).to(torch.bfloat16)
    want = fl.fp8_linear_reference(h, w, s, out_dtype=torch.float32)
    got = fl.fp8_linear(gate, w, s, out_dtype=torch.float32, swiglu_up=up, swiglu_limit=10.0)
    # the Triton kernel: exact products, fp32 sums in another order; cuBLAS: as in the tests above
    assert rel_err(got, want) < (1e-5 if fl.prefers_triton(m, 4096, 2048, 1, True) else 2e-3)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_normalised_input_matches_rms_norm_then_the_linear(m):
    """wq_b taking q_a with its q_norm (1024 -> 4096 here): normalised as the M = 1 kernel loads it, rms_norm's own
    launch first elsewhere; against rms_norm then the reference."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, 1024, device="cuda", generator=g) * 3).to(torch.bfloat16)
    norm = (torch.rand(1024, device="cuda", generator=g) + 0.5, 1e-6)
    w, s = weights(4096, 1024, g)
    want = fl.fp8_linear_reference(fl.rms_norm(x, *norm), w, s, out_dtype=torch.float32)
    got = fl.fp8_linear(x, w, s, out_dtype=torch.float32, norm=norm)
    # the Triton kernels: exact products, fp32 sums in another order (at M = 1 the row's sum of squares too, which
    # may round an input the other way); cuBLAS: as in the tests above
    assert rel_err(got, want) < (1e-3 if fl.prefers_triton(m, 4096, 1024, 1, True) else 2e-3)


@pytest.mark.parametrize("m", [1, 5, 64, 300])
def test_grouped_projection_without_act_quant(m):
    """The attention's wo_a at Flash shape: 8 groups of 1024 rows over 4096 columns each, bf16 inputs."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, 8 * 4096, device="cuda", generator=g).to(torch.bfloat16)
    w, s = weights(8 * 1024, 4096, g)
    want = fl.fp8_linear_reference(x, w, s, groups=8, quantize_x=False, out_dtype=torch.float32)
    assert rel_err(fl.fp8_linear(x, w, s, groups=8, quantize_x=False), want) < 3e-3


@pytest.mark.parametrize("m", [1, 2, 5, 16, 33, 64])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_shapes_match_reference_bit_identical_and_in_graphs(shape, m):
    n, k, groups, quantize_x = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n + k)
    x = torch.randn(m, groups * k, device="cuda", generator=g).to(torch.bfloat16)
    w, s = weights(n, k, g)
    want = fl.fp8_linear_reference(x, w, s, groups, quantize_x, out_dtype=torch.float32)

    def run():
        return fl.fp8_linear(x, w, s, groups, quantize_x, out_dtype=torch.float32, impl="triton")

    got = run()
    # Exact products, fp32 sums in another order.
    assert rel_err(got, want) < 1e-5
    assert torch.equal(got, run())
    bf16 = fl.fp8_linear(x, w, s, groups, quantize_x, impl="triton")
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, got.to(torch.bfloat16))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, got)


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("shape", ["wq_b", "wo_a", "wo_b"])
def test_small_shared_memory_plan(shape, m):
    """The plan a 99 KB GPU (sm_120, GB10) would get, run on this one."""
    n, k, groups, quantize_x = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(m * 3 + n)
    x = torch.randn(m, groups * k, device="cuda", generator=g).to(torch.bfloat16)
    w, s = weights(n, k, g)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = fl.linear_plan(m, n // groups, groups, k, 2, sms=sms, smem=99 << 10)
    assert fl.shared_memory_per_block(torch.device("cuda")) > 200 << 10
    stage = plan.block_k * plan.block_n + plan.block_m * plan.block_k * 2  # fp8 weight + bf16 activations
    operands = 2 * plan.block_k * (plan.block_n + plan.block_m) if plan.use_dot else 0  # the MMA's bf16 copies
    assert plan.num_stages * stage + operands <= (99 << 10) - fl.SMEM_RESERVE
    want = fl.fp8_linear_reference(x, w, s, groups, quantize_x, out_dtype=torch.float32)
    got = fl.fp8_linear(x, w, s, groups, quantize_x, out_dtype=torch.float32, impl="triton", plan=plan)
    assert rel_err(got, want) < 1e-5


def test_graph_replay_tracks_new_inputs():
    g = torch.Generator(device="cuda").manual_seed(5)
    w, s = weights(4096, 4096, g)
    for m in (4, 256):
        x = torch.randn(m, 4096, device="cuda", generator=g).to(torch.bfloat16)
        fl.fp8_linear(x, w, s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fl.fp8_linear(x, w, s)
        x.copy_(torch.randn(m, 4096, device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fl.fp8_linear(x, w, s))


def test_many_shapes_compile_few_variants():
    g = torch.Generator(device="cuda").manual_seed(6)

    def variants():
        kernels = (fl._fp8_linear_kernel, fl._fp8_gemv_kernel)
        return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())

    before = variants()
    for m in (1, *range(2, 65, 9)):
        for n, k in ((256 + 128 * (m % 5), 300 + m), (1000 + m, 256 + 16 * m)):
            w, s = weights(n, k, g)
            fl.fp8_linear(torch.randn(m, k, device="cuda", generator=g), w, s, impl="triton")
    # tl.dot: block_m 16/32/64 x split or not x K divisible by 16 or not (strides with it); FMA: split or not x K
    # divisible by 16 or not: lengths never become constants.
    assert variants() - before <= 16
