"""The decode path (decode_only batches, the one CUDA graphs capture) equals the general path, padding rows touch
only the scratch slot and scratch page, and the path never needs the batch's values on the host."""

import contextlib
import functools

import pytest
import torch
from dsv4_tiny import CONFIGS, ds4_model, max_rel_err, official_tensors, step_batch, tiny_config, transformers_model

import ds4.model.attention
import ds4.model.indexer
from ds4.model.batch import ForwardBatch
from ds4.model.deepseek_v4 import DeepseekV4Model

PAGE, NUM_PAGES, TABLE_WIDTH = 16, 10, 5
SENTINEL = 3.25


def _cache_tensors(cache):
    """(name, tensor) of every cache tensor, so snapshots can be compared."""
    for i, layer in enumerate(cache.layers):
        yield f"{i}.window", layer.window
        for name in ("compressed", "index_keys"):
            if getattr(layer, name) is not None:
                yield f"{i}.{name}", getattr(layer, name)
        for name in ("compressor", "indexer"):
            state = getattr(layer, name)
            if state is not None:
                yield f"{i}.{name}.kv", state.kv
                yield f"{i}.{name}.score", state.score


def _sentinel(t):
    """SENTINEL as `t` stores it (the packed fp8 indexer cache holds bytes)."""
    return torch.tensor(SENTINEL).to(t.dtype)


def _slot_tensors(cache):
    return [(n, t) for n, t in _cache_tensors(cache) if not n.endswith(("compressed", "index_keys"))]


def _page_tensors(cache):
    return [(n, t) for n, t in _cache_tensors(cache) if n.endswith(("compressed", "index_keys"))]


def _padded_decode_batch(ids, positions, slots, tables, pad_rows, scratch_slot):
    """Real decode rows, then padding rows as DecodeGraphs makes them (position 0, scratch slot, -1 tables)."""
    r = len(ids)
    table = torch.full((r + pad_rows, TABLE_WIDTH), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    i32 = dict(dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.tensor(ids + [0] * pad_rows),
        positions=torch.tensor(positions + [0] * pad_rows),
        query_start_loc=torch.arange(r + pad_rows + 1, **i32),
        context_lens=torch.tensor(positions + [0] * pad_rows, **i32),
        slots=torch.tensor(slots + [scratch_slot] * pad_rows, **i32),
        block_tables=table,
        decode_only=True,
    )


# fp8 mode on the 128-dim indexer config: the packed e4m3 indexer cache and the indexer kernels' path.
@pytest.fixture(
    scope="module", params=[(n, "auto") for n in CONFIGS] + [("yarn_hc2_hca16", "fp8")], ids=lambda p: "-".join(p)
)
def model(request):
    name, kv_cache_dtype = request.param
    cfg = tiny_config(name)
    return ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype=kv_cache_dtype)


def test_padded_decode_matches_the_general_path_and_touches_only_scratch(model):
    cfg = model.cfg
    gen = torch.Generator().manual_seed(5)
    # Three requests in slots 3, 0, 2 (slot 1 unused, slot 4 the scratch slot); pages 9 (the last real page,
    # where a wrapped -1 would land without the scratch page) and 4 stay free.
    slots, scratch_slot = [3, 0, 2], 4
    tables = [torch.tensor([7, 1, 5]), torch.tensor([0, 8, -1]), torch.tensor([2, 6, 3])]
    prompt_lens = [2 * cfg.sliding_window + 3, cfg.sliding_window - 2, 21]
    decode_steps = 12
    assert all(n + decode_steps <= PAGE * int((t >= 0).sum()) for n, t in zip(prompt_lens, tables))
    ids = [torch.randint(0, cfg.vocab_size, (n + decode_steps,), generator=gen) for n in prompt_lens]

    general = model.new_cache(5, NUM_PAGES, PAGE)
    decode = model.new_cache(5, NUM_PAGES, PAGE)
    for cache in (general, decode):
        for _, t in _cache_tensors(cache):
            t.fill_(SENTINEL)
        for r in range(3):
            model(step_batch([(ids[r][: prompt_lens[r]], 0, slots[r], tables[r])]), cache)
    free_pages, free_slots = [4, 9], [1]

    for step in range(decode_steps):
        pos = [n + step for n in prompt_lens]
        tokens = [int(ids[r][pos[r]]) for r in range(3)]
        expected = model.compute_logits(
            model(step_batch([(ids[r][pos[r] : pos[r] + 1], pos[r], slots[r], tables[r]) for r in range(3)]), general)
        )
        batch = _padded_decode_batch(tokens, pos, slots, tables, pad_rows=2, scratch_slot=scratch_slot)
        got = model.compute_logits(model(batch, decode)[:3])
        # fp8: one-token and multi-token steps sum the projections in other orders (1e-7), which can move a
        # stored value across a bf16 (RoPE) or e4m3 rounding boundary: one ulp of one channel.
        tolerance = 1e-3 if model.kv_cache_dtype == "fp8" else 1e-5
        assert max_rel_err(got, expected) <= tolerance, f"decode step {step}"
        for name, t in _slot_tensors(decode):
            assert (t[free_slots] == _sentinel(t)).all(), f"{name}: padding wrote into a free slot"
        for name, t in _page_tensors(decode):
            assert (t[free_pages] == _sentinel(t)).all(), f"{name}: a write landed on a free page"


