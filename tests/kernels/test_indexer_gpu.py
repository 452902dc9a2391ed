"""The indexer's query, key-write and picked-rows kernels and rotate_fp4 on CUDA at Flash shapes (64 index heads of
128, index_topk 512): to the bit against their torch references, on CUDA and on the CPU, and captured in a CUDA
graph."""

import pytest
import torch

from ds4.kernels import fp4_act
from ds4.kernels import indexer as ix
from ds4.kernels.rope import apply_rope, rope_inv_freq

pytestmark = pytest.mark.gpu
HEADS, TOPK = 64, 512


def _queries(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-20, 20, tokens * HEADS).view(tokens, HEADS, 1)  # normal numbers (see the last test)
    q = (torch.randn(tokens, HEADS, 128, generator=g) * spread).bfloat16()
    q[0, :3] = 0.0
    return q, torch.randn(tokens, HEADS, generator=g).bfloat16()


@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_queries_to_the_bit(tokens):
    q, w = _queries(tokens, tokens)
    scale = 128**-0.5 * HEADS**-0.5
    values, scaled = ix.index_queries(q.cuda(), w.cuda(), scale)
    for want_values, want_scaled in (ix.index_queries(q.cuda(), w.cuda(), scale, impl="torch"),) + (
        (ix.index_queries(q, w, scale, impl="torch"),) if tokens <= 64 else ()
    ):
        assert torch.equal(values.view(torch.uint8).cpu(), want_values.view(torch.uint8).cpu())
        assert torch.equal(scaled.cpu(), want_scaled.cpu())


@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_queries_with_rope_as_the_rope_kernel_then_the_queries(tokens):
    """RoPE inside the query launch, on heads that are a row slice of the attention's stacked projection: the bytes
    of the rope kernel (the same device sines; the compiler may fuse the rotation's multiply-adds differently,
    a last bit that can move one value's rounding) followed by the query kernel; the torch reference's cosines
    may differ in a last bit too."""
    g = torch.Generator().manual_seed(tokens)
    stacked = (torch.randn(tokens, 64 * 512 + HEADS * 128, generator=g) * 3).bfloat16().cuda()
    q = stacked[:, 64 * 512 :].view(tokens, HEADS, 128)
    w = torch.randn(tokens, HEADS, generator=g).bfloat16().cuda()
    rope = (torch.randint(0, 1 << 20, (tokens,), generator=g).cuda(), rope_inv_freq(64, 160000.0, 16.0, 65536).cuda())
    values, scaled = ix.index_queries(q, w, 0.01, rope=rope)
    two_launches = ix.index_queries(apply_rope(q, *rope), w, 0.01)
    assert (values.view(torch.uint8) == two_launches[0].view(torch.uint8)).float().mean() > 0.999
    assert (scaled == two_launches[1]).float().mean() > 0.999
    reference = ix.index_queries(q, w, 0.01, impl="torch", rope=rope)
    assert (values.view(torch.uint8) == reference[0].view(torch.uint8)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_fp4_to_the_bit(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2048, 128, generator=g) * torch.logspace(-30, 30, 2048)[:, None]).to(dtype)
    got = fp4_act.rotate_fp4_rows(x.cuda())
    assert torch.equal(got.cpu(), fp4_act.rotate_fp4_reference(x.cuda()).cpu())
    assert torch.equal(got.cpu(), fp4_act.rotate_fp4_reference(x))


def test_key_write_to_the_bit():
    g = torch.Generator().manual_seed(4)
    keys = (torch.randn(2048, 128, generator=g) * torch.logspace(-30, 30, 2048)[:, None]).bfloat16()
    keys[5] = 0.0
    slots = torch.randperm(40 * 64, generator=g)[:2048]
    cache = torch.randint(0, 256, (40, 64 * ix.ENTRY_BYTES), generator=g, dtype=torch.uint8)
    got, on_cuda = cache.cuda(), cache.cuda()
    ix.write_indexer_keys(got, slots.cuda(), keys.cuda())
    ix.write_indexer_keys(on_cuda, slots.cuda(), keys.cuda(), impl="torch")
    ix.write_indexer_keys(cache, slots, keys, impl="torch")
    assert torch.equal(got.cpu(), on_cuda.cpu()) and torch.equal(got.cpu(), cache)


