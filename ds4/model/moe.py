"""The MoE feed-forward: sqrt-softplus (or sigmoid / softmax) router, hash or top-k routing, one shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ds4.config import ModelConfig
from ds4.kernels.moe import ExpertWeights, routed_experts, swiglu
from ds4.model.linear import Linear


class Gate(nn.Module):
    """Routing: hash layers take experts from tid2eid[token], others the top-k of score + bias; weights from score."""

    def __init__(self, cfg: ModelConfig, hashed: bool, device: torch.device):
        super().__init__()
        self.topk, self.score_func = cfg.num_experts_per_tok, cfg.scoring_func
        self.route_scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, device=device), requires_grad=False
        )
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long, device=device))
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.tid2eid is not None:
            indices = self.tid2eid[input_ids]
        else:
            indices = (scores + self.bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.score_func != "softmax":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices


class Experts(nn.Module):
    """Routed experts stacked per projection: w1/w3 [E, inter, hidden], w2 [E, hidden, inter]."""

    format = "dequantized"

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nn.Parameter(torch.empty(e, i, d, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=dtype, device=device), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(e, i, d, dtype=dtype, device=device), requires_grad=False)


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.w1 = Linear(d, i, dtype, device)
        self.w2 = Linear(i, d, dtype, device)
        self.w3 = Linear(d, i, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, hashed, device)
        self.experts = Experts(cfg, dtype, device)
        self.shared_experts = SharedExpert(cfg, dtype, device) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Fixed shapes, no host sync: the same call serves prefill and captured decode steps."""
        weights, indices = self.gate(x, input_ids)
        y = routed_experts(x, weights, indices, expert_weights(self.experts), self.limit)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)


def expert_weights(experts: Experts) -> ExpertWeights:
    """The routed-experts op's view of the Experts module in either storage format."""
    if experts.format == "mxfp4":
        inter = experts.w13.shape[1] // 2
        return ExpertWeights(
            experts.w13[:, :inter],
            experts.w13[:, inter:],
            experts.w2,
            experts.w13_scale[:, :inter],
            experts.w13_scale[:, inter:],
            experts.w2_scale,
        )
    return ExpertWeights(experts.w1, experts.w3, experts.w2)
