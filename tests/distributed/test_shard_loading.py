"""A rank's shard holds exactly its part of the weights one rank holds, whether they come as tensors, as dummy
weights made per rank, or as lazy safetensors slices; quantised weights kept in checkpoint precision are split
at whole FP8 blocks and MXFP4 groups only; ParallelConfig.validate refuses bad splits with the reasons.

No process group is needed to build and load a shard: these run in this process."""

import glob

import pytest
import torch
from safetensors import safe_open

from ds4.checkpoint.dummy import dummy_weights
from ds4.checkpoint.reader import load_checkpoint
from ds4.checkpoint.tiny import TINY_CONFIG, default_model_dir
from ds4.config import load_config
from ds4.distributed.parallel import Parallel, ParallelConfig
from ds4.model.deepseek_v4 import DeepseekV4Model
from ds4.model.linear import Linear
from ds4.model.moe import Experts
from ds4.model.shard import region_of

# The tiny model with FP8 blocks and MXFP4 groups whole at TP=2 (its own dims are below one block).
ALIGNED = {**TINY_CONFIG, "vocab_size": 1024, "o_lora_rank": 128, "moe_intermediate_size": 256}


def _model(cfg, parallel=None, weight_format="dequantized"):
    return DeepseekV4Model(cfg, torch.float32, "cpu", with_mtp=True, weight_format=weight_format, parallel=parallel)


def _expected_part(name: str, full: torch.Tensor, shard_param: torch.Tensor, owner) -> torch.Tensor:
    """The part of the one-rank parameter `full` that the shard's parameter should hold."""
    experts = owner if isinstance(owner, Experts) else None
    region, block = region_of(shard_param), 1
    if isinstance(owner, Linear) and name.endswith(".scale"):
        region, block = region_of(owner.weight), 128
    if region is not None:
        part = full if region.rows is None else full[region.rows.start // block : region.rows.stop // block]
        return part if region.cols is None else part[:, region.cols.start // block : region.cols.stop // block]
    if experts is None:
        return full
    if experts.held_experts is not None:
        return full[experts.held_experts]
    ch, leaf, inter = experts.held_channels, name.rpartition(".")[2], full.shape[1] // 2
    if leaf in ("w13", "w13_scale"):
        return torch.cat((full[:, ch], full[:, inter + ch.start : inter + ch.stop]), dim=1)
    if leaf == "w2_scale":
        return full[:, :, ch.start // 32 : ch.stop // 32]
    if leaf == "w2" and experts.format == "mxfp4":
        return full[:, :, ch.start // 2 : ch.stop // 2]
    return full[:, :, ch] if leaf == "w2" else full[:, ch]


def _assert_shard_holds_its_part(shard, full_model):
    full = dict(full_model.named_parameters())
    for name, p in shard.named_parameters():
        owner = shard.get_submodule(name.rpartition(".")[0])
        want = _expected_part(name, full[name], p, owner)
        assert torch.equal(p, want), name


@pytest.mark.parametrize("world, expert_parallel", [(2, False), (4, False), (2, True), (4, True)])
def test_dummy_weights_per_rank_are_the_parts_of_one_rank(world, expert_parallel):
    cfg = load_config(dict(TINY_CONFIG))
    full = _model(cfg)
    full.load_weights(dummy_weights(cfg, with_mtp=True))
    for rank in (0, world - 1):
        shard = _model(cfg, Parallel(rank, world, expert_parallel))
        shard.load_weights(dummy_weights(cfg, with_mtp=True, holds=shard.holds))
        _assert_shard_holds_its_part(shard, full)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_checkpoint_precision_shards_cut_no_block(expert_parallel):
    cfg = load_config(ALIGNED)
    full = _model(cfg, weight_format="checkpoint")
    full.load_weights(dummy_weights(cfg, with_mtp=True))
    assert full.layers[0].ffn.experts.format == "mxfp4"
    for rank in (0, 1):
        shard = _model(cfg, Parallel(rank, 2, expert_parallel), weight_format="checkpoint")
        shard.load_weights(dummy_weights(cfg, with_mtp=True, holds=shard.holds))
        _assert_shard_holds_its_part(shard, full)
        # Rank 1's FP8 scales are the full model's second block row / column, not a recomputed one.
        wq_b = shard.layers[1].attn.wq_b
        assert torch.equal(
            wq_b.scale, full.layers[1].attn.wq_b.scale[wq_b.scale.shape[0] * rank :][: wq_b.scale.shape[0]]
        )


def test_lazy_safetensors_slices_load_as_tensors_do():
    model_dir = default_model_dir()
    cfg = load_config(model_dir)
    parallel = Parallel(1, 2)
    from_tensors = _model(cfg, parallel)
    from_tensors.load_weights(load_checkpoint(model_dir, cfg, with_mtp=True, progress=False))
    lazy = _model(cfg, parallel)
    files = [safe_open(f, "pt") for f in sorted(glob.glob(f"{model_dir}/*.safetensors"))]
    lazy.load_weights((name, f.get_slice(name)) for f in files for name in f.keys())
    for (name, a), (_, b) in zip(from_tensors.named_parameters(), lazy.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def _reasons(cfg, world, expert_parallel=False, num_devices=None, weight_format="auto"):
    with pytest.raises(ValueError) as e:
        ParallelConfig(world, expert_parallel).validate(cfg, num_devices, weight_format)
    return str(e.value)


def test_validate_refuses_bad_splits_with_the_reasons():
    tiny, flash = load_config(dict(TINY_CONFIG)), load_config("ds4/configs/deepseek-v4-flash.json")
    for world in (2, 4, 8):
        for ep in (False, True):
            ParallelConfig(world, ep).validate(flash, num_devices=8)
    ParallelConfig(4).validate(tiny)  # dequantised on CPU: o_groups 2 split per head, FP8 blocks read whole
    assert "num_attention_heads (4) does not split 3 ways" in _reasons(tiny, 3)
    assert "o_groups (8) does not split 16 ways" in _reasons(flash, 16, num_devices=16)
    assert "n_routed_experts (8) does not split 16 ways" in _reasons(tiny, 16, expert_parallel=True)
    assert "8 ranks need 8 GPUs, 4 available" in _reasons(flash, 8, num_devices=4)
    # Kept in checkpoint precision, the tiny model's 64-row projections are less than one 128 x 128 block.
    quantised = _reasons(tiny, 2, weight_format="checkpoint")
    assert "o_groups x o_lora_rank (64) does not split 2 ways into whole FP8 blocks of 128" in quantised
    assert "routed expert moe_intermediate_size (64) does not split 2 ways into whole act_quant groups" in quantised
    assert "o_groups (2) does not split 4 ways" in _reasons(load_config(ALIGNED), 4, weight_format="checkpoint")
    with pytest.raises(ValueError, match="o_groups"):
        _model(load_config(ALIGNED), Parallel(0, 4), weight_format="checkpoint")
