"""Indexer logits over the paged fp8 key cache: the Triton kernel (interpreted) against an fp64 oracle; the query,
key-write and picked-rows kernels against their torch references to the bit."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.fp4_act
import ds4.kernels.indexer
import ds4.kernels.rope
import ds4.kernels.topk
import ds4.kernels.topk_triton
from ds4.kernels.fp4_act import fp4_quant_dequant, hadamard_rotate
from ds4.kernels.rope import apply_rope_reference, rope_inv_freq

E4M3_GRID = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_GRID = E4M3_GRID[E4M3_GRID.isfinite()].unique()


@pytest.fixture(scope="module")
def indexer():
    return interpreted(
        ds4.kernels.indexer, "_indexer_logits_kernel", ds4.kernels.fp4_act, ds4.kernels.topk_triton, ds4.kernels.rope
    )


def paged_keys(indexer, requests, keys_per_request, pages_per_request, generator, per_page=None):
    """A cache holding random keys for each request on shuffled pages, and the full-precision keys."""
    per_page = per_page or indexer.PAGE
    total_pages = requests * pages_per_request + 3
    cache = indexer.new_indexer_cache(total_pages, entries_per_page=per_page)
    order = torch.randperm(total_pages, generator=generator)[: requests * pages_per_request]
    table = order.view(requests, pages_per_request).to(torch.int32)
    keys = torch.randn(requests, keys_per_request, 128, generator=generator)
    for b in range(requests):
        s = torch.arange(keys_per_request)
        slots = table[b, s // per_page].long() * per_page + s % per_page
        indexer.write_indexer_keys(cache, slots, keys[b])
    return cache, table, keys


def oracle(q, q_scale, w, keys_fp8, k_scale, key_end):
    """fp64 score over the dequantised operands, written independently of the module."""
    qd = q.double() * q_scale.double()[..., None]
    kd = keys_fp8.double() * k_scale.double()[:, None]
    s = torch.einsum("rhd,sd->rhs", qd, kd).clamp_min(0)
    out = torch.einsum("rh,rhs->rs", w.double(), s)
    visible = torch.arange(kd.shape[0])[None, :] < key_end[:, None]
    return torch.where(visible, out, torch.tensor(float("-inf"), dtype=torch.float64))


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("rows_per_request", [2, 70])
def test_logits_match_fp64_oracle(indexer, impl, rows_per_request):
    g = torch.Generator().manual_seed(rows_per_request)
    requests, n_keys, heads = (3, 150, 4) if rows_per_request == 2 else (1, 200, 2)
    cache, table, _ = paged_keys(indexer, requests, n_keys, 4, g)
    rows = requests * rows_per_request
    q, q_scale = indexer.quantize_rows(torch.randn(rows, heads, 128, generator=g))
    w = torch.randn(rows, heads, generator=g)
    key_end = torch.randint(0, n_keys + 1, (rows,), generator=g)
    key_end[0] = n_keys
    max_keys = 4 * indexer.PAGE
    got = indexer.indexer_logits(q, w, cache, table, key_end, rows_per_request, max_keys, q_scale=q_scale, impl=impl)
    vectors, scales = indexer.cache_views(cache)
    for b in range(requests):
        pages = table[b].long()
        r = slice(b * rows_per_request, (b + 1) * rows_per_request)
        want = oracle(q[r], q_scale[r], w[r], vectors[pages].reshape(-1, 128), scales[pages].reshape(-1), key_end[r])
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got[r]), finite)
        err = (got[r][finite].double() - want[finite]).norm() / want[finite].norm()
        assert err < 1e-5, err


def check_against_oracle(indexer, got, q, q_scale, w, cache, table, key_end, rows_per_request):
    vectors, scales = indexer.cache_views(cache)
    for b in range(q.shape[0] // rows_per_request):
        r = slice(b * rows_per_request, (b + 1) * rows_per_request)
        pages = table[b].long()
        want = oracle(q[r], q_scale[r], w[r], vectors[pages].reshape(-1, 128), scales[pages].reshape(-1), key_end[r])
        want = want[:, : got.shape[1]]
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got[r]), finite)
        assert torch.all(got[r][~finite] == float("-inf"))  # no NaN poison left unwritten
        if finite.any():
            err = (got[r][finite].double() - want[finite]).norm() / want[finite].norm()
            assert err < 1e-5, err


@pytest.mark.parametrize("tile", [(64, 16, 4, 2), (128, 4, 8, 3)])
def test_tiles_skip_rows_that_see_no_key_of_the_tile(indexer, tile):
    """Several key tiles and query blocks: causal ends (rows below a tile's keys take no dot product),
    shuffled ends (live rows not contiguous in a block), and decode-like requests of 1 + 2 draft rows."""
    g = torch.Generator().manual_seed(tile[0] + tile[1])
    n_keys, max_keys, heads = 250, 4 * indexer.PAGE, 3
    causal = torch.arange(40) * 5 + 7
    cases = [
        (1, 40, causal),
        (1, 40, causal[torch.randperm(40, generator=g)]),
        (4, 3, torch.tensor([[0, 0, 0], [63, 64, 65], [127, 128, 129], [248, 249, 250]]).flatten()),
    ]
    for requests, rows_per_request, key_end in cases:
        cache, table, _ = paged_keys(indexer, requests, n_keys, 4, g)
        rows = requests * rows_per_request
        q, q_scale = indexer.quantize_rows(torch.randn(rows, heads, 128, generator=g))
        w = torch.randn(rows, heads, generator=g)
        got = torch.full((rows, max_keys), float("nan"))
        indexer._launch(q, w * q_scale, cache, table, key_end, rows_per_request, max_keys, got, tile)
        check_against_oracle(indexer, got, q, q_scale, w, cache, table, key_end, rows_per_request)


@pytest.mark.parametrize("rows_per_request", [1, 2, 3, 4])
def test_decode_kernel_streams_keys_past_each_requests_rows(indexer, rows_per_request):
    """The decode kernel: a request's rows (1 + MTP drafts) with their own ends (none, on tile and page
    boundaries, the last key), several key tiles per program and several programs per request."""
    g = torch.Generator().manual_seed(rows_per_request)
    requests, n_keys, max_keys, heads = 3, 250, 4 * indexer.PAGE, 3
    cache, table, _ = paged_keys(indexer, requests, n_keys, 4, g)
    rows = requests * rows_per_request
    q, q_scale = indexer.quantize_rows(torch.randn(rows, heads, 128, generator=g))
    w = torch.randn(rows, heads, generator=g)
    ends = torch.tensor([0, 1, 63, 64, 65, 127, 128, 200, 249, 250, 17, 96])
    key_end = ends[torch.randperm(len(ends), generator=g)][:rows]
    got = torch.full((rows, max_keys), float("nan"))
    indexer._launch_decode(q, w * q_scale, cache, table, key_end, rows_per_request, max_keys, got, (32, 3, 4, 2))
    check_against_oracle(indexer, got, q, q_scale, w, cache, table, key_end, rows_per_request)


@pytest.mark.parametrize("rows_per_request", [1, 40])
def test_e4m3_read_as_bytes_on_devices_without_e4m3(indexer, rows_per_request, monkeypatch):
    """sm_80 to sm_88 have no e4m3: both kernels (a decode request, a prefill chunk) read q and the keys as bytes
    and decode them (every code: subnormals, both signs, zero) to the same scores, against the oracle."""
    monkeypatch.setattr(indexer, "has_fp8", lambda device: False)
    g = torch.Generator().manual_seed(rows_per_request)
    requests, n_keys, heads = 2, 200, 3
    cache, table, _ = paged_keys(indexer, requests, n_keys, 4, g)
    vectors, _ = indexer.cache_views(cache)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # no NaN
    first_keys = vectors.view(torch.uint8)[table[0, 0].long(), :2]  # request 0's keys 0 and 1: every code
    first_keys.copy_(torch.cat([codes, torch.zeros(256 - len(codes), dtype=torch.uint8)]).view(2, 128))
    rows = requests * rows_per_request
    q, q_scale = indexer.quantize_rows(torch.randn(rows, heads, 128, generator=g))
    picks = torch.randint(0, len(codes), (heads, 128), generator=g)
    q.view(torch.uint8)[0] = codes[picks]
    w = torch.randn(rows, heads, generator=g)
    key_end = torch.full((rows,), n_keys)
    max_keys = 4 * indexer.PAGE
    got = indexer.indexer_logits(
        q, w, cache, table, key_end, rows_per_request, max_keys, q_scale=q_scale, impl="triton"
    )
    check_against_oracle(indexer, got, q, q_scale, w, cache, table, key_end, rows_per_request)


@pytest.mark.parametrize("per_page", [4, 16])
def test_caches_with_other_page_sizes(indexer, per_page):
    """A cache of E entries a page (the model's page_size // ratio): both kernels and the reference."""
    g = torch.Generator().manual_seed(per_page)
    n_keys, max_keys, heads = 90, 96, 2
    pages = max_keys // per_page
    for rows_per_request, tile, launch in (
        (1, (32, 2, 4, 2), indexer._launch_decode),
        (20, (32, 8, 4, 2), indexer._launch),
    ):
        cache, table, _ = paged_keys(indexer, 2, n_keys, pages, g, per_page)
        rows = 2 * rows_per_request
        q, q_scale = indexer.quantize_rows(torch.randn(rows, heads, 128, generator=g))
        w = torch.randn(rows, heads, generator=g)
        key_end = torch.randint(0, n_keys + 1, (rows,), generator=g)
        got = torch.full((rows, max_keys), float("nan"))
        launch(q, w * q_scale, cache, table, key_end, rows_per_request, max_keys, got, tile)
        check_against_oracle(indexer, got, q, q_scale, w, cache, table, key_end, rows_per_request)
        ref = indexer.indexer_logits(
            q, w, cache, table, key_end, rows_per_request, max_keys, q_scale=q_scale, impl="torch"
        )
        check_against_oracle(indexer, ref, q, q_scale, w, cache, table, key_end, rows_per_request)


def test_quantised_keys_stay_close_to_the_originals(indexer):
    g = torch.Generator().manual_seed(3)
    cache, table, keys = paged_keys(indexer, 1, 100, 2, g)
    vectors, scales = indexer.cache_views(cache)
    pages = table[0].long()
    back = (vectors[pages].float() * scales[pages][..., None]).reshape(-1, 128)[:100]
    assert (back - keys[0]).norm() / keys[0].norm() < 0.05


def test_mxfp4_rounded_vectors_are_stored_exactly(indexer):
    """fp8 KV mode rounds indexer keys to MXFP4 (power-of-two block scales); the e4m3 cache holds those
    values without further loss, over magnitudes far apart."""
    g = torch.Generator().manual_seed(9)
    size = torch.logspace(-3, 3, 64)[:, None]
    keys = fp4_quant_dequant(hadamard_rotate((torch.randn(64, 128, generator=g) * size).bfloat16())).float()
    cache = indexer.new_indexer_cache(1)
    indexer.write_indexer_keys(cache, torch.arange(64), keys)
    vectors, scales = indexer.cache_views(cache)
    assert torch.equal(vectors[0].float() * scales[0][:, None], keys)


def test_topk_with_bounded_scratch_equals_whole_matrix(indexer):
    g = torch.Generator().manual_seed(5)
    n_keys, rows = 180, 40
    cache, table, _ = paged_keys(indexer, 1, n_keys, 3, g)
    q, q_scale = indexer.quantize_rows(torch.randn(rows, 2, 128, generator=g))
    w = torch.randn(rows, 2, generator=g)
    key_end = (torch.arange(rows) * 4 + 4) // 4 + 140  # causal-style growing ends
    max_keys = 3 * indexer.PAGE
    logits = indexer.indexer_logits(q, w, cache, table, key_end, rows, max_keys, q_scale=q_scale, impl="torch")
    want = ds4.kernels.topk.topk_indices(logits, key_end, 16, impl="torch")
    for impl in ("torch", "triton"):
        got = indexer.indexer_topk(
            q,
            w,
            cache,
            table,
            key_end,
            rows,
            max_keys,
            16,
            q_scale=q_scale,
            impl=impl,
            max_scratch_bytes=7 * max_keys * 4,
        )
        assert torch.equal(got, want)


def test_bad_layouts_fail_loudly(indexer):
    cache = indexer.new_indexer_cache(2)
    q = torch.zeros(2, 4, 128).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError):
        indexer.indexer_logits(
            q.float(), torch.zeros(2, 4), cache, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([1, 1]), 2, 128
        )
    with pytest.raises(ValueError):
        indexer.indexer_logits(
            q, torch.zeros(2, 4), cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1, 1]), 2, 128
        )


