"""Top-k and indexer kernels on the GPU: exactness at real sizes, graph replay, bounded compilation."""

import pytest
import torch

from ds4.kernels import indexer as ix
from ds4.kernels import topk as tk
from ds4.kernels import topk_triton

pytestmark = pytest.mark.gpu

LENGTHS = [0, 1, 511, 512, 513, 8191, 8193, 32769, 262145, 1048577]


def data(kind, rows, cols, g):
    if kind == "randn":
        return torch.randn(rows, cols, device="cuda", generator=g)
    if kind == "equal":
        return torch.full((rows, cols), 0.25, device="cuda")
    if kind == "ten":
        return torch.randint(0, 10, (rows, cols), device="cuda", generator=g).float()
    if kind == "low_bits":
        bits = torch.randint(0, 8, (rows, cols), device="cuda", generator=g, dtype=torch.int32) + 0x3F800000
        return bits.view(torch.float32)
    if kind == "inf":
        x = torch.randn(rows, cols, device="cuda", generator=g)
        u = torch.rand(rows, cols, device="cuda", generator=g)
        x[u < 0.2] = float("inf")
        x[u > 0.7] = float("-inf")
        return x
    if kind == "nan":  # NaNs of both signs among randn, and a few infinities
        x = torch.randn(rows, cols, device="cuda", generator=g)
        u = torch.rand(rows, cols, device="cuda", generator=g)
        x[u < 0.001] = float("nan")
        x[u > 0.999] = -float("nan")
        x[(u > 0.5) & (u < 0.5005)] = float("inf")
        return x
    raise ValueError(kind)


KINDS = ["randn", "equal", "ten", "low_bits", "inf", "nan"]


def same_values(a, b):
    return torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


def assert_exact(scores, lengths, k, got):
    """Same values as torch.topk (multiset, row by row), indices valid, unique, and -1 exactly past the end."""
    want_ref = tk.topk_indices_reference(scores, lengths, k)
    assert torch.equal(got, want_ref)  # the canonical order of the module docstring
    n = lengths.clamp(max=scores.shape[1])
    for row in range(scores.shape[0]):
        m = min(k, int(n[row]))
        assert (got[row, m:] == -1).all()
        idx = got[row, :m].long()
        assert idx.unique().numel() == m
        if m:
            assert 0 <= int(idx.min()) and int(idx.max()) < int(n[row])
            expect = torch.topk(scores[row, : int(n[row])], m).values.sort().values
            assert same_values(scores[row, idx].sort().values, expect)  # both sorted: NaNs last on each side


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [512, 1024, 2048])
def test_exact_over_lengths(kind, k):
    g = torch.Generator(device="cuda").manual_seed(k)
    cols = max(LENGTHS)
    scores = data(kind, len(LENGTHS), cols, g)
    lengths = torch.tensor(LENGTHS, device="cuda")
    got = tk.topk_indices(scores, lengths, k)
    assert_exact(scores, lengths, k, got)
    assert torch.equal(tk.topk_indices(scores, lengths, k), got)  # deterministic


@pytest.mark.parametrize("k", [512, 2048])
def test_batches_of_one_program_a_row_are_exact(k):
    """Enough rows that each row gets one program (the scan program selects too): every kind of input, and
    lengths around k and the group sizes, in one batch."""
    g = torch.Generator(device="cuda").manual_seed(5 + k)
    rows = 4 * torch.cuda.get_device_properties(0).multi_processor_count + 8
    cols = 40000
    kinds = [data(kind, rows, cols, g) for kind in KINDS]
    scores = torch.stack([kinds[row % len(KINDS)][row] for row in range(rows)])
    lengths = torch.randint(0, cols + 1, (rows,), device="cuda", generator=g)
    lengths[: 3 * len(KINDS)] = torch.tensor([k - 1, k, k + 1], device="cuda").repeat_interleave(len(KINDS))
    lengths[3 * len(KINDS) : 4 * len(KINDS)] = cols
    lengths[-3:] = torch.tensor([0, 1, 8 * k + 3], device="cuda")
    assert_exact(scores, lengths, k, tk.topk_indices(scores, lengths, k))


@pytest.mark.parametrize("rows", [1, 64])
def test_decode_rows_within_the_candidate_block_are_exact(rows):
    """A decode step's rows (a batch of 1 or 64, k 512): rows of at most 2 k entries, selected whole by their
    one program, in a table exactly that wide and in one four times wider (the graphs' block-table buckets)."""
    g = torch.Generator(device="cuda").manual_seed(17 + rows)
    for cols in (576, 4096):
        for kind in KINDS:
            scores = data(kind, rows, cols, g)
            lengths = torch.randint(400, 1025, (rows,), device="cuda", generator=g).clamp(max=cols)
            lengths[0] = min(cols, 1024)
            assert_exact(scores, lengths, 512, tk.topk_indices(scores, lengths, 512))


def test_short_rows_batch_and_row_stride():
    g = torch.Generator(device="cuda").manual_seed(7)
    base = torch.randn(300, 20000, device="cuda", generator=g)
    scores = base[:, 37:17000]
    lengths = torch.randint(0, 17000, (300,), device="cuda", generator=g)
    lengths[:5] = torch.tensor([0, 1, 1023, 1024, 1025])
    assert_exact(scores, lengths, 1024, tk.topk_indices(scores, lengths, 1024))


