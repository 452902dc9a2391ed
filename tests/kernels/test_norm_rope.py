"""The entries' RMSNorm + RoPE (+ FP8 form) kernel (interpreted on the CPU) against the composed torch ops it
replaces, and its FP8 bytes against quantize_kv bit for bit."""

import pytest
import torch
from entry_cases import exact_rows
from interpreted import interpreted

import ds4.kernels.fp8_kv
import ds4.kernels.norm_rope
import ds4.kernels.rmsnorm
import ds4.kernels.rope
from ds4.kernels.fp8_kv import quantize_kv
from ds4.kernels.rope import rope_inv_freq


@pytest.fixture(scope="module")
def nr():
    deps = (ds4.kernels.fp8_kv, ds4.kernels.rmsnorm, ds4.kernels.rope)
    return interpreted(ds4.kernels.norm_rope, "_norm_rope_kernel", *deps)


@pytest.mark.parametrize(
    "shape,rope,weighted,dtype",
    [((6, 80), 16, True, torch.float32), ((5, 512), 64, True, torch.bfloat16), ((3, 4, 128), 64, False, torch.bfloat16),
     ((0, 128), 64, True, torch.bfloat16)],
)  # fmt: skip
def test_matches_the_composed_ops(nr, shape, rope, weighted, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 3, shape[:1] + (1,) * (len(shape) - 1))).to(dtype)
    positions = torch.randint(0, 1 << 17, shape[:1], generator=g)
    weight = torch.rand(shape[-1], generator=g) + 0.5 if weighted else None
    form = nr.EntryForm(weight, rope_inv_freq(rope, 160000.0, 16.0, 65536), 1e-6, dtype)
    got, want = nr.norm_rope_triton(x, positions, form), form.reference(x, positions)
    assert got.shape == x.shape and got.dtype == dtype
    # The norm's fp32 sum runs in another order: an fp32 ulp, or a bf16 step where that crosses a rounding boundary.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if weighted and (shape[-1] - rope) % 64 == 0:
        fp8 = nr.EntryForm(weight, form.inv_freq, form.eps, dtype, fp8=True)
        stored = nr.norm_rope_triton(x, positions, fp8)
        assert torch.equal(stored, quantize_kv(got, rope))


@pytest.mark.parametrize("head_dim,rope", [(512, 64), (80, 16)])
def test_fp8_entries_are_bit_exact_with_quantize_kv(nr, head_dim, rope):
    g = torch.Generator().manual_seed(head_dim)
    x, weight = exact_rows(9, head_dim, rope, g)
    form = nr.EntryForm(weight, rope_inv_freq(rope, 10000.0), 0.0, torch.float32, fp8=True)
    positions = torch.zeros(9, dtype=torch.long)
    want = quantize_kv(x * weight, rope)
    assert torch.equal(form.reference(x, positions), want)  # the rows do hold what exact_rows says
    assert torch.equal(nr.norm_rope_triton(x, positions, form), want)


def test_rows_whose_rotated_pairs_are_not_aligned_take_the_reference(nr):
    """The kernel tiles the angles of the HALF rotated pairs over the row: 72 channels with 8 frequencies put the
    first rotated pair at 28, not a multiple of 8, so such rows are the reference's (norm_rope) and the kernel
    refuses them."""
    form = nr.EntryForm(None, rope_inv_freq(16, 10000.0), 1e-6, torch.float32)
    assert form.fits_kernel(80) and not form.fits_kernel(72)
    x, positions = torch.randn(3, 72), torch.arange(3)
    torch.testing.assert_close(nr.norm_rope(x, positions, form), form.reference(x, positions), rtol=0, atol=0)
    with pytest.raises(ValueError, match="do not fit"):
        nr.norm_rope_triton(x, positions, form)


@pytest.mark.parametrize("fp8", [False, True])
def test_copy_writes_each_finished_row_to_its_ring_row_and_nothing_else(nr, fp8):
    """The window ring's store in the same launch: row r of the output also lands on ring row rows[r]; the other
    ring rows keep what they held. The CPU path (norm_rope without the interpreter's kernel) writes the same."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 512, generator=g).to(torch.bfloat16)
    positions = torch.tensor([5, 130, 7, 0])
    form = nr.EntryForm(torch.rand(512, generator=g) + 0.5, rope_inv_freq(64, 10000.0), 1e-6, torch.bfloat16, fp8)
    width = form.entry_size(512)
    before = torch.randint(0, 100, (3, 6, width), generator=g).to(form.entry_dtype())
    rows = torch.tensor([7, 0, 17, 11])  # slot * 6 + row, any order
    ring = before.clone()
    got = nr.norm_rope_triton(x, positions, form, (ring, rows))
    assert torch.equal(got, nr.norm_rope_triton(x, positions, form))
    want = before.clone().view(-1, width)
    want[rows] = got
    assert torch.equal(ring.view(-1, width), want)
    cpu_ring = before.clone()
    cpu = nr.norm_rope(x, positions, form, (cpu_ring, rows))
    assert torch.equal(cpu_ring.view(-1, width)[rows], cpu) and torch.equal(
        cpu_ring.view(-1, width)[[1, 2]], want[[1, 2]]
    )
    with pytest.raises(ValueError, match="int64"):
        nr.norm_rope(x, positions, form, (ring, rows.int()))
