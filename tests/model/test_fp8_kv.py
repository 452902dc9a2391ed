"""fp8 KV cache mode: the reference's e4m3 (block 64, power-of-two scales) rounding, close to but not equal to auto."""

import functools

import pytest
import torch
import torch.nn.functional as F
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, run_in_chunks, tiny_config, transformers_model

import ds4.model.indexer
from ds4.kernels.fp4_act import fp4_quant_dequant, hadamard_rotate
from ds4.kernels.fp8_kv import fp8_quant_dequant
from ds4.model.deepseek_v4 import DeepseekV4Model

E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
E4M3_VALUES = E4M3_VALUES[E4M3_VALUES.isfinite()]


def test_fp8_rounding_is_e4m3_times_a_power_of_two_per_block():
    x = torch.randn(5, 128) * torch.logspace(-3, 3, 5)[:, None]
    y = fp8_quant_dequant(x)
    for block_x, block_y in zip(x.view(-1, 64), y.view(-1, 64)):
        scale = 2.0 ** torch.ceil(torch.log2(block_x.abs().max() / 448))
        q = block_y / scale
        assert torch.isin(q, E4M3_VALUES).all()
        # Nearest e4m3 value: error at most half a step (3 mantissa bits -> relative 1/16).
        assert ((q - block_x / scale).abs() <= (block_x / scale).abs() / 16 + 2.0**-10).all()


def test_fp4_rounding_ties_to_even_and_hadamard_is_orthogonal():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3] * 4]) * 2.0  # scale 2 for amax 10
    y = fp4_quant_dequant(x) / 2.0
    assert y[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5]
    v = torch.randn(3, 64)
    assert torch.allclose(hadamard_rotate(v).norm(dim=-1), v.norm(dim=-1), rtol=1e-5)


def _on_e4m3_grid(x: torch.Tensor) -> torch.Tensor:
    """Per block of 64 channels: is every value an e4m3 value times the block's power-of-two scale?"""
    blocks = x.reshape(-1, 64)
    scale = 2.0 ** torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448))
    return torch.isin(blocks / scale, E4M3_VALUES).all(-1)


def test_fp8_mode_is_close_to_auto_and_rounds_exactly_the_reference_tensors():
    cfg = tiny_config("yarn_hc2_hca16")  # nope dims 64: fp8 allowed
    nope = cfg.nope_head_dim
    tensors = official_tensors(transformers_model(cfg))
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(4))
    logits, caches = {}, {}
    for mode in ("auto", "fp8"):
        model = ds4_model(cfg, tensors, kv_cache_dtype=mode)
        caches[mode] = model.new_cache(1, 6, 16)
        logits[mode] = run_in_chunks(model, caches[mode], ids, [len(ids)], slot=0, table=torch.arange(6))
    auto, fp8 = logits["auto"], logits["fp8"]
    # Stated bound. The tiny random model amplifies rounding through discrete choices (expert routing,
    # indexer top-k), so positions far into the sequence drift more: every position keeps cosine
    # similarity >= 0.9 with auto, the mean over positions >= 0.98; the first window stays >= 0.99.
    cos = F.cosine_similarity(fp8, auto, dim=-1)
    assert cos.min() >= 0.9 and cos.mean() >= 0.98 and cos[: cfg.sliding_window].min() >= 0.99
    assert max_rel_err(fp8, auto) >= 1e-4  # the rounding really happens

    for layer_auto, layer_fp8 in zip(caches["auto"].layers, caches["fp8"].layers):
        stores = [(layer_auto.window[0], layer_fp8.window[0])]
        if layer_fp8.compressed is not None:
            written = 70 // layer_fp8.ratio
            stores.append(
                (
                    layer_auto.compressed.view(-1, cfg.head_dim)[:written],
                    layer_fp8.compressed.view(-1, cfg.head_dim)[:written],
                )
            )
        for plain, rounded in stores:
            # fp8 mode: the non-RoPE channels of window and compressed entries are e4m3 blocks, RoPE channels not.
            assert _on_e4m3_grid(rounded[:, :nope]).all()
            assert not _on_e4m3_grid(rounded[:, nope:]).any()
            assert not _on_e4m3_grid(plain[:, :nope]).any()


def test_fp8_mode_chunked_equals_whole():
    cfg = tiny_config("yarn_hc2_hca16")
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype="fp8")
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(5))
    whole = run_in_chunks(model, model.new_cache(1, 4, 16), ids, [len(ids)], slot=0, table=torch.arange(4))
    chunked = run_in_chunks(model, model.new_cache(1, 4, 16), ids, [7, 1, 4], slot=0, table=torch.arange(4))
    assert max_rel_err(chunked, whole) <= 1e-5


def test_fp8_rejected_when_nope_dims_are_not_blocks_of_64():
    cfg = tiny_config("csa_heavy_yarn")  # head_dim 64, rope 32: 32 nope dims
    with pytest.raises(ValueError, match="multiple of the fp8 block 64"):
        DeepseekV4Model(cfg, torch.float32, kv_cache_dtype="fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels through the CPU interpreter")
def test_fp8_mode_through_the_triton_indexer_kernels_equals_their_references(monkeypatch):
    """The model's packed-cache indexer path with the Triton kernels (interpreted: prefill logits, the
    decode stream kernel, the top-k launches) gives the logits of the same path on the torch references."""
    cfg = tiny_config("yarn_hc2_hca16")
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype="fp8")
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(6))
    chunks = [29, 1, 1, 9]  # single-token chunks take the general path; decode_only batches are tested elsewhere
    reference = run_in_chunks(model, model.new_cache(1, 4, 16), ids, chunks, slot=0, table=torch.arange(4))
    for name in ("indexer_topk",):
        monkeypatch.setattr(ds4.model.indexer, name, functools.partial(getattr(ds4.model.indexer, name), impl="triton"))
    triton = run_in_chunks(model, model.new_cache(1, 4, 16), ids, chunks, slot=0, table=torch.arange(4))
    assert max_rel_err(triton, reference) <= 1e-5
