"""ds4's model equals transformers' DeepseekV4ForCausalLM (fp32, random weights) on whole-prompt prefill,
reading the checkpoint and config that transformers' `save_pretrained` wrote."""

import pytest
import torch
from dsv4_tiny import CONFIGS, ds4_model, max_rel_err, run_in_chunks, tiny_config, transformers_model

from ds4.checkpoint.reader import load_checkpoint
from ds4.config import load_config


@pytest.mark.parametrize("name,seq_len", [("mixed_hca8", 48), ("yarn_hc2_hca16", 72), ("csa_heavy_yarn", 41)])
def test_logits_match_transformers(name, seq_len, tmp_path):
    cfg = tiny_config(name)
    # The sequence outgrows the window, fills HCA entries and gives the indexer more entries than it keeps.
    assert seq_len > 2 * cfg.sliding_window and seq_len // 4 > 2 * cfg.index_topk
    assert all(seq_len // r >= 2 for r in cfg.compress_ratios if r)
    hf = transformers_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()

    hf.save_pretrained(tmp_path)
    saved_cfg = load_config(tmp_path)
    assert saved_cfg.layer_kinds[: cfg.num_hidden_layers] == cfg.layer_kinds[: cfg.num_hidden_layers]
    model = ds4_model(saved_cfg, load_checkpoint(tmp_path, saved_cfg, progress=False))
    pages = seq_len // 16 + 2
    cache = model.new_cache(num_slots=3, num_pages=pages, page_size=16)
    table = torch.randperm(pages)  # pages out of order, as an engine may hand them out
    got = run_in_chunks(model, cache, ids, [seq_len], slot=1, table=table)

    assert got.shape == expected.shape
    assert max_rel_err(got, expected) <= 1e-4


def test_configs_cover_the_layer_kinds():
    kinds = {k for name in CONFIGS for k in tiny_config(name).layer_kinds}
    hc = {tiny_config(name).hc_mult for name in CONFIGS}
    yarn = {tiny_config(name).yarn is not None for name in CONFIGS}
    assert kinds == {"window", "csa", "hca"} and hc == {2, 4} and yarn == {True, False}
