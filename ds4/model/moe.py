"""The MoE feed-forward: sqrt-softplus (or sigmoid / softmax) router, hash or top-k routing, one shared expert.

Several ranks: the router is replicated (every rank routes every token, the same way); the shared expert is
split inside (its intermediate channels); the routed experts are split inside each expert (tensor parallel)
or placed whole, E / N a rank (expert parallel). Every rank holds every token (attention all-reduces its
output), so dispatching a token to the rank of its expert needs no traffic: a rank computes its experts'
slots and gives the others' weight 0; one all-reduce of the layer's partial outputs combines them.
"""

from __future__ import annotations

import torch
from torch import nn

from ds4.checkpoint.quant import MXFP4_BLOCK, fp8_block_dequantize, mxfp4_dequantize
from ds4.config import ModelConfig
from ds4.distributed.parallel import Parallel
from ds4.kernels.fp32_product import fp32_product
from ds4.kernels.moe import MXFP4_MAX_SCALE, ExpertWeights, combine_slots, routed_slots
from ds4.kernels.moe_routing import Routes, route
from ds4.model.linear import CHECKPOINT, DEQUANTIZED, Linear, StackedLinears, kept_fp8_block
from ds4.model.shard import Region, cut, read, read_grouped, stored_dtype
from ds4.model.side_stream import side_stream


class Gate(nn.Module):
    """Routing: hash layers take experts from tid2eid[token], others the top-k of score + bias; weights from score."""

    def __init__(self, cfg: ModelConfig, hashed: bool, device: torch.device, dtype: torch.dtype):
        """The weight is held in the compute dtype (bf16 on CUDA, as the checkpoint stores it): the logits are
        fp32 products of it (fp32_product)."""
        super().__init__()
        self.topk, self.score_func = cfg.num_experts_per_tok, cfg.scoring_func
        self.route_scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long, device=device))
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, held: slice | None = None) -> Routes:
        """held: this rank's experts under expert parallelism (the others' slots get expert 0, weight 0)."""
        local = None if held is None else (held.start, held.stop - held.start)
        logits = fp32_product(x, self.weight)
        return route(logits, self.bias, self.tid2eid, input_ids, self.topk, self.score_func, self.route_scale, local)


MXFP4, DENSE = "mxfp4", "dequantized"


