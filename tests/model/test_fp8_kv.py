"""fp8 KV cache mode: the reference's e4m3 (block 64, power-of-two scales) entries, stored as bytes; close to bf16."""

import functools

import pytest
import torch
import torch.nn.functional as F
from dsv4_tiny import ds4_model, max_rel_err, official_tensors, run_in_chunks, tiny_config, transformers_model

import ds4.model.indexer
from ds4.kernels.fp4_act import fp4_quant_dequant, hadamard_rotate
from ds4.kernels.fp8_kv import dequantize_kv, fp8_quant_dequant, quantize_kv
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


def _official_entry_bytes(kv: torch.Tensor, rope: int) -> torch.Tensor:
    """The reference's FP8 KV entry written from the model doc and the official act_quant (round_scale): per
    block of 64 non-RoPE channels amax = max(|x|, 1e-4), scale exponent = ceil(log2(amax * fp32(1/448))) taken
    from the fp32 bits, x / scale clamped to +-448 and rounded to the nearest e4m3 value (ties to an even
    mantissa, found by searching the code table); then the bf16 RoPE channels, the exponent bytes (+127) and
    zero padding to a multiple of 8 (ds4's one-row entry; 584 bytes for 448 + 64 channels)."""
    codes = torch.arange(128, dtype=torch.uint8)
    table = codes.view(torch.float8_e4m3fn).float()
    codes, table = codes[table.isfinite()], table[table.isfinite()]
    rows = []
    for x in kv.float():
        nope = x[:-rope].view(-1, 64)
        amax = (nope.abs().amax(-1).clamp_min(1e-4) * torch.tensor(1 / 448, dtype=torch.float32)).view(torch.int32)
        exponent = ((amax >> 23) & 0xFF) - 127 + ((amax & 0x7FFFFF) != 0).int()
        y = (nope / torch.exp2(exponent.float())[:, None]).clamp(-448, 448).flatten()
        gap = (y.abs()[:, None] - table[None, :]).abs()
        best = gap.min(-1, keepdim=True).values
        tied = gap == best
        even = tied & (codes[None, :] % 2 == 0)
        pick = torch.where(even.any(-1), even.int().argmax(-1), tied.int().argmax(-1))
        magnitude = codes[pick] | torch.where(y < 0, 0x80, 0).to(torch.uint8)
        rope_bytes = x[-rope:].bfloat16().view(torch.uint8)
        raw = torch.cat([magnitude, rope_bytes, (exponent + 127).to(torch.uint8)])
        rows.append(torch.cat([raw, torch.zeros(-len(raw) % 8, dtype=torch.uint8)]))
    return torch.stack(rows)


def test_fp8_cache_entries_are_bit_exact_with_the_official_quantisation():
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(12, 512, generator=gen) * torch.logspace(-6, 4, 12)[:, None]
    kv[0, :64] = 0  # amax floor
    kv[1, :64] = torch.linspace(-448, 448, 64) * 2.0**-3  # amax exactly 448 * 2^-3: scale 2^-3, no rounding up
    kv[2, 64:128] = 2.0**-20 * torch.arange(64)  # tiny values under the floor's scale: e4m3 subnormals
    kv[3, 128:192] = torch.tensor([0.5 + 1 / 32, 0.5 + 3 / 32] * 32) * 2.0**-8  # ties between e4m3 values
    kv = kv.bfloat16()
    stored = quantize_kv(kv, 64)
    assert stored.shape == (12, 584) and stored.dtype == torch.uint8
    assert torch.equal(stored, _official_entry_bytes(kv, 64))
    back = dequantize_kv(stored, 512, 64, torch.float32)
    assert torch.equal(back[:, 448:], kv[:, 448:].float())
    assert torch.equal(back[:, :448], fp8_quant_dequant(kv[:, :448].float()))
    small = torch.randn(3, 128, generator=gen)  # head_dim 128 = 64 + 64 RoPE: 64 + 128 + 1 -> 200 bytes
    assert torch.equal(quantize_kv(small, 64), _official_entry_bytes(small, 64))


def test_fp8_mode_is_close_to_bf16_and_stores_the_reference_entries():
    cfg = tiny_config("yarn_hc2_hca16")  # nope dims 64: fp8 allowed
    tensors = official_tensors(transformers_model(cfg))
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(4))
    logits, caches = {}, {}
    for mode in ("bf16", "fp8"):
        model = ds4_model(cfg, tensors, kv_cache_dtype=mode)
        caches[mode] = model.new_cache(1, 6, 16)
        logits[mode] = run_in_chunks(model, caches[mode], ids, [len(ids)], slot=0, table=torch.arange(6))
    plain, fp8 = logits["bf16"], logits["fp8"]
    # Stated bound. The tiny random model amplifies rounding through discrete choices (expert routing,
    # indexer top-k), so positions far into the sequence drift more: every position keeps cosine
    # similarity >= 0.9 with the unquantised cache, the mean over positions >= 0.98; the first window >= 0.99.
    cos = F.cosine_similarity(fp8, plain, dim=-1)
    assert cos.min() >= 0.9 and cos.mean() >= 0.98 and cos[: cfg.sliding_window].min() >= 0.99
    assert max_rel_err(fp8, plain) >= 1e-4  # the rounding really happens

    rope = cfg.qk_rope_head_dim
    for layer_plain, layer_fp8 in zip(caches["bf16"].layers, caches["fp8"].layers):
        stores = [(layer_plain.window[0], layer_fp8.window[0])]
        if layer_fp8.compressed is not None:
            written = 70 // layer_fp8.ratio
            stores.append(
                (layer_plain.compressed.flatten(0, 1)[:written], layer_fp8.compressed.flatten(0, 1)[:written])
            )
        for values, stored in stores:
            assert stored.dtype == torch.uint8 and values.dtype == torch.float32
            back = dequantize_kv(stored, cfg.head_dim, rope, torch.float32)
            # e4m3 values times one power of two per block of 64, bf16 RoPE channels, near the plain values (the
            # two runs' states drift apart as their logits do: within 25% in norm).
            nope = back[:, :-rope].reshape(-1, 64)
            scale = torch.exp2(stored[:, cfg.head_dim - rope + 2 * rope].float() - 127).repeat_interleave(
                (cfg.head_dim - rope) // 64
            )
            assert torch.isin(nope / scale[:, None], E4M3_VALUES).all()
            assert torch.equal(back[:, -rope:], back[:, -rope:].bfloat16().float())
            assert (back - values).norm() <= 0.25 * values.norm()


def test_fp8_mode_chunked_equals_whole():
    cfg = tiny_config("yarn_hc2_hca16")
    model = ds4_model(cfg, official_tensors(transformers_model(cfg)), kv_cache_dtype="fp8")
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(5))
    whole = run_in_chunks(model, model.new_cache(1, 4, 16), ids, [len(ids)], slot=0, table=torch.arange(4))
    chunked = run_in_chunks(model, model.new_cache(1, 4, 16), ids, [7, 1, 4], slot=0, table=torch.arange(4))
    # Chunks of other sizes sum the projections in another order (1e-7); that can move a stored value across
    # a bf16 (RoPE) or e4m3 rounding boundary, one ulp of one channel: 2e-4 seen.
    assert max_rel_err(chunked, whole) <= 1e-3


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
