"""The transformers name mappings agree with what transformers itself writes and reads."""

import torch
import transformers
from safetensors import safe_open

from ds4.checkpoint.hf_names import memory_state_to_official, official_to_saved, saved_to_official


def _tiny_hf_model():
    cfg = transformers.DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        head_dim=32,
        q_lora_rank=16,
        partial_rotary_factor=0.5,
        n_routed_experts=4,
        num_experts_per_tok=2,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe"],
    )
    torch.manual_seed(0)
    return transformers.DeepseekV4ForCausalLM(cfg)


def test_memory_and_saved_spellings_map_to_the_same_official_tensors(tmp_path):
    model = _tiny_hf_model()
    from_memory = memory_state_to_official(model.state_dict())
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved_names = list(f.keys())
        from_disk = {saved_to_official(k): f.get_tensor(k) for k in saved_names}
    assert set(from_memory) == set(from_disk)
    for name, tensor in from_disk.items():
        assert torch.equal(from_memory[name], tensor), name
    assert [official_to_saved(saved_to_official(k)) for k in saved_names] == saved_names
    assert "layers.1.attn.kv_norm.weight" in from_disk and "layers.1.attn.indexer.compressor.ape" in from_disk
    assert "layers.2.ffn.experts.3.w2.weight" in from_disk and "layers.2.ffn.gate.bias" in from_disk