@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_picked_rows(tokens):
    g = torch.Generator().manual_seed(tokens)
    tables = torch.randint(-1, 500, (64, 32), generator=g, dtype=torch.int32)
    picked = torch.randint(-1, 2048, (tokens, TOPK), generator=g, dtype=torch.int32)
    key_end = torch.randint(0, 2049, (tokens,), generator=g, dtype=torch.int32)
    requests = torch.randint(0, 64, (tokens,), generator=g)
    got = ix.entry_rows(picked.cuda(), key_end.cuda(), tables.cuda(), requests.cuda(), 64)
    assert torch.equal(got.cpu(), ix.entry_rows(picked, key_end, tables, requests, 64, impl="torch"))


def test_decode_indexer_captured_in_a_cuda_graph_tracks_new_inputs():
    """64 requests of 1 token: queries, scores, top-k and picked rows, and the key write, replayed on new inputs."""
    dev = torch.device("cuda")
    tables = torch.arange(64 * 32, dtype=torch.int32, device=dev).view(64, 32)
    cache = ix.new_indexer_cache(64 * 32 + 1, dev)
    g = torch.Generator().manual_seed(5)
    ix.write_indexer_keys(cache, torch.arange(64 * 32 * 64, device=dev), torch.randn(64 * 32 * 64, 128, device=dev))
    inputs = [t.to(dev) for t in _queries(64, 6)] + [torch.randint(0, 2049, (64,), generator=g).int().to(dev)]
    new_keys = torch.randn(64, 128, device=dev).bfloat16()
    slots = torch.arange(64, device=dev) * 64 * 32 + 7
    requests = torch.arange(64, device=dev)

    def step():
        q, w = ix.index_queries(inputs[0], inputs[1], 0.01)
        ix.write_indexer_keys(cache, slots, new_keys)
        picked = ix.indexer_topk(q, w, cache, tables, inputs[2], 1, 32 * 64, TOPK)
        return ix.entry_rows(picked, inputs[2], tables, requests, 64)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (7, 8):
        fresh = _queries(64, seed)
        inputs[0].copy_(fresh[0])
        inputs[1].copy_(fresh[1])
        inputs[2].copy_(torch.randint(0, 2049, (64,), generator=torch.Generator().manual_seed(seed)))
        new_keys.copy_(torch.randn(64, 128, device=dev))
        graph.replay()
        assert torch.equal(out, step())


def test_subnormals_to_the_bit():
    """Subnormal inputs, and keys so small that their e4m3 scale is subnormal: as the references (no flush to 0)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-45, -36, 64)[:, None]
    for dtype in (torch.bfloat16, torch.float32):
        got = fp4_act.rotate_fp4_rows(x.to(dtype).cuda())
        assert torch.equal(got.cpu(), fp4_act.rotate_fp4_reference(x.to(dtype)))
    q = x.view(1, 64, 128).bfloat16()
    w = torch.randn(1, 64, generator=g).bfloat16()
    values, scaled = ix.index_queries(q.cuda(), w.cuda(), 0.01)
    want_values, want_scaled = ix.index_queries(q, w, 0.01, impl="torch")
    assert torch.equal(values.view(torch.uint8).cpu(), want_values.view(torch.uint8)) and torch.equal(
        scaled.cpu(), want_scaled
    )
    cache = torch.zeros(2, 64 * ix.ENTRY_BYTES, dtype=torch.uint8)
    got = cache.cuda()
    ix.write_indexer_keys(got, torch.arange(64).cuda(), x.cuda())
    ix.write_indexer_keys(cache, torch.arange(64), x, impl="torch")
    assert torch.equal(got.cpu(), cache)
