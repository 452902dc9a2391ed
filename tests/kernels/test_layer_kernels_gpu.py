"""mHC, RMSNorm, RoPE and gated-pooling kernels on the GPU at DeepSeek-V4 Flash shapes (hc 4, hidden 4096, 64
heads of 512 with 64 RoPE dims, compressor ratios 4 and 128) against their torch references on the same device,
graph replay equal to eager, one compilation over many token counts.

Tolerances: the gates and comb to 1e-5 (fp32 sums of 16384 products in another order; measured ~1e-6), the
bf16 outputs to one bf16 step (an fp32 value that lands near a rounding boundary may round the other way)."""

import pytest
import torch

from ds4.kernels import gated_pool, rmsnorm, rope
from ds4.kernels import hyper_connections as mhc

pytestmark = pytest.mark.gpu

HC, D = 4, 4096
GATE_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=2**-7, atol=1e-5)


@pytest.fixture(autouse=True)
def ieee_fp32_matmul():
    """The reference's fp32 projection in full fp32 (not TF32), as on the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def weights(rows: int, g: torch.Generator, scales: int = 3):
    fn = torch.randn(rows, HC * D, device="cuda", generator=g) * (HC * D) ** -0.5
    scale = torch.rand(scales, device="cuda", generator=g) + 0.5
    base = torch.randn(rows, device="cuda", generator=g) * 0.5
    return fn, scale, base


def streams(tokens: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(tokens, HC, D, device="cuda", generator=g).to(dtype)


@pytest.mark.parametrize(
    "tokens,dtype", [(1, torch.bfloat16), (3, torch.bfloat16), (64, torch.bfloat16), (64, torch.float32),
                     (1000, torch.bfloat16), (8192, torch.bfloat16)]
)  # fmt: skip
def test_hc_pre_and_post_match_reference(tokens, dtype):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    h = streams(tokens, dtype, g)
    fn, scale, base = weights((2 + HC) * HC, g)
    x, post, comb = mhc.hc_pre(h, fn, scale, base, HC, 20, 1e-6, 1e-6)
    want_x, want_post, want_comb = mhc.hc_pre_reference(h, fn, scale, base, HC, 20, 1e-6, 1e-6)
    torch.testing.assert_close(post, want_post, **GATE_TOL)
    torch.testing.assert_close(comb, want_comb, **GATE_TOL)
    torch.testing.assert_close(x.float(), want_x.float(), **BF16_TOL)
    out = torch.randn(tokens, D, device="cuda", generator=g).to(dtype)
    got = mhc.hc_post(out, h, post, comb)
    want = mhc.hc_post_reference(out, h, post, comb)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)


@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_hc_head_matches_reference(tokens):
    g = torch.Generator(device="cuda").manual_seed(7 + tokens)
    h = streams(tokens, torch.bfloat16, g)
    fn, scale, base = weights(HC, g, scales=1)
    got = mhc.hc_head(h, fn, scale, base, 1e-6, 1e-6)
    want = mhc.hc_head_reference(h, fn, scale, base, 1e-6, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)


def test_graph_replay_equals_eager():
    g = torch.Generator(device="cuda").manual_seed(1)
    h = streams(64, torch.bfloat16, g)
    out = torch.randn(64, D, device="cuda", generator=g).to(torch.bfloat16)
    fn, scale, base = weights((2 + HC) * HC, g)
    head_fn, head_scale, head_base = weights(HC, g, scales=1)
    norm_weight = torch.randn(D, device="cuda", generator=g).to(torch.bfloat16)

    def step():
        x, post, comb = mhc.hc_pre(h, fn, scale, base, HC, 20, 1e-6, 1e-6)
        new = mhc.hc_post(rmsnorm.rms_norm(x, norm_weight, 1e-6) + out, h, post, comb)
        return mhc.hc_head(new, head_fn, head_scale, head_base, 1e-6, 1e-6)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    h.copy_(streams(64, torch.bfloat16, g))
    graph.replay()
    assert torch.equal(captured, step())


def test_one_compilation_over_token_counts():
    kernels = (
        mhc._projection_kernel,
        mhc._collapse_kernel,
        mhc._expand_kernel,
        rmsnorm._rms_norm_kernel,
        rope._rope_kernel,
        gated_pool._gated_pool_kernel,
    )

    def variants():
        return [sum(len(cache[0]) for cache in kernel.device_caches.values()) for kernel in kernels]

    g = torch.Generator(device="cuda").manual_seed(2)
    fn, scale, base = weights((2 + HC) * HC, g)
    inv_freq = rope.rope_inv_freq(64, 10000.0).cuda()
    before = variants()
    for tokens in list(range(1, 40)) + [63, 65, 127, 1000, 4097]:
        h = streams(tokens, torch.bfloat16, g)
        x, post, comb = mhc.hc_pre(h, fn, scale, base, HC, 20, 1e-6, 1e-6)
        mhc.hc_post(x, h, post, comb)
        rmsnorm.rms_norm(x, None, 1e-6)
        rope.apply_rope(x, torch.arange(tokens, device="cuda"), inv_freq)
        rows = torch.randint(0, tokens, (tokens, 8), device="cuda", generator=g)
        gated_pool.gated_pool(x[:, :1024].float(), x[:, 1024:2048].float(), rows, True)
    added = [after - start for after, start in zip(variants(), before)]
    assert added[0] <= 2 and max(added[1:]) <= 1, added  # the projection: a small- and a large-batch token tile


@pytest.mark.parametrize(
    "shape,weighted", [((1, 4096), True), ((8192, 4096), True), ((64, 64, 512), False), ((5, 1024), True),
                       ((3, 7168), True)]
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_reference(shape, weighted, dtype):
    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(dtype)
    weight = (torch.randn(shape[-1], device="cuda", generator=g) + 1).to(torch.bfloat16) if weighted else None
    got = rmsnorm.rms_norm(x, weight, 1e-6)
    want = rmsnorm.rms_norm_reference(x, weight, 1e-6)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("shape", [(1, 64, 512), (64, 64, 512), (8192, 512), (3, 64, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_reference(shape, dtype, inverse):
    g = torch.Generator(device="cuda").manual_seed(shape[0])
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    positions = torch.randint(0, 1 << 20, (shape[0],), device="cuda", generator=g)
    for inv_freq in (rope.rope_inv_freq(64, 10000.0), rope.rope_inv_freq(64, 160000.0, 16.0, 65536)):
        inv_freq = inv_freq.cuda()
        got = rope.apply_rope(x, positions, inv_freq, inverse)
        want = rope.apply_rope_reference(x, positions, inv_freq, inverse)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize(
    "ratio,overlap,head_dim,entries",
    [(4, True, 512, 1), (4, True, 512, 2048), (4, True, 128, 64), (128, False, 512, 64)],
)
def test_gated_pool_matches_reference(ratio, overlap, head_dim, entries):
    g = torch.Generator(device="cuda").manual_seed(ratio + entries)
    width, span = (2 if overlap else 1) * head_dim, (2 if overlap else 1) * ratio
    sources = entries * ratio + 2 * ratio
    kv = torch.randn(sources, width, device="cuda", generator=g)
    score = torch.randn(sources, width, device="cuda", generator=g) * 3
    score[-1] = float("-inf")
    rows = torch.randint(0, sources, (entries, span), device="cuda", generator=g)
    rows[0, : span // 2] = sources - 1
    got = gated_pool.gated_pool(kv, score, rows, overlap)
    want = gated_pool.gated_pool_reference(kv, score, rows, overlap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
