"""MoE routing: a token's k experts and their weights from the router logits, and the (token, slot) pairs
grouped by expert for the grouped GEMMs.

Scores: softmax, sigmoid or sqrt(softplus) of the fp32 logits. Hash layers take a token's experts from
tid2eid[token id], the others the top k of score + bias (bias only selects). Weights: the selected scores,
divided by their sum unless softmax, times the routed scaling factor. Expert parallel: experts outside this
rank's [first, first + count) go to local expert 0 with weight 0 (exact zeros, fixed shapes), the others are
renumbered from 0.

Grouping: slots (t * k + j) sorted by expert, stable (`order`), and each expert's segment of that order
(`bounds`, E + 1 offsets). On CUDA one kernel routes programs of a few tokens (ROUTE_TILE logits each); when
one program holds the whole batch (decode: up to 8 tokens of 256 experts) it also sorts the slots, so such a
step routes in one launch after the router's GEMM. Larger batches of up to GROUP_MAX_SLOTS slots take one more
launch, a single program that sorts them the same way; beyond that they sort with torch. No host sync in any
case (CUDA-graph capturable).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4.kernels._device import launches_dependents_early

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus's: above it softplus(x) is x
# Logits a routing program holds (tokens x padded experts) in ROUTE_WARPS warps: more spill registers, and one
# program of 64 tokens x 256 experts (sorting too) took 82 us on an H200, against 3.8 us for one token.
ROUTE_TILE = 2048
ROUTE_WARPS = 4
# Slots _group_kernel sorts, in one program (a bitonic sort in registers, then a binary search per expert):
# decode batches up to 170 tokens at top-6, where torch's sort and searchsorted are launches of their own (~18 us
# a layer at 384 slots on an H200). One program's sort grows with the slots where torch's spreads over the SMs,
# and larger batches are prefill, where the sort is small beside the GEMMs.
GROUP_MAX_SLOTS = 1024
# Padded slots a warp of _group_kernel holds, 4 keys a thread (4 warps at least): 1024 slots take 8 warps.
GROUP_SLOTS_PER_WARP = 128


@dataclass(frozen=True)
class Routes:
    """weights fp32 [T, k] and local expert indices int64 [T, k]; order int [T * k] (slots by expert, stable)
    and bounds int32 [E + 1] (expert e's slots are order[bounds[e]:bounds[e + 1]])."""

    weights: torch.Tensor
    indices: torch.Tensor
    order: torch.Tensor
    bounds: torch.Tensor


def group_by_expert(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, bounds) of `Routes` for indices [T, k] (torch ops, any device, no host sync)."""
    # int32 keys: half the radix passes of int64 in torch's sort (int64 keys: 27 us for 384 slots on the H200)
    sorted_experts, order = torch.sort(indices.reshape(-1).int(), stable=True)
    return order, torch.searchsorted(sorted_experts, _expert_ids(n_experts + 1, indices.device), out_int32=True)


@functools.cache
def _expert_ids(n: int, device: torch.device) -> torch.Tensor:
    # Made on the first (eager) call: graphs replay it, and it costs no launch per step.
    return torch.arange(n, device=device, dtype=torch.int32)


def route_reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    hashed: torch.Tensor | None,
    topk: int,
    score_func: str,
    route_scale: float,
    local: tuple[int, int] | None = None,
) -> Routes:
    """logits fp32 [T, E]; bias [E] (score routing) or hashed [T, k] (the tokens' tid2eid rows); local (first,
    count): this rank's experts under expert parallelism (None: all of them)."""
    if score_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif score_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    indices = hashed if hashed is not None else (scores + bias).topk(topk, dim=-1).indices
    weights = scores.gather(1, indices)
    if score_func != "softmax":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * route_scale
    n_experts = logits.shape[1]
    if local is not None:
        first, n_experts = local
        indices = indices - first
        foreign = (indices < 0) | (indices >= n_experts)
        weights, indices = weights.masked_fill(foreign, 0.0), indices.masked_fill(foreign, 0)
    return Routes(weights, indices, *group_by_expert(indices, n_experts))


@triton.jit
def _log1p(u):
    """log(1 + u) accurate for small u (tl has no log1p): log(w) * u / (w - 1), w = 1 + u rounded."""
    w = 1.0 + u
    exact = w == 1.0
    return tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))


