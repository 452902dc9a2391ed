"""The dummy routers' balancing (ds4.bench.routers): the solved bias gives every expert about its share of the
top-k picks, counted here with torch.topk and bincount; on the tiny dummy model the biases move and the benchmark
reports them."""

import json

import pytest
import torch

from ds4.bench.routers import balance_routers, balanced_bias
from ds4.kernels.moe_routing import route_scores


def loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    return torch.bincount((scores + bias).topk(k, dim=-1).indices.flatten(), minlength=scores.shape[1]).double()


def test_the_bias_balances_a_skewed_router():
    g = torch.Generator().manual_seed(0)
    tokens, experts, k = 4096, 64, 6
    shared = torch.randn(experts, generator=g) * 2  # what every token's logits share: a few experts favoured
    logits = torch.randn(tokens, experts, generator=g) + shared
    scores = route_scores(logits, "sqrtsoftplus")
    mean = tokens * k / experts
    before = loads(scores, torch.zeros(experts), k)
    assert before.max() > 3 * mean and (before == 0).any()
    bias = balanced_bias(scores, torch.zeros(experts), k)
    after = loads(scores, bias, k)
    assert after.sum() == tokens * k
    assert after.max() < 1.1 * mean and after.min() > 0.9 * mean


def test_the_bias_generalises_to_other_tokens_of_the_same_router():
    """Solved on one set of tokens, it balances others drawn alike (as a trained bias serves unseen prompts)."""
    g = torch.Generator().manual_seed(1)
    tokens, experts, k = 4096, 64, 6
    shared = torch.randn(experts, generator=g) * 2
    calibration, other = (
        route_scores(torch.randn(tokens, experts, generator=g) + shared, "sqrtsoftplus") for _ in "ab"
    )
    bias = balanced_bias(calibration, torch.zeros(experts), k)
    after = loads(other, bias, k)
    balanced_std = (tokens * k * (1 / experts) * (1 - 1 / experts)) ** 0.5
    assert after.std() < 2 * balanced_std < loads(other, torch.zeros(experts), k).std() / 4


def test_the_tiny_dummy_models_routers_get_biases():
    from ds4.bench.model import _complete
    from ds4.checkpoint.tiny import tiny_config
    from ds4.engine.config import EngineConfig
    from ds4.engine.engine import LLMEngine
    from ds4.engine.loader import ModelSource
    from ds4.model.moe import Gate

    cfg = tiny_config()
    model = ModelSource(cfg, None, "dummy", torch.float32).load(torch.device("cpu"))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=128), tokenizer=None, seed=0)
    gates = [m for m in model.modules() if isinstance(m, Gate) and m.tid2eid is None]
    assert gates and all(not g.bias.any() for g in gates)
    assert balance_routers(engine.model, lambda: _complete(engine, "calibration", list(range(3, 99)))) == len(gates)
    assert all(g.bias.any() for g in gates)
    engine.close()


@pytest.mark.parametrize("unbalanced", [False, True])
def test_bench_model_reports_the_balancing(tmp_path, unbalanced):
    from ds4.cli import main

    out = tmp_path / "bench.json"
    argv = ["bench", "model", "--load-format", "dummy", "--device", "cpu", "--context", "16", "--no-profile"]
    argv += ["--batch-sizes", "1", "--prefill-lengths", "32", "--decode-steps", "1", "--json", str(out)]
    assert main(argv + (["--unbalanced-routers"] if unbalanced else [])) == 0
    balance = json.loads(out.read_text())["routers_balanced"]
    assert balance is None if unbalanced else balance == {"routers": 2, "prompt_tokens": 32, "rounds": 3}
