"""The bench's byte and FLOP counts against counts made by hand from a small config's fields."""

import math

import pytest

from ds4.bench import roofline
from ds4.config import load_config

# Layer 0: sliding window only, hash-routed. Layer 1: CSA (ratio 4, indexer). Layer 2: HCA (ratio 8). Then MTP.
SMALL = dict(
    vocab_size=1000,
    hidden_size=256,
    num_hidden_layers=3,
    compress_ratios=[0, 4, 8, 0],
    num_attention_heads=2,
    head_dim=128,
    qk_rope_head_dim=64,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=64,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=128,
    num_hash_layers=1,
    sliding_window=16,
    hc_mult=2,
    quantization_config=dict(quant_method="fp8", fmt="e4m3", scale_fmt="ue8m0", weight_block_size=[128, 128]),
    expert_dtype="fp4",
)

# By hand, in bytes. FP8 linear [out, in]: out * in + one scale byte per 128x128 block.
# MXFP4 expert [out, in]: out * in / 2 + out * in / 32. bf16 2 B, fp32 4 B, int32 4 B.
FP8 = {  # name: (out, in) -> bytes
    "wq_a": 128 * 256 + 1 * 2,
    "wq_b": 256 * 128 + 2 * 1,
    "wkv": 128 * 256 + 1 * 2,
    "wo_a": 128 * 128 + 1 * 1,  # [o_groups * o_lora_rank, heads * head_dim / o_groups]
    "wo_b": 256 * 128 + 2 * 1,
}
ATTENTION = sum(FP8.values()) + 128 * 2 + 128 * 2 + 2 * 4  # + q_norm, kv_norm (bf16), attn_sink (fp32)
# Compressor of width w pooling `ratio` tokens: ape [ratio, w] fp32, wkv and wgate [w, 256] bf16, norm [128] bf16.
CSA_COMPRESSOR = 4 * 256 * 4 + 2 * 256 * 256 * 2 + 128 * 2  # overlapping: w = 2 * 128
HCA_COMPRESSOR = 8 * 128 * 4 + 2 * 128 * 256 * 2 + 128 * 2  # w = 128
INDEXER = (512 * 128 + 4 * 1) + 4 * 256 * 2 + CSA_COMPRESSOR  # wq_b fp8 [4 * 128, 128], weights_proj bf16 [4, 256]
EXPERT = 2 * (128 * 256 // 2 + 128 * 256 // 32) + (256 * 128 // 2 + 256 * 128 // 32)  # w1, w3 [128, 256]; w2
SHARED = 2 * (128 * 256 + 1 * 2) + (256 * 128 + 2 * 1)
ROUTER = 8 * 256 * 2  # gate.weight bf16
TID2EID = 1000 * 2 * 4
BIAS = 8 * 4
MHC = 2 * ((8 * 512 + 8 + 3) * 4)  # two sites: fn [(2 + hc) * hc, hc * D], base, scale (fp32); hc = 2
NORMS = 2 * 256 * 2
LAYER_DENSE = [
    ATTENTION + ROUTER + TID2EID + SHARED + MHC + NORMS,
    ATTENTION + CSA_COMPRESSOR + INDEXER + ROUTER + BIAS + SHARED + MHC + NORMS,
    ATTENTION + HCA_COMPRESSOR + ROUTER + BIAS + SHARED + MHC + NORMS,
]
EMBED = HEAD = 1000 * 256 * 2
TOP = EMBED + HEAD + 256 * 2 + (2 * 512 + 2 + 1) * 4  # + final norm, hc_head fn / base / scale


@pytest.fixture
def cfg():
    return load_config(dict(SMALL))


def test_checkpoint_bytes_match_the_hand_count(cfg):
    ck = roofline.checkpoint_bytes(cfg)
    assert ck.expert == EXPERT
    assert ck.layer_experts == (8 * EXPERT,) * 3
    assert ck.layers == tuple(dense + 8 * EXPERT for dense in LAYER_DENSE)
    assert ck.top == TOP
    assert ck.total == TOP + sum(LAYER_DENSE) + 3 * 8 * EXPERT


@pytest.mark.parametrize("batch", [1, 3, 64])
def test_decode_bytes_match_the_hand_count(cfg, batch):
    context, kv_entry, index_entry = 40, 256, 132
    got = roofline.decode_bytes(cfg, batch, context, kv_entry, index_entry)
    # The hash layer reads `batch` rows of its tid2eid, not the table; the embedding `batch` rows.
    dense = sum(LAYER_DENSE) - TID2EID + batch * 2 * 4 + TOP - HEAD - EMBED + batch * 256 * 2
    touched = 8 * (1 - (6 / 8) ** batch)  # P(an expert is not among a token's 2 of 8) = 6/8
    # The token at position 40 sees 16 window keys in every layer; CSA: top-8 of 41 // 4 = 10 entries, all 10
    # indexer keys; HCA: all 41 // 8 = 5 entries.
    kv = batch * (3 * 16 + 8 + 5) * kv_entry
    assert got["dense"] == dense
    assert got["experts"] == pytest.approx(3 * touched * EXPERT)
    assert got["head"] == HEAD
    assert got["kv_cache"] == kv
    assert got["index_keys"] == batch * 10 * index_entry


def test_expected_experts_touched_runs_from_k_to_all(cfg):
    assert roofline.expected_experts_touched(cfg, 1) == pytest.approx(2)
    assert roofline.expected_experts_touched(cfg, 1000) == pytest.approx(8)


def test_prefill_flops_match_the_hand_count(cfg):
    n = 50
    # Every 2-d projection but the experts, mHC, embed and head, counted as out * in per layer. FP8 with act_quant:
    # wq_a, wq_b, wkv, wo_b, the shared expert's three, the indexer's wq_b. bf16: wo_a (no act_quant in the
    # reference), the router, the compressors' wkv and wgate, the indexer's weights_proj, the head.
    fp8_attention = 128 * 256 + 256 * 128 + 128 * 256 + 256 * 128
    fp8_per_layer = [fp8_attention + 3 * 128 * 256, fp8_attention + 3 * 128 * 256 + 512 * 128]
    fp8_per_layer.append(fp8_per_layer[0])
    bf16_per_layer = [128 * 128 + 8 * 256]  # wo_a [o_groups * o_lora_rank, heads * head_dim / o_groups], router
    bf16_per_layer.append(bf16_per_layer[0] + 2 * (256 * 256) + 4 * 256 + 2 * (256 * 256))
    bf16_per_layer.append(bf16_per_layer[0] + 2 * (128 * 256))
    dense = 2 * n * sum(fp8_per_layer)
    dense_bf16 = 2 * n * sum(bf16_per_layer) + 2 * 1000 * 256  # + the head for the one sampled row
    experts = 2 * n * 2 * 3 * 128 * 256 * 3
    attention = indexer = 0
    for p in range(n):
        window = min(p + 1, 16)
        keys = [window, window + min(8, (p + 1) // 4), window + (p + 1) // 8]
        attention += sum(4 * 2 * 128 * k for k in keys)  # QK and PV: 2 FLOPs x heads x head_dim per key each
        indexer += 2 * 4 * 128 * ((p + 1) // 4)
    got = roofline.prefill_flops(cfg, n)
    want = {"dense": dense, "dense_bf16": dense_bf16, "experts": experts, "attention": attention, "indexer": indexer}
    assert got == want
    assert math.isclose(sum(got.values()), dense + dense_bf16 + experts + attention + indexer)