class Experts(nn.Module):
    """Routed experts stacked over E experts (I = moe_intermediate_size, D = hidden_size), in one of two formats.

    "mxfp4" (checkpoint format, MXFP4 experts): the checkpoint's bytes, gate and up stacked in one tensor:
    w13 uint8 [E, 2I, D/2] and w13_scale uint8 (e8m0 bits) [E, 2I, D/32], rows :I the gate (w1), I: the up
    projection (w3); w2 uint8 [E, D, I/2] and w2_scale uint8 [E, D, I/32]. Two e2m1 codes a byte, low nibble first.
    "dequantized" (the CPU path, FP8 experts, unquantised configs): w1/w3 [E, I, D], w2 [E, D, I] in `dtype`.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = DEQUANTIZED,
        parallel: Parallel | None = None,
    ):
        """parallel: hold this rank's E / N whole experts (expert parallel) or I / N channels of every expert."""
        super().__init__()
        parallel = parallel or Parallel.single()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        # Expert parallel: this rank's experts; tensor parallel: its channels of each (None: all of them).
        self.held_experts = self.held_channels = None
        if not parallel.is_single and parallel.expert_parallel:
            self.held_experts = parallel.shard(e)
            e = e // parallel.world_size
        elif not parallel.is_single:
            self.held_channels = parallel.shard(i)
            i = i // parallel.world_size
        self.inter, self.dtype = i, dtype
        packed = weight_format == CHECKPOINT and cfg.fp8_block is not None and cfg.expert_dtype == "fp4"
        self.format = MXFP4 if packed else DENSE
        if self.format == MXFP4:
            self.w13 = _bytes(e, 2 * i, d // 2, device=device)
            self.w13_scale = _bytes(e, 2 * i, d // MXFP4_BLOCK, device=device)
            self.w2 = _bytes(e, d, i // 2, device=device)
            self.w2_scale = _bytes(e, d, i // MXFP4_BLOCK, device=device)
        else:
            self.w1 = nn.Parameter(torch.empty(e, i, d, dtype=dtype, device=device), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, d, i, dtype=dtype, device=device), requires_grad=False)
            self.w3 = nn.Parameter(torch.empty(e, i, d, dtype=dtype, device=device), requires_grad=False)

    @torch.no_grad()
    def load(
        self,
        expert: int,
        projection: str,
        weight: torch.Tensor,
        scale: torch.Tensor | None,
        fp8_block: tuple[int, int] | None,
    ) -> None:
        """One expert's stored projection ("w1", "w2" or "w3"): MXFP4 int8 codes or FP8 with its e8m0 `scale`,
        or a floating weight (scale None); tensors or lazy slices, of which only this rank's channels are read."""
        if self.held_experts is not None:
            expert -= self.held_experts.start
        region = None
        if self.held_channels is not None:
            region = Region(cols=self.held_channels) if projection == "w2" else Region(rows=self.held_channels)
        if scale is None:
            getattr(self, projection)[expert].copy_(read(weight, region))
            return
        mxfp4 = stored_dtype(weight) == torch.int8
        group, packed = ((1, MXFP4_BLOCK), 2) if mxfp4 else (fp8_block, 1)
        weight, scale, offset = read_grouped(weight, scale, region, group, packed)
        if self.format == MXFP4:
            rows = {"w1": slice(0, self.inter), "w3": slice(self.inter, 2 * self.inter), "w2": slice(None)}[projection]
            codes, scales = (self.w2, self.w2_scale) if projection == "w2" else (self.w13, self.w13_scale)
            if int(scale.view(torch.uint8).max()) > MXFP4_MAX_SCALE:
                raise ValueError(f"expert {expert} {projection}: MXFP4 scales above 2^{MXFP4_MAX_SCALE - 127}")
            codes[expert, rows].copy_(weight.view(torch.uint8))
            scales[expert, rows].copy_(scale.view(torch.uint8))
            return
        target = getattr(self, projection)[expert]
        weight, scale = weight.to(target.device), scale.to(target.device)
        if mxfp4:
            weight = mxfp4_dequantize(weight, scale, self.dtype)
        else:
            weight = fp8_block_dequantize(weight, scale, fp8_block, self.dtype)
        target.copy_(cut(weight, offset, target.shape))

    def holds(self, expert: int) -> bool:
        return self.held_experts is None or self.held_experts.start <= expert < self.held_experts.stop


def _bytes(*shape: int, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.uint8, device=device), requires_grad=False)


class SharedExpert(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = DEQUANTIZED,
        parallel: Parallel | None = None,
    ):
        """parallel: hold this rank's I / N intermediate channels (the output is then a partial sum)."""
        super().__init__()
        parallel = parallel or Parallel.single()
        d, i = cfg.hidden_size, cfg.moe_intermediate_size
        channels = None if parallel.is_single else parallel.shard(i)
        i //= parallel.world_size
        self.limit = cfg.swiglu_limit
        fp8 = kept_fp8_block(cfg, weight_format)
        self.w1 = Linear(d, i, dtype, device, fp8, rows=channels)
        self.w2 = Linear(i, d, dtype, device, fp8, cols=channels)
        self.w3 = Linear(d, i, dtype, device, fp8, rows=channels)
        self.w13 = StackedLinears(self.w1, self.w3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x)
        return self.w2.gated(gate, up, self.limit)


class MoE(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        hashed: bool,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: str = DEQUANTIZED,
        parallel: Parallel | None = None,
    ):
        super().__init__()
        self.parallel = parallel or Parallel.single()
        self.limit = cfg.swiglu_limit
        self.gate = Gate(cfg, hashed, device, dtype)
        self.experts = Experts(cfg, dtype, device, weight_format, self.parallel)
        self.held_experts = self.experts.held_experts
        shared = cfg.n_shared_experts
        self.shared_experts = SharedExpert(cfg, dtype, device, weight_format, self.parallel) if shared else None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Fixed shapes, no host sync: the same call serves prefill and captured decode steps. On CUDA the shared
        expert runs on the side stream beside the router and the routed experts (at decode each is a few
        latency-bound launches), joined before the slot sum adds it."""
        side, shared = side_stream(x.device), None
        if self.shared_experts is not None:
            with side.fork(x.shape[0]):
                shared = self.shared_experts(x)
        routes = self.gate(x, input_ids, self.held_experts)
        experts, groups = expert_weights(self.experts), (routes.order, routes.bounds)
        slots = routed_slots(x, routes.weights, routes.indices, experts, self.limit, groups)
        side.join()
        y = combine_slots(slots, routes.indices.shape[1], shared, x.dtype)
        return self.parallel.all_reduce(y)


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