@triton.jit
def _store_groups(
    local,
    ok,
    slot,
    count,
    n_local,
    order_ptr,
    bounds_ptr,
    SLOTS: tl.constexpr,
    BOUNDS_PAD: tl.constexpr,
    LOG_SLOTS: tl.constexpr,
):
    """order and bounds of flat [SLOTS] (local expert, slot) pairs, `count` of them valid (`ok`), slot < SLOTS:
    the stable sort by expert is a sort of the keys expert * SLOTS + slot, the invalid pairs' keys past every
    expert's."""
    keys = tl.sort(tl.where(ok, local * SLOTS + slot, n_local * SLOTS + slot))
    position = tl.arange(0, SLOTS)
    tl.store(order_ptr + position, keys % SLOTS, mask=position < count)
    # bounds[b]: the sorted slots whose expert is below b, by a binary search of every b at once
    sorted_experts = keys // SLOTS
    b = tl.arange(0, BOUNDS_PAD)
    below = tl.zeros((BOUNDS_PAD,), tl.int32)
    for i in tl.static_range(LOG_SLOTS):
        probe = below + ((SLOTS >> (i + 1)) - 1)
        below += tl.where(tl.gather(sorted_experts, probe, 0) < b, SLOTS >> (i + 1), 0)
    below += (tl.gather(sorted_experts, below, 0) < b).to(tl.int32)
    tl.store(bounds_ptr + b, below, mask=b <= n_local)


@triton.jit(do_not_specialize=["T", "n_experts", "topk", "first", "n_local"])
def _route_kernel(
    logits_ptr,
    stride_l,
    bias_ptr,
    tid2eid_ptr,
    stride_tid,
    ids_ptr,
    weights_ptr,
    indices_ptr,
    order_ptr,
    bounds_ptr,
    T,
    n_experts,
    topk,
    route_scale,
    first,
    n_local,
    BT: tl.constexpr,
    E_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    SCORE: tl.constexpr,
    HASHED: tl.constexpr,
    GROUP: tl.constexpr,
    BOUNDS_PAD: tl.constexpr,
    LOG_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Tokens pid*BT.. : scores, the k experts (tid2eid rows or top-k of score + bias, first index on ties),
    weights, local renumbering. GROUP (one program, every token): also the stable sort of the slots by expert
    (key expert * SLOTS + slot) and the segment bounds. PDL: launched early, it waits for the launch before; it
    does not let the next one start early, since the grouped GEMMs two launches on read the routes before their
    own wait (see moe._grouped_gemm_kernel)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    e = tl.arange(0, E_PAD)
    e_ok = e < n_experts
    logit = tl.load(
        logits_ptr + t.to(tl.int64)[:, None] * stride_l + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0
    )
    if SCORE == 0:
        z = tl.where(e_ok[None, :], logit, float("-inf"))
        z = tl.exp(z - tl.max(z, axis=1)[:, None])
        scores = z / tl.sum(z, axis=1)[:, None]
    elif SCORE == 1:
        scores = 1.0 / (1.0 + tl.exp(-logit))
    else:
        soft = tl.where(logit > SOFTPLUS_THRESHOLD, logit, _log1p(tl.exp(logit)))
        scores = tl.sqrt(soft)
    if not HASHED:
        bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0)
        candidates = tl.where(e_ok[None, :], scores + bias[None, :], float("-inf"))
    j = tl.arange(0, K_PAD)
    weights = tl.zeros((BT, K_PAD), tl.float32)
    experts = tl.zeros((BT, K_PAD), tl.int32)
    if HASHED:
        token_ids = tl.load(ids_ptr + t, mask=t_ok, other=0).to(tl.int64)
    for slot in range(topk):
        if HASHED:
            chosen = tl.load(tid2eid_ptr + token_ids * stride_tid + slot, mask=t_ok, other=0).to(tl.int32)
        else:
            chosen = tl.argmax(candidates, axis=1, tie_break_left=True).to(tl.int32)
            candidates = tl.where(e[None, :] == chosen[:, None], float("-inf"), candidates)
        weight = tl.sum(tl.where(e[None, :] == chosen[:, None], scores, 0.0), axis=1)
        weights = tl.where(j[None, :] == slot, weight[:, None], weights)
        experts = tl.where(j[None, :] == slot, chosen[:, None], experts)
    k_ok = j < topk
    if SCORE != 0:
        weights = weights / tl.sum(tl.where(k_ok[None, :], weights, 0.0), axis=1)[:, None]
    weights = weights * route_scale
    local = experts - first
    foreign = (local < 0) | (local >= n_local)
    weights = tl.where(foreign, 0.0, weights)
    local = tl.where(foreign, 0, local)
    ok = t_ok[:, None] & k_ok[None, :]
    slots = t[:, None] * topk + j[None, :]
    tl.store(weights_ptr + slots, weights, mask=ok)
    tl.store(indices_ptr + slots, local.to(tl.int64), mask=ok)
    if GROUP:
        SLOTS: tl.constexpr = BT * K_PAD
        _store_groups(
            tl.reshape(local, (SLOTS,)), tl.reshape(ok, (SLOTS,)), tl.reshape(slots, (SLOTS,)), T * topk, n_local,
            order_ptr, bounds_ptr, SLOTS, BOUNDS_PAD, LOG_SLOTS,
        )  # fmt: skip