def test_query_kernel_equals_the_reference_to_the_bit(indexer):
    """Rotation, MXFP4 and per-head e4m3 of q after RoPE, the head weights scaled: bf16 over magnitudes far apart
    (normal ones: the interpreter's bf16 casts mishandle subnormals), a zero head, 5 heads (not a power of two)."""
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(3, 5, 128, generator=g) * torch.logspace(-20, 20, 15).view(3, 5, 1)).bfloat16()
    q[1, 2] = 0.0
    weights = torch.randn(3, 5, generator=g).bfloat16()
    scale = 128**-0.5 * 5**-0.5
    values, w = indexer.index_queries(q, weights, scale, impl="triton")
    want_values, want_w = indexer.index_queries(q, weights, scale, impl="torch")
    assert values.dtype == torch.float8_e4m3fn and values.shape == q.shape and w.shape == (3, 5)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(w, want_w)
    # the reference: MXFP4 values held exactly, their power-of-two scale moved into the weights
    rounded = fp4_quant_dequant(hadamard_rotate(q)).float()
    head_scale = want_w / (weights.float() * scale)
    assert torch.equal(want_values.float() * head_scale[..., None], rounded)


def test_query_kernel_rounds_fp32_head_weights_to_the_queries_dtype(indexer):
    """weights_proj's fp32 product goes in as it is: the launch rounds it to q's dtype (bf16), as the reference
    model's weights_proj output, before the scales (no launch of its own for the rounding)."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 128, generator=g).bfloat16()
    weights = torch.randn(2, 4, generator=g)  # fp32, not bf16 values
    values, w = indexer.index_queries(q, weights, 0.25, impl="triton")
    want_values, want_w = indexer.index_queries(q, weights, 0.25, impl="torch")
    assert torch.equal(w, want_w) and torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    _, from_bf16 = indexer.index_queries(q, weights.bfloat16(), 0.25, impl="torch")
    assert torch.equal(want_w, from_bf16) and not torch.equal(weights.bfloat16().float(), weights)


@pytest.mark.parametrize("rope_dim", [64, 16])
def test_query_kernel_turns_rope_first(indexer, rope_dim):
    """rope=(positions, inv_freq): the heads (a row slice of a wider projection, as the attention's stacked wq_b
    gives them) are turned in the kernel before the rounding, as apply_rope then index_queries: the same bytes
    (the interpreter's sines and cosines are numpy's fp32 ones, torch's here)."""
    g = torch.Generator().manual_seed(rope_dim)
    stacked = (torch.randn(3, 2 * 64 + 5 * 128, generator=g) * 4).bfloat16()
    q = stacked[:, 128:].view(3, 5, 128)
    weights = torch.randn(3, 5, generator=g).bfloat16()
    rope = (torch.tensor([7, 1000, 65000]), rope_inv_freq(rope_dim, 10000.0))
    values, w = indexer.index_queries(q, weights, 0.1, impl="triton", rope=rope)
    want_values, want_w = indexer.index_queries(q, weights, 0.1, impl="torch", rope=rope)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(w, want_w)
    plain = indexer.index_queries(apply_rope_reference(q, *rope), weights, 0.1, impl="torch")
    assert torch.equal(want_values.view(torch.uint8), plain[0].view(torch.uint8)) and torch.equal(want_w, plain[1])


def test_key_write_kernel_stores_the_reference_bytes(indexer):
    """Keys over magnitudes far apart (subnormal scales too), zero and -0 keys, and rows of amax 448 (scale 1)
    holding every e4m3 value and every midpoint between neighbours (ties to the even code), on shuffled slots
    of a cache of 8 entries a page; every byte of the cache compared, the untouched ones too."""
    g = torch.Generator().manual_seed(12)
    grid = E4M3_GRID[E4M3_GRID >= 0]
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, -(grid[1:] + grid[:-1]) / 2])
    points = torch.cat([points, torch.full((-len(points) % 127,), 448.0)]).view(-1, 127)
    exact = torch.cat([points, torch.full((points.shape[0], 1), 448.0)], 1)
    keys = torch.cat([torch.randn(30, 128, generator=g) * torch.logspace(-42, 30, 30)[:, None], exact])
    keys[4], keys[5] = 0.0, -0.0
    slots = torch.randperm(6 * 8, generator=g)[: keys.shape[0]]
    want = torch.randint(0, 256, (6, 8 * indexer.ENTRY_BYTES), generator=g, dtype=torch.uint8)
    got = want.clone()
    indexer.write_indexer_keys(got, slots, keys, impl="triton")
    indexer.write_indexer_keys(want, slots, keys, impl="torch")
    assert torch.equal(got, want)
    vectors, scales = indexer.cache_views(want)
    stored = vectors.flatten(0, 1)[slots[30:]].float()
    assert torch.equal(scales.flatten()[slots[30:]], torch.ones(exact.shape[0]))
    assert torch.equal(stored, exact.to(torch.float8_e4m3fn).float())