def test_a_batch_refilled_in_place_gives_what_new_batches_give(model):
    """DecodeGraphs' eager steps refill one set of tensors: what a forward derived from the batch's earlier values
    (ForwardBatch.derived) must not outlive that forward."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(6)
    slots, tables, prompt_lens = [0, 1], [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])], [cfg.sliding_window + 5, 9]
    ids = [torch.randint(0, cfg.vocab_size, (n + 3,), generator=gen) for n in prompt_lens]
    caches = [model.new_cache(3, NUM_PAGES, PAGE) for _ in range(2)]
    for cache in caches:
        for r in range(2):
            model(step_batch([(ids[r][: prompt_lens[r]], 0, slots[r], tables[r])]), cache)
    reused = None
    for step in range(3):
        pos = [n + step for n in prompt_lens]
        tokens = [int(ids[r][pos[r]]) for r in range(2)]
        fresh = _padded_decode_batch(tokens, pos, slots, tables, pad_rows=1, scratch_slot=2)
        if reused is None:
            reused = _padded_decode_batch(tokens, pos, slots, tables, pad_rows=1, scratch_slot=2)
        else:
            for name in ("input_ids", "positions", "context_lens"):
                getattr(reused, name).copy_(getattr(fresh, name))
        assert torch.equal(model(reused, caches[0]), model(fresh, caches[1])), f"decode step {step}"


def test_padding_rows_write_only_the_scratch_slot_and_page(model):
    cache = model.new_cache(3, 4, PAGE)
    for _, t in _cache_tensors(cache):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    before = {n: t.clone() for n, t in _cache_tensors(cache)}
    model(_padded_decode_batch([], [], [], [], pad_rows=4, scratch_slot=2), cache)
    for name, t in _cache_tensors(cache):
        real = slice(0, 2) if (name, t) in _slot_tensors(cache) else slice(0, 4)
        assert torch.equal(t[real], before[name][real]), f"{name}: padding changed a real slot or page"
    assert any(not torch.equal(t[2], before[n][2]) for n, t in _slot_tensors(cache))


def test_padding_rows_never_see_a_real_page(model):
    """A padding row's keys are only its own scratch window: its output does not depend on the real caches."""
    outs = []
    for seed in (1, 2):
        cache = model.new_cache(3, 4, PAGE)
        for _, t in _cache_tensors(cache):
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)))
        outs.append(model(_padded_decode_batch([], [], [], [], pad_rows=1, scratch_slot=2), cache))
    assert torch.equal(outs[0], outs[1])


@contextlib.contextmanager
def _host_syncs_forbidden():
    """Every way a forward could read tensor values on the host (a sync, or uncapturable on CUDA) raises."""

    def refuse(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"{name} in the decode path")

        return raiser

    def no_bool_index(original):
        def checked(self, index, *rest):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                raise AssertionError("boolean-mask indexing in the decode path")
            return original(self, index, *rest)

        return checked

    patches = {
        (torch.Tensor, n): refuse(f"Tensor.{n}")
        for n in (
            "item",
            "tolist",
            "numpy",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "nonzero",
            "masked_select",
        )
    }
    patches.update(
        {
            (torch, n): refuse(f"torch.{n}")
            for n in (
                "tensor",
                "as_tensor",
                "from_numpy",
                "nonzero",
                "unique",
                "bincount",
                "repeat_interleave",
                "masked_select",
            )
        }
    )
    patches[(torch.Tensor, "__getitem__")] = no_bool_index(torch.Tensor.__getitem__)
    patches[(torch.Tensor, "__setitem__")] = no_bool_index(torch.Tensor.__setitem__)
    saved = {key: getattr(*key) for key in patches}
    try:
        for (owner, name), fn in patches.items():
            setattr(owner, name, fn)
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def test_decode_forward_reads_nothing_back_to_the_host(model):
    cache = model.new_cache(3, 4, PAGE)
    prompt = torch.arange(1, 30) % model.cfg.vocab_size
    table = torch.tensor([2, 0, 3, 1])
    model(step_batch([(prompt, 0, 0, table)]), cache)
    batch = _padded_decode_batch([5], [len(prompt)], [0], [table], pad_rows=2, scratch_slot=2)
    with _host_syncs_forbidden():
        hidden = model(batch, cache)
    assert hidden.shape[0] == 3 and torch.isfinite(hidden[:1]).all()
    # The guard does catch the general path's host-side layout.
    batch.decode_only = False
    with _host_syncs_forbidden(), pytest.raises(AssertionError, match="in the decode path"):
        model(batch, cache)