@triton.jit(do_not_specialize=["slots", "n_local"])
def _group_kernel(
    indices_ptr,
    order_ptr,
    bounds_ptr,
    slots,
    n_local,
    SLOTS: tl.constexpr,
    BOUNDS_PAD: tl.constexpr,
    LOG_SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: order and bounds of the `slots` local expert indices (int64, flat [T * k], each below
    n_local), as _route_kernel's GROUP. PDL: it waits for the routing launch, and does not let the next launch
    start early, for the reason _route_kernel gives."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    slot = tl.arange(0, SLOTS)
    ok = slot < slots
    local = tl.load(indices_ptr + slot, mask=ok, other=0).to(tl.int32)
    _store_groups(local, ok, slot, slots, n_local, order_ptr, bounds_ptr, SLOTS, BOUNDS_PAD, LOG_SLOTS)


def route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    topk: int,
    score_func: str,
    route_scale: float,
    local: tuple[int, int] | None = None,
) -> Routes:
    """route_reference through `_route_kernel`, then group_by_expert_triton or torch's group_by_expert for batches
    it does not sort; hash layers pass the table and the token ids, not their rows."""
    t, n_experts = logits.shape
    first, n_local = local or (0, n_experts)
    logits = logits.contiguous()
    weights = torch.empty(t, topk, dtype=torch.float32, device=logits.device)
    indices = torch.empty(t, topk, dtype=torch.int64, device=logits.device)
    e_pad, k_pad = triton.next_power_of_2(n_experts), triton.next_power_of_2(topk)
    bt = min(triton.next_power_of_2(max(t, 1)), max(1, ROUTE_TILE // e_pad))
    group = 0 < t <= bt
    order = torch.empty(t * topk, dtype=torch.int32, device=logits.device)
    bounds = torch.empty(n_local + 1, dtype=torch.int32, device=logits.device)
    hashed = tid2eid is not None
    pdl = launches_dependents_early(logits.device)
    if t:
        _route_kernel[(triton.cdiv(t, bt),)](
            logits, logits.stride(0), bias if not hashed else logits, tid2eid if hashed else logits,
            tid2eid.stride(0) if hashed else 0, input_ids if hashed else logits, weights, indices, order, bounds,
            t, n_experts, topk, float(route_scale), first, n_local,
            BT=bt, E_PAD=e_pad, K_PAD=k_pad, SCORE=SCORE_FUNCS.index(score_func), HASHED=hashed, GROUP=group,
            BOUNDS_PAD=triton.next_power_of_2(n_local + 1), LOG_SLOTS=(bt * k_pad).bit_length() - 1, PDL=pdl,
            num_warps=ROUTE_WARPS, launch_pdl=pdl,
        )  # fmt: skip
    if not group:
        one_program = 0 < t * topk <= GROUP_MAX_SLOTS
        order, bounds = (group_by_expert_triton if one_program else group_by_expert)(indices, n_local)
    return Routes(weights, indices, order, bounds)


def group_by_expert_triton(indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """group_by_expert through `_group_kernel`, for 1 to GROUP_MAX_SLOTS slots (order int32)."""
    slots = indices.numel()
    padded = triton.next_power_of_2(slots)
    order = torch.empty(slots, dtype=torch.int32, device=indices.device)
    bounds = torch.empty(n_experts + 1, dtype=torch.int32, device=indices.device)
    pdl = launches_dependents_early(indices.device)
    _group_kernel[(1,)](
        indices.contiguous(), order, bounds, slots, n_experts,
        SLOTS=padded, BOUNDS_PAD=triton.next_power_of_2(n_experts + 1), LOG_SLOTS=padded.bit_length() - 1, PDL=pdl,
        num_warps=max(4, padded // GROUP_SLOTS_PER_WARP), launch_pdl=pdl,
    )  # fmt: skip
    return order, bounds


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor,
    topk: int,
    score_func: str,
    route_scale: float,
    local: tuple[int, int] | None = None,
) -> Routes:
    """The routes of a batch (module docstring): the Triton kernel on CUDA, route_reference elsewhere."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score function {score_func!r} is not one of {SCORE_FUNCS}")
    if logits.is_cuda:
        return route_triton(logits, bias, tid2eid, input_ids, topk, score_func, route_scale, local)
    hashed = tid2eid[input_ids] if tid2eid is not None else None
    return route_reference(logits, bias, hashed, topk, score_func, route_scale, local)
