"""Routed experts of a MoE layer: each token's k experts (clamped SwiGLU), weighted by the router and summed.

Two weight formats (`ExpertWeights`):
- MXFP4, the checkpoint's: gate/up [E, I, D/2] and down [E, D, I/2] uint8 (two e2m1 codes a byte, low nibble
  first) with e8m0 scale bytes [E, I, D/32] / [E, D, I/32]. Numerics of the official reference: before each
  FP4 GEMM the activation is rounded through e4m3 per 1x128 group with a power-of-two scale (`act_quant`);
  products are exact and summed in fp32; each GEMM's output, and the weighted SwiGLU activation, is rounded
  to bf16. (The reference sums a token's experts in expert order, this op in slot order: fp32 rounding only.)
- dequantized: gate/up [E, I, D], down [E, D, I] in the compute dtype; no activation rounding, GEMM outputs
  in the compute dtype (transformers' numerics).
A token's k expert outputs are summed in fp32; a token routed twice to one expert gets both.

`routed_experts` is the op: the Triton kernels on CUDA, `routed_experts_reference` elsewhere (the spec). Both
have fixed shapes and no host sync, so a decode step captured in a CUDA graph runs only the routed experts.

The kernels: the (token, slot) pairs are sorted by expert on the device, `searchsorted` gives each expert's
segment, and one grouped-GEMM kernel runs twice: x -> gate and up -> clamped SwiGLU times the routing
weight -> h (rows in expert order), then h -> down -> one row per (token, slot). A program owns BM rows of
one expert and BN weight rows; it finds its expert from the segment bounds (tiles of BM rows, expert after
expert), so the grid is a bound on the tile count known without reading the routing and surplus programs
return at once. Weight rows are the MMA's M and tokens its N, so a one-token tile reads each weight once;
e2m1 codes become bf16 on the way to the MMA (Hopper has no FP4 MMA; e2m1 times a power of two is exact in
bf16; `tl.dot_scaled` on GPUs, the kernel's own bit arithmetic under the interpreter) and activations are
quantised as they are loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4.kernels._device import interpreting, num_sms, shared_memory_per_block
from ds4.kernels.fp8_linear import act_quant as fp8_act_quant

ACT_GROUP = 128
MXFP4_GROUP = 32


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts: gate/up [E, I, ...], down [E, D, ...]; the scales are None unless MXFP4."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @property
    def mxfp4(self) -> bool:
        return self.gate_scale is not None

    @property
    def inter(self) -> int:
        return self.gate.shape[1]

    @property
    def hidden(self) -> int:
        return self.down.shape[1]


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (no clamping when limit <= 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


# ---- the torch reference (the spec, the CPU path) ----


def act_quant(x: torch.Tensor) -> torch.Tensor:
    """x rounded through e4m3 per group of 128 channels (fp8_linear.act_quant), as fp32 [..., d]: the exact
    dequantisation the reference's expert GEMMs apply to their act_quant'ed input."""
    d = x.shape[-1]
    q, scale = fp8_act_quant(x.reshape(-1, d))
    return (q.float() * scale.repeat_interleave(ACT_GROUP, dim=1)[:, :d]).view(x.shape)


def mxfp4_to_float(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K/2] (low nibble first) and e8m0 bytes [..., K/32] -> fp32 [..., K]."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2).int()
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * torch.exp2(exponent - 1.0))
    value = torch.where((codes & 8) != 0, -magnitude, magnitude)
    return value * torch.exp2(scale.float() - 127).repeat_interleave(MXFP4_GROUP, dim=-1)


def _slot_matmul(weight: torch.Tensor, scale: torch.Tensor | None, expert: torch.Tensor, a: torch.Tensor):
    """Row s of the result: weight[expert[s]] @ a[s]."""
    w = weight[expert] if scale is None else mxfp4_to_float(weight[expert], scale[expert])
    return torch.bmm(w.to(a.dtype), a[:, :, None])[:, :, 0]


def routed_experts_reference(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: ExpertWeights, limit: float
) -> torch.Tensor:
    """x [T, D], router weights / expert indices [T, k] -> fp32 [T, D]. Slot by slot (fixed shapes, no host
    sync), in chunks that bound the gathered weights."""
    t, k = indices.shape
    out_dtype = torch.bfloat16 if experts.mxfp4 else x.dtype
    slots = torch.arange(t * k, device=x.device)
    chunk = max(1, (1 << 24) // (experts.inter * experts.hidden))
    outs = []
    for start in range(0, t * k, chunk):
        slot = slots[start : start + chunk]
        expert, token = indices.reshape(-1)[slot], slot // k
        a = x[token]
        if experts.mxfp4:
            a = act_quant(a)
        gate = _slot_matmul(experts.gate, experts.gate_scale, expert, a).to(out_dtype)
        up = _slot_matmul(experts.up, experts.up_scale, expert, a).to(out_dtype)
        h = (swiglu(gate, up, limit) * weights.reshape(-1)[slot, None].float()).to(out_dtype)
        if experts.mxfp4:
            h = act_quant(h)
        outs.append(_slot_matmul(experts.down, experts.down_scale, expert, h.to(a.dtype)).to(out_dtype))
    out = torch.cat(outs) if outs else x.new_zeros(0, experts.hidden, dtype=out_dtype)
    return out.view(t, k, -1).sum(dim=1, dtype=torch.float32)


# ---- the Triton kernels ----


@triton.jit
def _round_to_bf16(x):
    """Nearest bf16 (ties to even), kept in fp32: a later bf16 store is then exact (the interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _act_quant_tile(a):
    """a [rows, 128] fp32 -> each row rounded through e4m3 with its power-of-two scale (as act_quant)."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-4)
    ratio = (amax * (1.0 / 448.0)).to(tl.int32, bitcast=True)
    exponent = ((ratio >> 23) & 0xFF) + ((ratio & 0x7FFFFF) != 0).to(tl.int32)  # biased, of the pow2 ceiling
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inverse = ((254 - exponent) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(a * inverse[:, None], -448.0), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    # Normal e4m3 (|v| >= 2^-6): keep 3 mantissa bits, ties to even. Below: multiples of 2^-9.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = ((v * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    q = tl.where((bits & 0x7F800000) >= (121 << 23), normal, subnormal)
    return q * scale[:, None]


@triton.jit
def _weight_tile(w_ptr, s_ptr, cols, col_ok, k0, K, stride_wn, stride_sn, BK: tl.constexpr, MXFP4: tl.constexpr):
    """Weight rows `cols`, columns k0 .. k0+BK of one expert, as fp32 [BN, BK]."""
    if MXFP4:
        kb = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(
            w_ptr + cols[:, None] * stride_wn + kb[None, :], mask=col_ok[:, None] & (kb < K // 2)[None, :], other=0
        )
        ks = k0 // 32 + tl.arange(0, BK // 32)
        sc = tl.load(
            s_ptr + cols[:, None] * stride_sn + ks[None, :], mask=col_ok[:, None] & (ks < K // 32)[None, :], other=127
        )
        codes = tl.join(packed & 15, packed >> 4).reshape(cols.shape[0], BK).to(tl.int32)
        exponent, mantissa = (codes >> 1) & 3, codes & 1
        bits = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
        value = (bits | ((codes & 8) << 28)).to(tl.float32, bitcast=True)
        scale = (sc.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        return (value.reshape(cols.shape[0], BK // 32, 32) * scale[:, :, None]).reshape(cols.shape[0], BK)
    else:
        kk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :], other=0)
        return w.to(tl.float32)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    stride_a,
    order_ptr,
    bounds_ptr,
    gate_ptr,
    up_ptr,
    gate_scale_ptr,
    up_scale_ptr,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    route_w_ptr,
    out_ptr,
    stride_out,
    n_experts,
    k_slots,
    K,
    N,
    limit,
    E_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    MXFP4: tl.constexpr,
    GATED: tl.constexpr,
    QUANT_ACT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    SCALED: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """GATED: out[row] = swiglu(gate a[token], up a[token]) * route_w[slot] for the expert-sorted rows (a = x);
    else out[slot] = down a[row] (a = the first pass's output). Tiles are [BN weight rows, BM rows]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    ids = tl.arange(0, E_PAD)
    lo = tl.load(bounds_ptr + ids, mask=ids < n_experts, other=0)
    hi = tl.load(bounds_ptr + ids + 1, mask=ids < n_experts, other=0)
    tiles = (hi - lo + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
    if expert >= n_experts:
        return
    mine = ids == expert
    row0 = tl.sum(tl.where(mine, lo + (pid_m - tile_end + tiles) * BM, 0), 0)
    row_end = tl.sum(tl.where(mine, hi, 0), 0)
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    slot = tl.load(order_ptr + rows, mask=row_ok, other=0)
    a_rows = (slot // k_slots if GATED else rows).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    w_off = expert.to(tl.int64) * stride_we
    s_off = expert.to(tl.int64) * stride_se
    acc_gate = tl.zeros((BN, BM), tl.float32)
    acc_up = tl.zeros((BN, BM), tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0)
        a = a.to(tl.float32)
        if QUANT_ACT:
            a = _act_quant_tile(a)
        if SCALED:
            a_t = tl.trans(a.to(tl.bfloat16))
            kb = k0 // 2 + tl.arange(0, BK // 2)
            ks = k0 // 32 + tl.arange(0, BK // 32)
            w_at = cols[:, None] * stride_wn + kb[None, :]
            s_at = cols[:, None] * stride_sn + ks[None, :]
            w_ok = col_ok[:, None] & (kb < K // 2)[None, :]
            s_ok = col_ok[:, None] & (ks < K // 32)[None, :]
            w = tl.load(gate_ptr + w_off + w_at, mask=w_ok, other=0)
            sc = tl.load(gate_scale_ptr + s_off + s_at, mask=s_ok, other=127)
            acc_gate = tl.dot_scaled(w, sc, "e2m1", a_t, None, "bf16", acc_gate)
            if GATED:
                w = tl.load(up_ptr + w_off + w_at, mask=w_ok, other=0)
                sc = tl.load(up_scale_ptr + s_off + s_at, mask=s_ok, other=127)
                acc_up = tl.dot_scaled(w, sc, "e2m1", a_t, None, "bf16", acc_up)
        else:
            a_t = tl.trans(a.to(DOT))
            w = _weight_tile(
                gate_ptr + w_off, gate_scale_ptr + s_off, cols, col_ok, k0, K, stride_wn, stride_sn, BK, MXFP4
            )
            acc_gate = tl.dot(w.to(DOT), a_t, acc_gate, input_precision=PRECISION)
            if GATED:
                w = _weight_tile(
                    up_ptr + w_off, up_scale_ptr + s_off, cols, col_ok, k0, K, stride_wn, stride_sn, BK, MXFP4
                )
                acc_up = tl.dot(w.to(DOT), a_t, acc_up, input_precision=PRECISION)
    mask = col_ok[:, None] & row_ok[None, :]
    if GATED:
        gate = acc_gate
        up = acc_up
        if ROUND_BF16:
            gate = _round_to_bf16(gate)
            up = _round_to_bf16(up)
        if limit > 0:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        h = h * tl.load(route_w_ptr + slot, mask=row_ok, other=0.0)[None, :]
        if ROUND_BF16:
            h = _round_to_bf16(h)
        dest = out_ptr + rows.to(tl.int64)[None, :] * stride_out + cols[:, None]
        tl.store(dest, h.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        y = acc_gate
        if ROUND_BF16:
            y = _round_to_bf16(y)
        dest = out_ptr + slot.to(tl.int64)[None, :] * stride_out + cols[:, None]
        tl.store(dest, y.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class GemmPlan:
    """Tiles and launch settings of one grouped-GEMM pass. scaled: MXFP4 through tl.dot_scaled (which dequantises
    e2m1 on the way to the MMA; the interpreter lacks it) rather than the kernel's own dequantisation."""

    bm: int
    bn: int
    warps: int
    stages: int
    scaled: bool = True


# BM: the smallest of these holding the average rows a touched expert gets. BN: the largest of these that
# still gives every SM two programs (decode: few experts, many column tiles); large tiles when rows are many.
# Shared memory holds `stages` copies of the loaded operand tiles plus the dequantised weight tiles.
_ROW_TILES = (16, 32, 64, 128)
_COL_TILES = (128, 64, 32)
_PROGRAMS_PER_SM = 2
_SHARED_MEMORY_SHARE = 0.9  # of the per-block limit (the rest: barriers, the compiler's own scratch)
_MAX_STAGES = 4
_SCALED_MAX_ROWS = 32  # tl.dot_scaled for decode tiles; the kernel's own dequantisation won at 128 rows (H200)


def plan_shared_memory(bm: int, bn: int, stages: int, gated: bool, mxfp4: bool, a_bytes: int) -> int:
    """Bytes of shared memory a plan's operand tiles take: loaded stages plus the bf16 weight tiles."""
    weights = 2 if gated else 1
    w_bytes = (ACT_GROUP // 2 + ACT_GROUP // MXFP4_GROUP) if mxfp4 else ACT_GROUP * a_bytes
    return stages * (bm * ACT_GROUP * a_bytes + weights * bn * w_bytes) + weights * bn * ACT_GROUP * a_bytes


def gemm_plan(
    rows: int, n_experts: int, n: int, gated: bool, mxfp4: bool, a_bytes: int, sms: int, shared_memory: int
) -> GemmPlan:
    """Tiles for `rows` (token, slot) rows over `n` output columns, from the device's SM count and shared memory."""
    touched = max(1, min(rows, n_experts))
    bm = next((b for b in _ROW_TILES if rows / touched <= b), _ROW_TILES[-1])
    bn = next((b for b in _COL_TILES if touched * triton.cdiv(n, b) >= _PROGRAMS_PER_SM * sms), _COL_TILES[-1])
    budget = _SHARED_MEMORY_SHARE * shared_memory

    def stages_that_fit(bm, bn):
        fixed = plan_shared_memory(bm, bn, 0, gated, mxfp4, a_bytes)
        per_stage = plan_shared_memory(bm, bn, 1, gated, mxfp4, a_bytes) - fixed
        return int((budget - fixed) // per_stage)

    while stages_that_fit(bm, bn) < 2 and bm > _ROW_TILES[0]:
        bm //= 2
    while stages_that_fit(bm, bn) < 2 and bn > _COL_TILES[-1]:
        bn //= 2
    stages = max(1, min(_MAX_STAGES, stages_that_fit(bm, bn)))
    warps = 8 if bm * bn >= 128 * 128 else 4
    return GemmPlan(bm, bn, warps, stages, scaled=bm <= _SCALED_MAX_ROWS)


@functools.cache
def _expert_ids(n: int, device: torch.device) -> torch.Tensor:
    # Made on the first (eager) call: graphs replay it, and it costs no launch per step.
    return torch.arange(n, device=device)


def _grouped_gemm(a, order, bounds, w, up, scale, up_scale, route_w, out, n_experts, k_slots, limit, gated, plan):
    mxfp4 = scale is not None
    k_dim = w.shape[2] * (2 if mxfp4 else 1)
    n = w.shape[1]
    rows = order.shape[0]
    dot = tl.float32 if interpreting() or w.dtype == torch.float32 else tl.bfloat16
    grid = ((rows + min(n_experts, rows) * (plan.bm - 1)) // plan.bm, triton.cdiv(n, plan.bn))
    _grouped_gemm_kernel[grid](
        a,
        a.stride(0),
        order,
        bounds,
        w,
        up if gated else w,
        scale if mxfp4 else w,
        (up_scale if gated else scale) if mxfp4 else w,
        w.stride(0),
        w.stride(1),
        scale.stride(0) if mxfp4 else 0,
        scale.stride(1) if mxfp4 else 0,
        route_w,
        out,
        out.stride(0),
        n_experts,
        k_slots,
        k_dim,
        n,
        float(limit),
        E_PAD=triton.next_power_of_2(n_experts),
        BM=plan.bm,
        BN=plan.bn,
        BK=ACT_GROUP,
        MXFP4=mxfp4,
        GATED=gated,
        QUANT_ACT=mxfp4,
        ROUND_BF16=out.dtype == torch.bfloat16,
        SCALED=mxfp4 and plan.scaled and not interpreting(),
        DOT=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32",
        num_warps=plan.warps,
        num_stages=plan.stages,
    )


def _check(x: torch.Tensor, experts: ExpertWeights) -> None:
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"routed experts take bf16 or fp32 activations, got {x.dtype}")
    for name in ("gate", "up", "down", "gate_scale", "up_scale", "down_scale"):
        t = getattr(experts, name)
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"expert {name} must be contiguous along its last dim, strides {t.stride()}")
    if experts.gate.stride() != experts.up.stride():
        raise ValueError("expert gate and up weights must share their strides")
    if experts.mxfp4 and experts.gate.dtype != torch.uint8:
        raise ValueError(f"packed MXFP4 experts are uint8, got {experts.gate.dtype}")


def routed_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: ExpertWeights,
    limit: float,
    plans: tuple[GemmPlan, GemmPlan] | None = None,
) -> torch.Tensor:
    """routed_experts_reference through the grouped-GEMM kernels (no host sync; any device Triton runs on).
    plans: (gate-up pass, down pass) instead of gemm_plan's, for tile sweeps."""
    _check(x, experts)
    t, k = indices.shape
    if t == 0:
        return x.new_zeros(0, experts.hidden, dtype=torch.float32)
    n_experts, inter, hidden = experts.gate.shape[0], experts.inter, experts.hidden
    out_dtype = torch.bfloat16 if experts.mxfp4 else x.dtype
    sorted_experts, order = torch.sort(indices.reshape(-1), stable=True)
    bounds = torch.searchsorted(sorted_experts, _expert_ids(n_experts + 1, x.device), out_int32=True)
    order = order.to(torch.int32)
    sms, smem = num_sms(x.device), shared_memory_per_block(x.device)
    a_bytes = 2 if x.dtype == torch.bfloat16 and not interpreting() else 4
    plan1, plan2 = plans or (
        gemm_plan(t * k, n_experts, inter, True, experts.mxfp4, a_bytes, sms, smem),
        gemm_plan(t * k, n_experts, hidden, False, experts.mxfp4, a_bytes, sms, smem),
    )
    h = torch.empty(t * k, inter, dtype=out_dtype, device=x.device)
    out = torch.empty(t * k, hidden, dtype=out_dtype, device=x.device)
    route_w = weights.reshape(-1).float()
    x = x.contiguous()
    _grouped_gemm(
        x, order, bounds, experts.gate, experts.up, experts.gate_scale, experts.up_scale, route_w, h,
        n_experts, k, limit, True, plan1,
    )  # fmt: skip
    _grouped_gemm(
        h, order, bounds, experts.down, None, experts.down_scale, None, route_w, out,
        n_experts, k, limit, False, plan2,
    )  # fmt: skip
    return out.view(t, k, hidden).sum(dim=1, dtype=torch.float32)


def routed_experts(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: ExpertWeights, limit: float
) -> torch.Tensor:
    """x [T, D], router weights / expert indices [T, k] -> fp32 [T, D] (module docstring)."""
    if x.is_cuda:
        return routed_experts_triton(x, weights, indices, experts, limit)
    return routed_experts_reference(x, weights, indices, experts, limit)
