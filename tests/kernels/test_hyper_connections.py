"""mHC kernels (interpreted on the CPU, tiny shapes) against their torch references: hc_pre's projection, gates,
Sinkhorn and collapse, hc_head, and hc_post's expansion; split projections, split channels and collapse programs
of several tokens give the same."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.hyper_connections
from ds4.kernels.rmsnorm import rms_norm_reference

# fp32 sums in another order: the gates and comb agree to this; bf16 outputs to one bf16 step.
FP32_TOL = dict(rtol=1e-5, atol=1e-6)
BF16_TOL = dict(rtol=2**-7, atol=1e-6)
BF16_TWO_STEPS = dict(rtol=2**-6, atol=1e-6)


@pytest.fixture(scope="module")
def mhc():
    return interpreted(ds4.kernels.hyper_connections, "_projection_kernel")


def weights(hc: int, d: int, rows: int, g: torch.Generator):
    fn = torch.randn(rows, hc * d, generator=g) * (hc * d) ** -0.5
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(rows, generator=g) * 0.5
    return fn, scale, base


def split_plan(mhc, k: int):
    """A plan that splits the projection of k flattened channels four ways and each token's channels in blocks
    of 16 over two programs."""
    per_split = -(-k // 64)
    return mhc.Plan(
        block_t=16,
        block_k=16,
        splits=-(-k // (16 * per_split)),
        k_blocks_per_split=per_split,
        stages=1,
        block_d=16,
        parts=2,
    )


def shared_plan(mhc, k: int):
    """A plan whose collapse programs take four tokens each, in steps of 16 channels."""
    return mhc.Plan(
        block_t=16, block_k=16, splits=1, k_blocks_per_split=-(-k // 16), stages=1, block_d=16, parts=1,
        collapse_tokens=4,
    )  # fmt: skip


PLANS = {"default": lambda mhc, k: None, "split": split_plan, "shared": shared_plan}


@pytest.mark.parametrize("hc,d,tokens", [(4, 64, 1), (4, 40, 21), (2, 64, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", ["default", "split", "shared"])
def test_hc_pre_matches_reference(mhc, hc, d, tokens, dtype, split):
    g = torch.Generator().manual_seed(hc * d + tokens)
    streams = torch.randn(tokens, hc, d, generator=g).to(dtype)
    fn, scale, base = weights(hc, d, (2 + hc) * hc, g)
    launch = PLANS[split](mhc, hc * d)
    x, post, comb = mhc.hc_pre_triton(streams, fn, scale, base, hc, 20, 1e-6, 1e-6, launch=launch)
    want_x, want_post, want_comb = mhc.hc_pre_reference(streams, fn, scale, base, hc, 20, 1e-6, 1e-6)
    assert x.dtype == dtype and post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(post, want_post, **FP32_TOL)
    torch.testing.assert_close(comb, want_comb, **FP32_TOL)
    torch.testing.assert_close(x.float(), want_x.float(), **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


def test_one_sinkhorn_step_normalises_the_columns_only(mhc):
    """iters = 1 stops after the first column normalisation: without eps the columns sum to 1."""
    g = torch.Generator().manual_seed(3)
    streams = torch.randn(6, 4, 32, generator=g)
    fn, scale, base = weights(4, 32, 24, g)
    _, _, comb = mhc.hc_pre_triton(streams, fn, scale * 4, base, 4, 1, 0.0, 1e-6)
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(6, 4), rtol=0, atol=1e-6)
    assert (comb.sum(dim=2) - 1).abs().max() > 1e-3
    torch.testing.assert_close(comb, mhc.hc_pre_reference(streams, fn, scale * 4, base, 4, 1, 0.0, 1e-6)[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", ["default", "split", "shared"])
def test_hc_head_matches_reference(mhc, dtype, split):
    g = torch.Generator().manual_seed(11)
    streams = torch.randn(9, 4, 64, generator=g).to(dtype)
    fn, scale, base = weights(4, 64, 4, g)
    scale = scale[:1]
    launch = PLANS[split](mhc, 256)
    got = mhc.hc_head_triton(streams, fn, scale, base, 1e-6, 1e-6, launch=launch)
    want = mhc.hc_head_reference(streams, fn, scale, base, 1e-6, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


@pytest.mark.parametrize("hc,d,block_d", [(4, 40, 16), (2, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_reference(mhc, hc, d, block_d, dtype):
    g = torch.Generator().manual_seed(d)
    tokens = 7
    streams = torch.randn(tokens, hc, d, generator=g).to(dtype)
    out = torch.randn(tokens, d, generator=g).to(dtype)
    post = torch.rand(tokens, hc, generator=g) * 2
    comb = torch.rand(tokens, hc, hc, generator=g)
    got = mhc.hc_post_triton(out, streams, post, comb, block_d=block_d)
    want = mhc.hc_post_reference(out, streams, post, comb)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **(FP32_TOL if dtype == torch.float32 else BF16_TOL))


@pytest.mark.parametrize(
    "hc,d,tokens,block_d,collapse_d",
    # the last: Flash's decode launch on a 132-SM part (4 x 4096 streams, 32 channels a program, 128 programs)
    [(4, 64, 1, 16, 4096), (4, 40, 3, 16, 4096), (2, 64, 4, None, 4096), (4, 72, 2, 16, 32), (4, 4096, 1, 32, 4096)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_pre_in_one_launch_matches_the_references(mhc, hc, d, tokens, block_d, collapse_d, dtype):
    """A few tokens' hc_post, the next hc_pre and its sub-layer's RMSNorm in one launch (programs a block of
    channels, the last to arrive collapsing and normalising, whole rows or collapse_d channels at a time):
    hc_post_reference, then hc_pre_reference of its streams, then rms_norm_reference; the arrival counter is left
    at zero."""
    g = torch.Generator().manual_seed(hc * d + tokens)
    streams = torch.randn(tokens, hc, d, generator=g).to(dtype)
    out = torch.randn(tokens, d, generator=g).to(dtype)
    post = torch.rand(tokens, hc, generator=g) * 2
    comb = torch.rand(tokens, hc, hc, generator=g)
    fn, scale, base = weights(hc, d, (2 + hc) * hc, g)
    norm = torch.rand(d, generator=g) + 0.5
    got = mhc.hc_post_pre_triton(
        out, streams, post, comb, fn, scale, base, norm, hc, 20, 1e-6, 1e-6, block_d=block_d, collapse_d=collapse_d
    )  # fmt: skip
    new = mhc.hc_post_reference(out, streams, post, comb)
    x, next_post, next_comb = mhc.hc_pre_reference(new, fn, scale, base, hc, 20, 1e-6, 1e-6)
    want = (new, rms_norm_reference(x, norm, 1e-6), next_post, next_comb)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert got[0].dtype == got[1].dtype == dtype
    torch.testing.assert_close(got[0].float(), want[0].float(), **tol)
    # the normalised input: the collapse's rounding (one step, see above) and the norm's
    torch.testing.assert_close(got[1].float(), want[1].float(), **(tol if dtype == torch.float32 else BF16_TWO_STEPS))
    torch.testing.assert_close(got[2], want[2], **FP32_TOL)
    torch.testing.assert_close(got[3], want[3], **FP32_TOL)
    assert not mhc.arrival_counters(streams.device).any()


def test_hc_post_pre_takes_a_few_tokens_only(mhc):
    fn, scale, base = weights(4, 16, 24, torch.Generator().manual_seed(0))
    tokens = mhc.POST_PRE_TOKENS + 1
    streams, out = torch.zeros(tokens, 4, 16), torch.zeros(tokens, 16)
    post, comb = torch.zeros(tokens, 4), torch.zeros(tokens, 4, 4)
    with pytest.raises(ValueError, match="tokens"):
        mhc.hc_post_pre_triton(out, streams, post, comb, fn, scale, base, torch.ones(16), 4, 20, 1e-6, 1e-6)


def test_no_tokens(mhc):
    fn, scale, base = weights(4, 16, 24, torch.Generator().manual_seed(0))
    x, post, comb = mhc.hc_pre_triton(torch.zeros(0, 4, 16), fn, scale, base, 4, 20, 1e-6, 1e-6)
    assert x.shape == (0, 16) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert mhc.hc_post_triton(torch.zeros(0, 16), torch.zeros(0, 4, 16), post, comb).shape == (0, 4, 16)


def test_rejects_strided_streams(mhc):
    fn, scale, base = weights(4, 16, 24, torch.Generator().manual_seed(0))
    streams = torch.zeros(3, 16, 4).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        mhc.hc_pre_triton(streams, fn, scale, base, 4, 20, 1e-6, 1e-6)


def test_plan_shares_collapse_programs_only_among_spare_tokens(mhc):
    """Flash's streams (4 x 4096) on 132 SMs: a decode batch splits each token's channels over programs; a
    prefill chunk puts several tokens in a program, as many as leave COLLAPSE_WAVES programs an SM."""
    decode = mhc.plan(64, 4 * 4096, 4096, 32, 2, sms=132, smem=227 << 10)
    assert decode.parts > 1 and decode.collapse_tokens == 1 and decode.block_d == mhc.CHANNEL_BLOCK
    prefill = mhc.plan(8192, 4 * 4096, 4096, 32, 2, sms=132, smem=227 << 10)
    assert prefill.parts == 1 and prefill.collapse_tokens == 8
    assert -(-8192 // prefill.collapse_tokens) >= mhc.COLLAPSE_WAVES * 132
    assert prefill.collapse_tokens * prefill.block_d == mhc.COLLAPSE_TILE