def test_cuda_graph_replay_tracks_new_inputs():
    g = torch.Generator(device="cuda").manual_seed(11)
    scores = torch.randn(8, 70000, device="cuda", generator=g)
    lengths = torch.full((8,), 70000, device="cuda")
    tk.topk_indices(scores, lengths, 512)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tk.topk_indices(scores, lengths, 512)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.topk_indices(scores, lengths, 512)
    for step in range(3):
        scores.copy_(torch.randn(8, 70000, device="cuda", generator=g))
        if step == 2:
            scores[3] = 1.0  # a tie-dominated row takes the exact-row path inside the graph
        lengths.copy_(torch.randint(1, 70000, (8,), device="cuda", generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert_exact(scores, lengths, 512, out.clone())


def compiled_variants(kernels):
    total = 0
    for kernel in kernels:
        for cache in kernel.device_caches.values():
            total += len(cache[0])
    return total


def test_two_hundred_shapes_compile_few_variants():
    g = torch.Generator(device="cuda").manual_seed(13)
    kernels = [topk_triton._scan_kernel, topk_triton._count_kernel]
    before = compiled_variants(kernels)
    for i in range(200):
        rows = 1 + (i * 7) % 37
        cols = 40000 + i * 131
        stride = cols + (i % 5) * 3
        base = torch.randn(rows, stride, device="cuda", generator=g)
        scores = base[:, :cols]
        lengths = torch.randint(0, cols + 1, (rows,), device="cuda", generator=g)
        got = tk.topk_indices(scores, lengths, 512)
        if i % 50 == 0:
            assert_exact(scores, lengths, 512, got)
    new_variants = compiled_variants(kernels) - before
    assert new_variants <= 16, new_variants  # per kernel: two group sizes x aligned or not, not one per shape


def test_topk_settings_come_from_the_device():
    """The launch plan's device facts are the device's: its SMs, early count launches from sm_90 on, a register
    cap that fits programs_per_sm one-program launches in an SM's register file, and the first wave's offsets
    from the memory's peak rate (clock x bus width, as torch reports them where it does)."""
    props = torch.cuda.get_device_properties(0)
    settings = topk_triton.settings_for(torch.device("cuda", 0))
    assert settings.sms == props.multi_processor_count
    assert settings.early_count_launch == (props.major >= 9)
    one_program = settings.one_program
    assert one_program.max_registers * one_program.warps * 32 * settings.programs_per_sm == 65536
    assert settings.stagger_ns_per_byte > 0
    if getattr(props, "memory_bus_width", 0) and getattr(props, "memory_clock_rate", 0):
        peak = 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8
        assert abs(1e9 / settings.stagger_ns_per_byte / peak - 1) < 1e-6


@pytest.mark.parametrize("e4m3", [True, False], ids=["e4m3", "bytes"])
def test_indexer_logits_match_fp32_reference(e4m3, monkeypatch):
    """Decode requests (3 rows: the 4-row tile, 8 warps), prefill chunks, causal ends; `bytes`: the operands read as
    bytes and decoded to fp16, as on a part without e4m3 (sm_80), run here."""
    monkeypatch.setattr(ix, "has_fp8", lambda device: e4m3)
    g = torch.Generator(device="cuda").manual_seed(17)
    requests, n_keys, pages = 2, 3000, 48
    cache = ix.new_indexer_cache(requests * pages + 5, device="cuda")
    table = torch.randperm(requests * pages + 5, device="cuda", generator=g)[: requests * pages]
    table = table.view(requests, pages).to(torch.int32)
    for b in range(requests):
        s = torch.arange(n_keys, device="cuda")
        keys = torch.randn(n_keys, 128, device="cuda", generator=g)
        ix.write_indexer_keys(cache, table[b, s // ix.PAGE].long() * ix.PAGE + s % ix.PAGE, keys)
    for rows_per_request, causal in ((3, False), (700, False), (1024, True)):
        rows = requests * rows_per_request
        q, q_scale = ix.quantize_rows(torch.randn(rows, 64, 128, device="cuda", generator=g))
        w = torch.randn(rows, 64, device="cuda", generator=g)
        key_end = torch.randint(0, n_keys + 1, (rows,), device="cuda", generator=g)
        if causal:  # chunks ending at token 4 * n_keys: ends (t + 1) // 4, tiles past a row's end skipped
            t = torch.arange(4 * n_keys - rows_per_request, 4 * n_keys, device="cuda")
            key_end = ((t + 1) // 4).repeat(requests)
        max_keys = pages * ix.PAGE
        got = ix.indexer_logits(q, w, cache, table, key_end, rows_per_request, max_keys, q_scale=q_scale)
        want = ix.indexer_logits_reference(q, w, cache, table, key_end, rows_per_request, max_keys, q_scale)
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        err = (got[finite].double() - want[finite].double()).norm() / want[finite].double().norm()
        assert err < 5e-4, err  # fp8 tensor-core accumulation
        top = ix.indexer_topk(
            q,
            w,
            cache,
            table,
            key_end,
            rows_per_request,
            max_keys,
            512,
            q_scale=q_scale,
            max_scratch_bytes=rows * max_keys,
        )
        assert_exact(got, key_end, 512, top)
