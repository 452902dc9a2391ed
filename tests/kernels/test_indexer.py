"""Indexer logits over the paged fp8 key cache: the Triton kernel (interpreted) against an fp64 oracle."""

import pytest
import torch
from interpreted import interpreted

import ds4.kernels.indexer
import ds4.kernels.topk
import ds4.kernels.topk_triton
from ds4.kernels.fp4_act import fp4_quant_dequant, hadamard_rotate


@pytest.fixture(scope="module")
def indexer():
    return interpreted(ds4.kernels.indexer, "_indexer_logits_kernel", ds4.kernels.topk_triton)


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
