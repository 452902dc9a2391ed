"""Exact top-k: the Triton kernels (through the CPU interpreter) and the torch path against torch.topk."""

import dataclasses
import inspect
import pathlib
import sys

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.topk
import ds4.kernels.topk_triton

LAYOUT_FIELDS = ("tile", "prefetch", "tau_linear", "coarse_list")


@pytest.fixture(scope="module")
def kernels():
    """ds4.kernels.topk_triton with its kernels interpreted."""
    return interpreted(ds4.kernels.topk_triton, "_scan_kernel")


@pytest.fixture(scope="module")
def topk(kernels):
    return ds4.kernels.topk


def cpu_settings(kernels, **changes):
    """The CPU's chosen settings with `changes`; the layout fields (tile, prefetch, tau_linear, coarse_list)
    change both row layouts."""
    chosen = kernels.settings_for(torch.device("cpu"))
    layout = {name: changes.pop(name) for name in LAYOUT_FIELDS if name in changes}
    return dataclasses.replace(
        chosen,
        split=dataclasses.replace(chosen.split, **layout),
        one_program=dataclasses.replace(chosen.one_program, **layout),
        **changes,
    )


def check_against_torch(scores, lengths, k, got):
    """Values equal torch.topk's as a multiset, indices valid and unique, -1 exactly past the row length."""
    for row in range(scores.shape[0]):
        n = min(int(lengths[row]), scores.shape[1])
        want = min(k, n)
        assert (got[row, want:] == -1).all()
        idx = got[row, :want].long()
        assert (idx >= 0).all() and (idx < n).all()
        assert idx.unique().numel() == want
        if want:
            expect = torch.topk(scores[row, :n], want).values
            chosen = scores[row, idx]
            assert torch.equal(chosen.sort().values.nan_to_num(), expect.sort().values.nan_to_num())
            assert torch.equal(chosen.isnan().sum(), expect.isnan().sum())