@pytest.mark.parametrize("name,kv_cache_dtype", [(n, "auto") for n in CONFIGS] + [("yarn_hc2_hca16", "fp8")])
def test_decode_forward_runs_on_meta_tensors(name, kv_cache_dtype):
    """Meta tensors have shapes but no values: a host sync or a data-dependent shape would fail here."""
    model = DeepseekV4Model(tiny_config(name), torch.float32, "meta", kv_cache_dtype=kv_cache_dtype)
    cache = model.new_cache(4, 6, PAGE)
    meta = dict(device="meta")
    batch = ForwardBatch(
        torch.zeros(3, dtype=torch.long, **meta),
        torch.zeros(3, dtype=torch.long, **meta),
        torch.zeros(4, dtype=torch.int32, **meta),
        torch.zeros(3, dtype=torch.int32, **meta),
        torch.zeros(3, dtype=torch.int32, **meta),
        torch.zeros(3, 6, dtype=torch.int32, **meta),
        decode_only=True,
    )
    hidden = model(batch, cache)
    assert hidden.device.type == "meta" and hidden.shape == (3, model.cfg.hc_mult, model.cfg.hidden_size)


def test_validate_checks_what_the_decode_path_trusts():
    i32 = dict(dtype=torch.int32)
    two_tokens = ForwardBatch(
        torch.tensor([1, 2]),
        torch.tensor([5, 6]),
        torch.tensor([0, 2], **i32),
        torch.tensor([5], **i32),
        torch.zeros(1, **i32),
        torch.tensor([[0, 1]], **i32),
        decode_only=True,
    )
    with pytest.raises(ValueError, match="exactly 1 token"):
        two_tokens.validate()
    # Position 20 lives on page 1 of 16-token pages, which this table leaves unassigned. (Padding rows have
    # no pages: the check is for the batch an engine builds, before padding.)
    batch = _padded_decode_batch([3, 4], [20, 2], [0, 1], [torch.tensor([4, -1]), torch.tensor([0])], 0, 2)
    batch.validate()
    with pytest.raises(ValueError, match="page is missing"):
        batch.validate(page_size=PAGE)
    _padded_decode_batch([3, 4], [20, 2], [0, 1], [torch.tensor([4, 2]), torch.tensor([0])], 0, 2).validate(PAGE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels through the CPU interpreter")
@pytest.mark.parametrize("model", [("yarn_hc2_hca16", "fp8")], indirect=True, ids=["yarn_hc2_hca16-fp8"])
def test_fp8_decode_through_the_triton_kernels_equals_their_references(model, monkeypatch):
    """fp8 mode's decode path (the packed indexer cache, the FP8 attention cache) with the Triton kernels
    (interpreted: the indexer's decode stream kernel, the top-k, sparse attention) gives what it gives on their
    torch references, padding rows included."""
    prompt = torch.arange(1, 30) % model.cfg.vocab_size
    table = torch.tensor([2, 0, 3, 1])
    outs = []
    for patched in (False, True):
        if patched:
            for module, name in ((ds4.model.indexer, "indexer_topk"), (ds4.model.attention, "sparse_attention")):
                monkeypatch.setattr(module, name, functools.partial(getattr(module, name), impl="triton"))
        cache = model.new_cache(3, 4, PAGE)
        model(step_batch([(prompt, 0, 0, table)]), cache)
        steps = []
        for step in range(3):
            batch = _padded_decode_batch([5 + step], [len(prompt) + step], [0], [table], pad_rows=2, scratch_slot=2)
            steps.append(model(batch, cache))
        outs.append(torch.stack(steps))
    # The kernels sum in other orders (1e-7); in a later layer that can move a stored FP8 value across a rounding
    # boundary (one ulp of one channel).
    assert max_rel_err(outs[1], outs[0]) <= 1e-3
