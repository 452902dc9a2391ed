"""Dummy routers given a trained router's balance, the way DeepSeek's training gives it (for `ds4 bench model`).

A trained score router's bias (the checkpoint's e_score_correction_bias) is what keeps its experts' loads
balanced: during training, after each step, every expert's bias moves by a fixed amount against its load's
deviation from the mean (auxiliary-loss-free balancing). Dummy weights have a zero bias, and the tokens of a
random model share much of their hidden state, so a few experts take most rows (16 Flash layers, an 8K prompt: the
largest expert 7x the mean) and a benchmark's MoE would time a load no trained model routes. `balance_routers`
runs that update on the dummy model: a calibration prompt's scores captured in each score layer, the bias solved
on them by the same signed steps (shrinking, so that they settle), for a few rounds (a layer's new routing changes
the inputs of the layers after it). The benchmark then times other prompts with these biases, as a trained model
serves prompts it was not balanced on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ds4.kernels.fp32_product import fp32_product
from ds4.kernels.moe_routing import route_scores

ROUNDS = 3  # calibration prompts: the layers' inputs move with the routing before them
STEPS = 200  # signed bias updates a round, on the captured scores
FIRST_STEP, LAST_STEP = 0.1, 0.001  # the update's size, in standard deviations of the layer's scores


def balanced_bias(scores: torch.Tensor, bias: torch.Tensor, topk: int, steps: int = STEPS) -> torch.Tensor:
    """A bias for scores [T, E] (from `bias`) under which top-k of score + bias gives every expert about T * k / E
    rows: `steps` signed updates against each expert's load deviation, their size shrinking geometrically."""
    experts = scores.shape[1]
    mean = scores.shape[0] * topk / experts
    bias = bias.clone().float()
    spread = scores.float().std().item()
    shrink = (LAST_STEP / FIRST_STEP) ** (1 / max(1, steps - 1))
    size = FIRST_STEP * spread
    for _ in range(steps):
        load = torch.bincount((scores + bias).topk(topk, dim=-1).indices.flatten(), minlength=experts)
        bias -= size * torch.sign(load - mean)
        size *= shrink
    return bias


def balance_routers(model, run: Callable[[], None], rounds: int = ROUNDS) -> int:
    """Solve each score router's bias (`balanced_bias`) on the scores of what `run` computes (a prompt's
    prefill), `rounds` times. Returns the routers balanced: 0 where the model is not in this process (ranks'
    workers) or has no score routers."""
    from ds4.model.moe import Gate

    if not isinstance(model, torch.nn.Module):
        return 0
    gates = [m for m in model.modules() if isinstance(m, Gate) and m.tid2eid is None]
    for _ in range(rounds if gates else 0):
        captured: dict[int, list[torch.Tensor]] = {id(g): [] for g in gates}

        def capture(gate, inputs, _routes):
            logits = fp32_product(inputs[0], gate.weight)
            captured[id(gate)].append(route_scores(logits, gate.score_func))

        hooks = [g.register_forward_hook(capture) for g in gates]
        try:
            run()
        finally:
            for hook in hooks:
                hook.remove()
        for gate in gates:
            if captured[id(gate)]:
                scores = torch.cat(captured[id(gate)])
                gate.bias.copy_(balanced_bias(scores, gate.bias, gate.topk))
    return len(gates)