def test_picked_rows_kernel_equals_the_reference_and_hand_values(indexer):
    tables = torch.tensor([[3, -1, 5], [0, 1, 7]], dtype=torch.int32)
    picked = torch.tensor([[0, 9, 17, 19, -1], [2, 8, 23, 24, 5]], dtype=torch.int32)
    key_end = torch.tensor([19, 30], dtype=torch.int32)
    # 8 entries a page: 0 -> page 3; 9 on the -1 page; 17 -> page 5, slot 1; 19 at the token's end; 24 past the table
    want = torch.tensor([[24, -1, 41, -1, -1], [2, 8, 63, -1, 5]])
    for impl in ("torch", "triton"):
        assert torch.equal(indexer.entry_rows(picked, key_end, tables, torch.tensor([0, 1]), 8, impl=impl), want)
    g = torch.Generator().manual_seed(13)
    picked = torch.randint(-1, 40, (9, 1500), generator=g, dtype=torch.int32)
    key_end = torch.randint(0, 40, (9,), generator=g, dtype=torch.int32)
    requests = torch.randint(0, 2, (9,), generator=g)
    got = indexer.entry_rows(picked, key_end, tables, requests, 8, impl="triton")
    assert torch.equal(got, indexer.entry_rows(picked, key_end, tables, requests, 8, impl="torch"))