def hard_rows(cols):
    g = torch.Generator().manual_seed(cols)
    randn = torch.randn(cols, generator=g)
    equal = torch.full((cols,), 0.5)
    ten = torch.randint(0, 10, (cols,), generator=g).float()
    low_bits = torch.ones(cols).view(torch.int32) + torch.randint(0, 4, (cols,), generator=g, dtype=torch.int32)
    inf = torch.where(torch.rand(cols, generator=g) < 0.3, torch.tensor(float("inf")), randn)
    inf[::3] = float("-inf")
    zeros = torch.where(torch.rand(cols, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
    return torch.stack([randn, equal, ten, low_bits.view(torch.float32), inf, zeros])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_hard_inputs_equal_torch_topk(topk, impl):
    k, cols = 16, 2100
    scores = hard_rows(cols)
    lengths = torch.tensor([cols, cols - 1, 9000, 1, k + 1, k - 1])
    got = topk.topk_indices(scores, lengths, k, impl=impl)
    check_against_torch(scores, lengths, k, got)
    assert torch.equal(got, topk.topk_indices_reference(scores, lengths, k))


def test_rows_within_the_candidate_block_are_selected_whole(topk):
    """A row of one program no longer than the candidate block (2 k entries, at least 256) is its own candidate
    set, read once and selected in registers: every kind of hard row (ties past the places left among them),
    lengths around k, the decode shape (k 512 of 576 entries), and short rows of a wider batch (a decode step's
    block tables span more entries than its rows hold) beside a row that is not short."""
    for k, cols, lengths in (
        (16, 200, [200, 199, 17, 16, 15, 1]),
        (512, 576, [576, 575, 513, 512, 511, 0]),
        (16, 3000, [256, 255, 3000, 16, 15, 0]),
    ):
        scores = hard_rows(cols)
        lengths = torch.tensor(lengths)
        got = topk.topk_indices(scores, lengths, k, impl="triton")
        assert torch.equal(got, topk.topk_indices_reference(scores, lengths, k))
        check_against_torch(scores, lengths, k, got)


def test_triton_equals_reference_across_group_sizes_and_strides(topk):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 9000, generator=g)
    scores = base[:, 100:8700]  # row stride 9000, rows of 8600
    lengths = torch.tensor([8600, 5000, 0])
    got = topk.topk_indices(scores, lengths, 8, impl="triton")  # 8600 // 64 groups -> G = 16
    assert torch.equal(got, topk.topk_indices_reference(scores, lengths, 8))
    check_against_torch(scores, lengths, 8, got)


def test_overflowing_candidates_take_the_exact_row_path(topk):
    scores = torch.zeros(2, 3000)
    scores[0, 2000:] = 1.0  # 1000 ties at the threshold, far more than the candidate buffer holds
    scores[1, 7] = float("nan")
    lengths = torch.tensor([3000, 3000])
    got = topk.topk_indices(scores, lengths, 16, impl="triton")
    assert torch.equal(got[0], torch.arange(2000, 2016, dtype=torch.int32))
    assert torch.equal(got[1], torch.arange(0, 16, dtype=torch.int32))  # NaN at 7, then the lowest zeros


def test_nan_ranks_above_inf_and_ties_take_lowest_index(topk):
    scores = torch.tensor([[1.0, float("inf"), float("nan"), 1.0, -0.0, float("-nan"), 0.0, 1.0]])
    for impl in ("torch", "triton"):
        got = topk.topk_indices(scores, torch.tensor([8]), 5, impl=impl)
        assert got.tolist() == [[0, 1, 2, 3, 5]]  # NaN, NaN, inf, then the two lowest-index 1.0
        assert torch.topk(scores[0], 2).values.isnan().all()  # torch.topk also puts NaN first


def test_empty_batches_and_rows(topk):
    for impl in ("torch", "triton"):
        assert topk.topk_indices(torch.zeros(0, 64), torch.zeros(0), 4, impl=impl).shape == (0, 4)
        got = topk.topk_indices(torch.zeros(2, 0), torch.tensor([0, 5]), 3, impl=impl)
        assert torch.equal(got, torch.full((2, 3), -1, dtype=torch.int32))


def test_bad_arguments_fail_loudly(topk):
    with pytest.raises(ValueError):
        topk.topk_indices(torch.zeros(2, 8), torch.tensor([8, 8]), 0)
    with pytest.raises(ValueError):
        topk.topk_indices(torch.zeros(2, 8), torch.tensor([8, 8]), 4096)
    with pytest.raises(ValueError):
        topk.topk_indices(torch.zeros(2, 8, dtype=torch.float16), torch.tensor([8, 8]), 2)
    with pytest.raises(ValueError):
        topk.topk_indices(torch.zeros(8, 2).t(), torch.tensor([8, 8]), 2)


def test_kernels_take_no_shape_as_constexpr(kernels):
    allowed = {
        "G",
        "C",
        "TILE",
        "UNIT_BLOCK",
        "GM_BLOCK",
        "GATHER",
        "CAP",
        "K_PAD",
        "VEC",
        "SINGLE",
        "FUSED",
        "PREFETCH",
        "PDL",
        "TAU_LINEAR",
        "COARSE_LIST",
        "STAGGER",
    }
    for kernel in (kernels._scan_kernel, kernels._count_kernel):
        params = inspect.signature(kernel.fn).parameters.values()
        constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
        assert constexprs and constexprs <= allowed, constexprs


def test_rows_split_over_many_programs_equal_reference(topk, kernels):
    """Many programs per row: candidates joined from every split's area, including rows whose candidates
    overflow (ties) and rows shorter than one split; one program per row with small blocks; count programs
    that take several scan splits, or a whole row; tau from more maxima than fit in registers at once; rows
    too short for coarse maxima (1500: tau from the group maxima); one program a row (the 16384 tile) with
    more coarse maxima than a block."""
    scores = hard_rows(9000)
    lengths = torch.tensor([9000, 8999, 5000, 1, 17, 1500])
    for knobs in (
        dict(tile=512, programs_per_sm=8),
        dict(tile=512, programs_per_sm=8, prefetch=False),
        dict(tile=1024, programs_per_sm=1, gm_block=256, gather=128),
        dict(tile=1024, programs_per_sm=1, unit_block=32),
        dict(tile=512, programs_per_sm=8, unit_block=64, units_per_k=8),
        dict(tile=512, programs_per_sm=8, count_merge=3),
        dict(tile=512, programs_per_sm=8, count_merge=64),
        dict(tile=512, programs_per_sm=8, tau_linear=False),
        dict(tile=1024, programs_per_sm=1, tau_linear=True),
        dict(tile=512, programs_per_sm=8, coarse_list=True),
        dict(tile=1024, programs_per_sm=1, coarse_list=False),
        dict(tile=512, programs_per_sm=8, coarse_list=True, gm_block=64, units_per_k=8),
        dict(tile=16384, unit_block=32),
    ):
        scores = scores * 2.0  # the same order, other keys: a workspace left from the last call cannot pass
        got = kernels.launch(scores, lengths, 16, cpu_settings(kernels, **knobs))
        assert torch.equal(got, topk.topk_indices_reference(scores, lengths, 16))
        check_against_torch(scores, lengths, 16, got)


def test_one_finite_entry_per_coarse_group_is_exact(topk, kernels):
    """The tightest case for tau: each coarse group holds a single finite entry (the rest -inf), so exactly
    the k largest maxima are the answer and a threshold one rank too high, or a hot group skipped by the
    gather's pipeline (a few groups a step here), would lose one. Both tau paths: maxima held in registers
    (radix or linear bins), and streamed in blocks; rows split over programs, and one program a row (the
    16384 tile; tau and the hot coarse groups from one load of the maxima, or streamed)."""
    k, cols = 16, 9000
    chosen = kernels.settings_for(torch.device("cpu"))
    group = kernels._group_size(cols, k, chosen.groups_per_k)
    span = group * kernels._coarse_size(cols, k, group, 1024, chosen.units_per_k)
    g = torch.Generator().manual_seed(5)
    scores = torch.full((3, cols), float("-inf"))
    starts = torch.arange(0, cols, span)
    for row in range(3):
        scores[row, starts + torch.randint(0, span, (starts.numel(),), generator=g).clamp(max=cols - 1 - starts)] = (
            torch.randn(starts.numel(), generator=g)
        )
    lengths = torch.tensor([cols, cols - span // 2, 40 * span])
    for knobs in (
        dict(tile=1024, programs_per_sm=1, gather=64),
        dict(tile=1024, programs_per_sm=1, unit_block=16),
        dict(tile=1024, programs_per_sm=4, unit_block=16),
        dict(tile=1024, programs_per_sm=1, tau_linear=False),
        dict(tile=1024, programs_per_sm=4, tau_linear=False),
        dict(tile=1024, programs_per_sm=1, coarse_list=True),
        dict(tile=1024, programs_per_sm=4, coarse_list=True),
        dict(tile=1024, programs_per_sm=4, coarse_list=True, gm_block=32),
        dict(tile=16384, gather=64),
        dict(tile=16384, gather=64, unit_block=16),
    ):
        scores = scores * 2.0  # the same order, other keys: a workspace left from the last call cannot pass
        got = kernels.launch(scores, lengths, k, cpu_settings(kernels, **knobs))
        assert torch.equal(got, topk.topk_indices_reference(scores, lengths, k))
        check_against_torch(scores, lengths, k, got)


def test_benchmark_sweep_variants_are_exact(topk, kernels):
    """Every variant `ds4 bench kernels --all-tiles` times names real settings and stays exact, on rows split
    over programs (two rows longer than a tile) and on rows of one program each (rows of a tile or less)."""
    from ds4.bench.kernels import TOPK_VARIANTS, vary

    long_rows = hard_rows(5000)[[0, 2]]
    short_rows = hard_rows(300)[[1, 3, 4, 5]]
    chosen = kernels.settings_for(torch.device("cpu"))
    for name, changes in TOPK_VARIANTS.items():
        for batch, lengths in ((long_rows, torch.tensor([5000, 4321])), (short_rows, torch.tensor([300, 299, 9, 7]))):
            got = kernels.launch(batch, lengths, 8, vary(chosen, changes))
            assert torch.equal(got, topk.topk_indices_reference(batch, lengths, 8)), name


def test_trace_tool_patches_the_current_kernels():
    """tools/topk_trace.py edits a copy of the kernel file by its text: every edit still finds its place, and
    the copy passes a trace pointer down to the steps it stamps."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "tools"))
    try:
        import topk_trace
    finally:
        sys.path.pop(0)
    traced = topk_trace.traced_module()
    for step in (traced._count_split, traced._finish, traced._row_tau_and_hot_groups):
        assert next(iter(inspect.signature(step.fn).parameters)) == "trace"
    for kernel in (traced._scan_kernel, traced._count_kernel):
        assert next(iter(inspect.signature(kernel.fn).parameters)) == "trace_ptr"
