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
have fixed shapes and no host sync, so a decode step captured in a CUDA graph runs only the routed experts. Its
two parts are ops too: `routed_slots` (each token's k weighted expert outputs) and `combine_slots` (their sum plus
the shared expert's output), so that the shared expert can run beside the first.

The kernels: the (token, slot) pairs sorted by expert and each expert's segment of them (`moe_routing`: made
by the routing kernel at decode sizes, else sorted here), and one grouped-GEMM kernel runs twice: x -> gate
and up -> clamped SwiGLU times the routing weight -> h (rows in expert order), then h -> down -> one row per
(token, slot). MXFP4: each GEMM's input is
act_quant'ed once beforehand by a small kernel that stores the exact values in bf16, so GEMM programs only
load it. A program owns BM rows of one expert and a tile of weight rows (gate-up: as many gate as up rows,
one MMA operand); it finds its expert from the segment bounds (tiles of BM rows, expert after expert), so the
grid is a bound on the tile count known without reading the routing and surplus programs return at once.
Weight rows are the MMA's M and tokens its N, so a one-token tile reads each weight once. Hopper has no FP4
MMA: e2m1 codes, read as int32 words of eight, become bf16 pairs in registers by bit placement (a mask and a
carry-free multiply a pair) and one bf16x2 multiply by the scale (exact: e2m1 times a power of two fits
bf16), and the bf16 MMA takes them from registers; decoding is what bounds decode-sized batches (about 8
instructions a weight byte at the 1-token tiles, sm_90), not bytes. The K columns of a step are read in the
order the MMA's threads hold them (`mma_columns`), the activations stored in that order to match. One token's
batch on e4m3 devices takes one-row tiles of the e4m3 MMA instead (`GemmPlan.column_groups`, COLUMN_GROUPS in the
kernel): 32-groups as the MMA's columns, the codes placed as e4m3 bytes, the scales applied to its fp32 sums (less
exact than fp32 inside the tensor core, as FP8 GEMMs are). Prefill's
plan (sm_90+, `GemmPlan.tma`) has the gate-up pass's act_quant write each slot's token row in expert order, so
both passes read their activation tiles as boxes of whole rows by TMA descriptors (one copy instruction a tile
instead of a gathered address a row: fewer instructions in a kernel whose issue slots the decoding fills; an H200
probe of the gate-up pass at 8K tokens: 4.24 ms against 4.95). A prefill pass is two launches (`GemmPlan.rest`):
256-row tiles take each expert's whole tiles (and a remainder of more than 128 rows), 128-row tiles the smaller
remainders, so an expert's rows are padded by at most 127, not 255 (a skewed load leaves many experts a few rows:
simulated, 8K tokens with the largest expert ~8x the mean as in 16 dummy Flash layers fill 58% of one launch's
256-row tiles, 76% of the two launches'; a balanced load 75% either way). The
slot sum adds the shared expert's output and rounds to the layer's dtype in one kernel.
Settings: one table (`_TIERS`; `_REGISTER_OPERAND_TIERS` where the MMA reads registers), fitted to the device's
shared memory (`gemm_plan`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ds4.kernels._device import (
    dependent_launch_start,
    early_prefetch_bytes,
    has_fp8,
    has_tma,
    interpreting,
    launches_dependents_early,
    mma_operands_in_registers,
    num_sms,
    prefetch_to_l2,
    shared_memory_per_block,
)
from ds4.kernels.fp8_linear import act_quant as fp8_act_quant
from ds4.kernels.moe_routing import group_by_expert
from ds4.kernels.swiglu import clamped_swiglu, swiglu

ACT_GROUP = 128
MXFP4_GROUP = 32
MXFP4_MAX_SCALE = 128  # e8m0 byte: the kernels' e2m1 decoding holds weights up to 12 (`_e2m1_tile`)


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
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: ExpertWeights,
    limit: float,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [T, D], router weights / expert indices [T, k] -> [T, D] in out_dtype: the slots' sum in fp32, plus
    `shared` [T, D] if given."""
    slots = routed_slots_reference(x, weights, indices, experts, limit)
    return combine_reference(slots, indices.shape[1], shared, out_dtype)


def routed_slots_reference(
    x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: ExpertWeights, limit: float
) -> torch.Tensor:
    """Each (token, slot)'s weighted expert output [T * k, D] (bf16 for MXFP4 experts, else x's dtype). Slot by
    slot (fixed shapes, no host sync), in chunks that bound the gathered weights."""
    t, k = indices.shape
    slot_dtype = torch.bfloat16 if experts.mxfp4 else x.dtype
    slots = torch.arange(t * k, device=x.device)
    chunk = max(1, (1 << 24) // (experts.inter * experts.hidden))
    outs = []
    for start in range(0, t * k, chunk):
        slot = slots[start : start + chunk]
        expert, token = indices.reshape(-1)[slot], slot // k
        a = x[token]
        if experts.mxfp4:
            a = act_quant(a)
        gate = _slot_matmul(experts.gate, experts.gate_scale, expert, a).to(slot_dtype)
        up = _slot_matmul(experts.up, experts.up_scale, expert, a).to(slot_dtype)
        h = (swiglu(gate, up, limit) * weights.reshape(-1)[slot, None].float()).to(slot_dtype)
        if experts.mxfp4:
            h = act_quant(h)
        outs.append(_slot_matmul(experts.down, experts.down_scale, expert, h.to(a.dtype)).to(slot_dtype))
    return torch.cat(outs) if outs else x.new_zeros(0, experts.hidden, dtype=slot_dtype)


def combine_reference(slots: torch.Tensor, k: int, shared: torch.Tensor | None, out_dtype: torch.dtype):
    """slots [T * k, D] -> their per-token sum in fp32 (slot order), plus shared [T, D], in out_dtype."""
    y = slots.view(-1, k, slots.shape[1]).sum(dim=1, dtype=torch.float32)
    if shared is not None:
        y = y + shared.float()
    return y.to(out_dtype)


# ---- the Triton kernels ----


@triton.jit
def _round_to_bf16(x):
    """Nearest bf16 (ties to even), kept in fp32: a later bf16 store is then exact (the interpreter truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _act_quant_parts(a):
    """a [rows, 128] fp32 -> (e4m3 values [rows, 128] in fp32, each row's power-of-two scale [rows]): act_quant."""
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
    return tl.where((bits & 0x7F800000) >= (121 << 23), normal, subnormal), scale


@triton.jit(do_not_specialize=["rows", "k_slots"])
def _expert_act_quant_kernel(
    x_ptr,
    stride_x,
    order_ptr,
    k_slots,
    out_ptr,
    stride_out,
    xs_ptr,
    stride_xs,
    rows,
    K,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    CHUNK: tl.constexpr,
    E4M3: tl.constexpr,
    GATHER: tl.constexpr,
    PDL: tl.constexpr,
):
    """act_quant of ROWS rows x COLS columns (whole 128-groups and K steps of CHUNK), stored dequantised (e4m3
    times a power of two: exact in bf16) in the MMA column order of each K step (`_e2m1_tile`), so the GEMMs load
    them as they are; E4M3 (the e4m3 MMA's activations, `_grouped_gemm_kernel`'s COLUMN_GROUPS): the e4m3 values,
    each 32-group's columns in that MMA's order (`_e2m1_e4m3_tile`), and in xs each row's 128-group scales.
    GATHER: output row r is x's row of the token of sorted slot r (order[r] // k_slots), the activations in expert
    order. PDL: launched early; x is read after the launch before this one ends."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (r < rows)[:, None] & (c < K)[None, :]
    if PDL:
        tl.extra.cuda.gdc_wait()
    source = r.to(tl.int64)
    if GATHER:
        source = tl.load(order_ptr + r, mask=r < rows, other=0).to(tl.int64) // k_slots
    a = tl.load(x_ptr + source[:, None] * stride_x + c[None, :], mask=ok, other=0.0)
    q, scale = _act_quant_parts(a.to(tl.float32).reshape(ROWS * COLS // 128, 128))
    if E4M3:
        # column 8j + 2i + h of a group is its column 16h + 4j + i in the MMA's order
        q = q.reshape(ROWS, COLS // 32, 4, 4, 2).permute(0, 1, 4, 2, 3).reshape(ROWS, COLS)
        chunks = tl.program_id(1) * (COLS // 128) + tl.arange(0, COLS // 128)
        xs_at = xs_ptr + r.to(tl.int64)[:, None] * stride_xs + chunks[None, :]
        tl.store(xs_at, scale.reshape(ROWS, COLS // 128), mask=(r < rows)[:, None] & (chunks * 128 < K)[None, :])
    else:
        q = (q * scale[:, None]).reshape(ROWS, COLS // CHUNK, 4, CHUNK // 32, 2, 4)
        q = q.permute(0, 1, 3, 5, 2, 4).reshape(ROWS, COLS)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :], q.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _e2m1_tile(words, scale, BK: tl.constexpr, PTX: tl.constexpr):
    """Packed codes as int32 words [R, BK/8] (a row's bytes 4w..4w+3, little-endian) and e8m0 bytes [R, BK/32]
    -> bf16 [R, BK] (fp32 under the interpreter, PTX False), exact, in the MMA column order (`mma_columns`).

    A code's low three bits at bf16 bits 6-8 (its sign at 15) read as its value times 2^-126 (code 1, 0.5, is
    then the subnormal 2^-127); times the bf16 2^(s-1) that is the value times 2^(s-127). Valid for scale bytes
    up to 128 (weights up to 12). A word holds eight codes and gives four bf16 pairs by masks and multiplies:
    pair k of word w holds the row's columns 8w + k and 8w + k + 4 (the low nibbles of bytes 0 and 2, their high
    nibbles, then bytes 1 and 3), whose pairs of bits sit 16 apart in the word as in the bf16 pair. The MMA's
    threads then each hold a run of whole words of a row (`mma_columns`)."""
    rows: tl.constexpr = words.shape[0]
    w = words.to(tl.uint32, bitcast=True)
    high = w >> 8
    bits: tl.constexpr = 0x81C081C0  # a bf16 pair's sign bits and the low three bits of its exponents
    # One nibble of bytes 0 and 2 (or 1 and 3) times 2^6 + 2^12 (low nibble) or 2^2 + 2^8 (high): its magnitude
    # lands at bits 6-8, its sign at 15, and the shifted copies do not overlap (no carries).
    pair0 = ((w & 0x000F000F) * 0x1040) & bits
    pair1 = ((w & 0x00F000F0) * 0x104) & bits
    pair2 = ((high & 0x000F000F) * 0x1040) & bits
    pair3 = ((high & 0x00F000F0) * 0x104) & bits
    pair = tl.join(tl.join(pair0, pair2), tl.join(pair1, pair3)).reshape(rows, BK // 2)  # pair0, pair1, ..
    if PTX:  # one bf16x2 multiply a pair (ptxas pairs the compiler's bf16 multiplies with two half swaps each)
        w = tl.join(pair.to(tl.int16), (pair >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)
        m = ((scale.to(tl.int32) + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        m = tl.broadcast_to(m[:, :, None, None], (rows, BK // 32, 16, 2)).reshape(rows, BK // 2, 2)
        w = tl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
            "=r,r,r",
            [w, m],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=2,
        )
    else:  # the interpreter: the same bits as fp32 (its bf16 arithmetic and subnormals are not IEEE)
        w = tl.join(pair << 16, pair & 0xFFFF0000).to(tl.float32, bitcast=True)
        m = ((scale.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)
        w = w.reshape(rows, BK // 32, 16, 2) * m[:, :, None, None]
    return w.reshape(rows, 4, BK // 8, 2).permute(0, 2, 1, 3).reshape(rows, BK)


# Four e2m1 codes' magnitude bits at e4m3 bits 2-4 and signs at bit 7, for the low nibbles ($0) and the high ($1)
# of a word's four bytes ($2).
_E2M1_TO_E4M3 = tl.constexpr(
    "{ .reg .b32 t, u; shl.b32 t, $2, 2; and.b32 t, t, 0x1C1C1C1C; shl.b32 u, $2, 4; and.b32 u, u, 0x80808080; "
    "or.b32 $0, t, u; shr.b32 t, $2, 2; and.b32 t, t, 0x1C1C1C1C; and.b32 u, $2, 0x80808080; or.b32 $1, t, u; }"
)


@triton.jit
def _e2m1_e4m3_tile(codes, BK: tl.constexpr, PTX: tl.constexpr):
    """Packed codes as bytes [R, BK/2] -> [R, BK]: each code's value times 2^-6 as e4m3 (fp32 under the
    interpreter, PTX False), exact, each 32-group's columns in the e4m3 MMA's order: a group's bytes 4j..4j+3
    (a thread's register of the MMA's operand) give its columns 16h + 4j + i = the codes of column 8j + 2i + h.
    A code's three low bits at e4m3 bits 2-4 read as its value times 2^-6 (code 1, 0.5, then the subnormal 2^-7),
    its sign at bit 7: seven integer instructions a word of eight codes, no multiply (the scales are applied to
    the MMA's fp32 sums)."""
    rows: tl.constexpr = codes.shape[0]
    if PTX:
        low, high = tl.inline_asm_elementwise(
            _E2M1_TO_E4M3, "=r,=r,r", [codes], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
        )
    else:
        low, high = _e2m1_value(codes & 15), _e2m1_value(codes >> 4)
    w = tl.join(low.reshape(rows, BK // 32, 16), high.reshape(rows, BK // 32, 16)).permute(0, 1, 3, 2)
    w = w.reshape(rows, BK)
    if PTX:
        w = w.to(tl.float8e4nv, bitcast=True)
    return w


@triton.jit
def _e2m1_value(code):
    """e2m1 codes (uint8) -> their values times 2^-6 in fp32."""
    exponent = ((code >> 1) & 3).to(tl.float32)
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * tl.exp2(exponent - 1.0))
    return tl.where((code & 8) != 0, -magnitude, magnitude) * (1.0 / 64.0)


def e4m3_mma_columns(bk: int) -> torch.Tensor:
    """The row column (of a K step of bk) each column of `_e2m1_e4m3_tile`'s result holds: in each 32-group,
    column 16h + 4j + i holds the group's column 8j + 2i + h (the e4m3 act_quant stores activations so)."""
    p = torch.arange(bk)
    within = p % 32
    return p - within + 8 * ((within % 16) // 4) + 2 * (within % 4) + within // 16


def mma_columns(bk: int) -> torch.Tensor:
    """The row column (of a K step of bk) that each column of `_e2m1_tile`'s result holds: result pair 4q + a
    (a < 4: the MMA thread's lane mod 4) is decoded pair n = a bk/8 + q, which holds columns 8 (n // 4) + n % 4
    and that + 4. The expert act_quant kernel stores activations in the same order."""
    pair = torch.arange(bk // 2)
    n = (pair % 4) * (bk // 8) + pair // 4
    first = 8 * (n // 4) + n % 4
    return torch.stack((first, first + 4), dim=1).flatten()


@triton.jit
def _column_group_steps(
    a_ptr, stride_a, xs_ptr, stride_xs, order_ptr, k_slots, row0, row_end, w_at, s_rows, w_ok, K,
    WROWS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, GATED: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """`_grouped_gemm_kernel`'s K steps with COLUMN_GROUPS = C: its fp32 sums [weight rows, BM] of one tile."""
    n = tl.arange(0, 16)  # the MMA's columns: tile row n // C, group n % C of the step
    rows = row0 + n // C
    ok = rows < row_end
    slot = tl.load(order_ptr + rows, mask=ok, other=0)
    a_rows = (slot // k_slots if GATED else rows).to(tl.int64)
    a_at = a_ptr + a_rows[None, :] * stride_a + tl.arange(0, BK)[:, None]
    # column n multiplies its row's group n % C of the step (zeros elsewhere: a masked load reads nothing)
    a_ok = ok[None, :] & (((tl.arange(0, BK) // 32) % C)[:, None] == (n % C)[None, :])
    xs_at = xs_ptr + a_rows * stride_xs
    s_at = s_rows[:, None] + (n % C)[None, :]
    acc = tl.zeros((WROWS, 16), tl.float32)
    for k0 in range(0, K, BK):
        w = _e2m1_e4m3_tile(tl.load(w_at, mask=w_ok[:, None], other=0), BK, PTX)
        a = tl.load(a_at, mask=a_ok, other=0.0)
        scale = tl.load(s_at, mask=w_ok[:, None], other=0).to(tl.int32)
        x_scale = tl.load(xs_at + (k0 // 32 + n % C) // 4, mask=ok, other=0.0)
        # weight scale 2^(s-127) times 2^6 (`_e2m1_e4m3_tile`) times the activations' scale
        factor = ((scale + 6) << 23).to(tl.float32, bitcast=True) * x_scale[None, :]
        acc += tl.dot(w, a) * factor
        w_at += BK // 2
        s_at += C
        a_at += BK
    return tl.sum(acc.reshape(WROWS, BM, C), 2)


@triton.jit(do_not_specialize=["n_experts", "k_slots", "K", "N", "early_steps"])
def _grouped_gemm_kernel(
    a_ptr,
    stride_a,
    xs_ptr,
    stride_xs,
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
    early_steps,
    E_PAD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    MXFP4: tl.constexpr,
    COLUMN_GROUPS: tl.constexpr,
    GATED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    PTX: tl.constexpr,
    TMA_A: tl.constexpr,
    PDL: tl.constexpr,
    PART: tl.constexpr,
    WIDE_ROWS: tl.constexpr,
    REST_ROWS: tl.constexpr,
):
    """GATED: out[row] = swiglu(gate a[token], up a[token]) * route_w[slot] for the expert-sorted rows (a = the
    activations); else out[slot] = down a[row] (a = the first pass's output). Program (n, m): weight rows
    n*BN.. (gate-up: BN gate rows then BN up rows, one MMA operand) times rows m*BM.. of one expert.
    TMA_A: a_ptr is a TMA descriptor of activations already in expert order (row = sorted row, [BM, BK] boxes):
    tiles of whole rows arrive by one copy instruction, and the rows past the expert's (another expert's, or
    zeros past the end) are computed and not stored.
    PDL: launched early; the routing (from launches before the previous one) is read at once, and the weights of
    the first `early_steps` K steps asked into L2 (a line a weight row and step), `a` read after the previous
    launch ends.
    COLUMN_GROUPS (C, MXFP4 on e4m3 devices, few rows an expert): the MMA multiplies e4m3 weights by e4m3
    activations (`_e2m1_e4m3_tile`, `_expert_act_quant_kernel`) over a K step of C 32-groups; its 16 columns are
    the tile's BM = 16 / C rows times the step's C groups (a row's activations, loaded masked to one group a
    column), so that every column sums one group of one row and is scaled in fp32 by the group's weight scale and
    the row's activation scale (xs) after the MMA; the columns of a row are summed at the end. One row a tile
    (C = 16): an MMA instruction a 32-group and no other work a group but its weights' decoding.
    PART "all": every row of an expert in BM-row tiles. A pass of two launches (`GemmPlan.rest`): "wide" (BM =
    WIDE_ROWS) takes an expert's whole tiles and one more for a remainder of more than REST_ROWS rows; "rest" (BM =
    REST_ROWS) a remainder of up to REST_ROWS rows past the whole tiles, in one tile."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    ids = tl.arange(0, E_PAD)
    lo = tl.load(bounds_ptr + ids, mask=ids < n_experts, other=0)
    hi = tl.load(bounds_ptr + ids + 1, mask=ids < n_experts, other=0)
    first = lo
    if PART == "wide":
        rest = (hi - lo) % BM
        tiles = (hi - lo) // BM + (rest > REST_ROWS).to(tl.int32)
    elif PART == "rest":
        rest = (hi - lo) % WIDE_ROWS
        first = hi - rest
        tiles = ((rest > 0) & (rest <= BM)).to(tl.int32)
    else:
        tiles = (hi - lo + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
    if expert >= n_experts:
        if PDL:  # not before the previous launch ends: a launch whose programs all return here would end first
            tl.extra.cuda.gdc_wait()
        return
    mine = ids == expert
    row0 = tl.sum(tl.where(mine, first + (pid_m - tile_end + tiles) * BM, 0), 0)
    row_end = tl.sum(tl.where(mine, hi, 0), 0)
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    slot = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    a_rows = (slot // k_slots if GATED else rows).to(tl.int64)
    WROWS: tl.constexpr = 2 * BN if GATED else BN
    r = tl.arange(0, WROWS)
    cols = pid_n * BN + r % BN
    col_ok = cols < N
    w_base = expert.to(tl.int64) * stride_we + cols * stride_wn
    w_rows = (tl.where(r < BN, gate_ptr, up_ptr) if GATED else gate_ptr) + w_base
    # MXFP4: int32 words of eight codes (bytes of two with COLUMN_GROUPS)
    WK: tl.constexpr = BK // 2 if COLUMN_GROUPS else (BK // 8 if MXFP4 else BK)
    if not TMA_A:
        a_at = a_ptr + a_rows[None, :] * stride_a + tl.arange(0, BK)[:, None]
    w_at = w_rows[:, None] + tl.arange(0, WK)[None, :]
    if MXFP4:
        s_rows = (tl.where(r < BN, gate_scale_ptr, up_scale_ptr) if GATED else gate_scale_ptr) + (
            expert.to(tl.int64) * stride_se + cols * stride_sn
        )
        s_at = s_rows[:, None] + tl.arange(0, BK // 32)[None, :]
    if PDL:
        for step in range(0, early_steps):
            prefetch_to_l2(tl.where(col_ok, w_rows, gate_ptr) + step * WK)
        tl.extra.cuda.gdc_wait()
    if COLUMN_GROUPS:
        acc = _column_group_steps(
            a_ptr, stride_a, xs_ptr, stride_xs, order_ptr, k_slots, row0, row_end, w_at, s_rows, col_ok, K, WROWS,
            BM, BK, COLUMN_GROUPS, GATED, PTX,
        )  # fmt: skip
    else:
        acc = tl.zeros((WROWS, BM), tl.float32)
        for k0 in range(0, K, BK):  # K is a multiple of BK: no column masks, so loads stay vectorised
            if TMA_A:
                a = tl.trans(a_ptr.load([row0, k0]))
            else:
                a = tl.load(a_at, mask=row_ok[None, :], other=0)
                a_at += BK
            if MXFP4:
                w = _e2m1_tile(
                    tl.load(w_at, mask=col_ok[:, None], other=0), tl.load(s_at, mask=col_ok[:, None]), BK, PTX
                )
                s_at += BK // 32
            else:
                w = tl.load(w_at, mask=col_ok[:, None], other=0)
            w_at += WK
            acc = tl.dot(w.to(DOT), a.to(DOT), acc, input_precision=PRECISION)
    if GATED:
        gate, up = tl.split(acc.reshape(2, BN, BM).permute(1, 2, 0))
        if ROUND_BF16:
            gate = _round_to_bf16(gate)
            up = _round_to_bf16(up)
        h = clamped_swiglu(gate, up, limit) * tl.load(route_w_ptr + slot, mask=row_ok, other=0.0)[None, :]
        if ROUND_BF16:
            h = _round_to_bf16(h)
        out_cols = pid_n * BN + tl.arange(0, BN)
        dest = out_ptr + rows.to(tl.int64)[None, :] * stride_out + out_cols[:, None]
        tl.store(dest, h.to(out_ptr.dtype.element_ty), mask=(out_cols < N)[:, None] & row_ok[None, :])
    else:
        y = acc
        if ROUND_BF16:
            y = _round_to_bf16(y)
        dest = out_ptr + slot.to(tl.int64)[None, :] * stride_out + cols[:, None]
        tl.store(dest, y.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & row_ok[None, :])


@dataclass(frozen=True)
class GemmPlan:
    """Tiles and launch settings of one grouped-GEMM pass: bm rows (tokens: the MMA's N) by `weight_rows` (the
    MMA's M; the gate-up pass takes half of them from gate, half from up) by bk columns a K step."""

    bm: int
    weight_rows: int
    bk: int
    warps: int
    stages: int
    tma: bool = False  # MXFP4: activations in expert order, tiles read by TMA (`_grouped_gemm_kernel`'s TMA_A)
    # A second launch for each expert's remainder of up to rest.bm rows past its whole bm tiles (larger ones take
    # one more bm tile): a skewed routing's lightly loaded experts then fill rest.bm-row tiles, not bm-row ones.
    rest: GemmPlan | None = None
    # MXFP4 on e4m3 devices: the e4m3 MMA whose 16 columns are bm rows x column_groups 32-groups, K steps of
    # bk = 32 column_groups (`_grouped_gemm_kernel`'s COLUMN_GROUPS); 0: the bf16 MMA with bm rows as columns.
    column_groups: int = 0

    def __post_init__(self):
        if self.column_groups and (self.bm * self.column_groups != 16 or self.bk != 32 * self.column_groups):
            raise ValueError(f"a column-group plan has bm x column_groups = 16 and bk = 32 column_groups: {self}")


# The chosen settings (the sweep lives in `ds4 bench moe`), by the average rows a touched expert gets: row
# tiles hold them; decode batches take weight tiles of 128 rows, or of 64 (one warpgroup's MMA) where that
# leaves fewer than _PROGRAMS_PER_SM programs an SM; prefill tiles decode each weight once for up to 256 rows.
# Prefill's second launch (GemmPlan.rest): an expert's remainder of up to 128 rows, with the wide tiles' K step.
_PREFILL_REST = GemmPlan(bm=128, weight_rows=128, bk=128, warps=4, stages=3)
_TIERS = (  # (rows per touched expert up to, plan at most stages deep)
    (16, GemmPlan(bm=16, weight_rows=128, bk=256, warps=4, stages=4)),
    (32, GemmPlan(bm=32, weight_rows=128, bk=256, warps=4, stages=4)),
    (64, GemmPlan(bm=64, weight_rows=128, bk=128, warps=4, stages=4)),
    (128, GemmPlan(bm=128, weight_rows=128, bk=64, warps=4, stages=4)),
    (None, GemmPlan(bm=256, weight_rows=128, bk=128, warps=8, stages=3, tma=True, rest=_PREFILL_REST)),
)
# The same where the MMA takes both operands from registers (mma.sync: sm_80 to sm_89, sm_120): the decoded weights
# and the activations' fragments sit beside the fp32 accumulator, so the wider tiles take 8 warps and the widest 64
# weight rows and K steps of 64. Offline (ptxas, gate-up and down passes at Flash's shapes): _TIERS's 64-, 128-
# and 256-row plans spill 48-72, 248-304 and 144-2720 bytes a thread on sm_80 and sm_120; these none (at most 233
# registers; 8 bytes of stack on sm_120 with TMA).
_REGISTER_ROWS_128 = GemmPlan(bm=128, weight_rows=128, bk=64, warps=8, stages=4)
_REGISTER_OPERAND_TIERS = (
    (16, GemmPlan(bm=16, weight_rows=128, bk=256, warps=4, stages=4)),
    (32, GemmPlan(bm=32, weight_rows=128, bk=256, warps=4, stages=4)),
    (64, GemmPlan(bm=64, weight_rows=128, bk=128, warps=8, stages=4)),
    (128, _REGISTER_ROWS_128),
    (None, GemmPlan(bm=256, weight_rows=64, bk=64, warps=8, stages=3, tma=True, rest=_REGISTER_ROWS_128)),
)
# Where the MMA takes e4m3 (sm_89+) and a batch sends each expert one row (one token): one-row tiles whose 16 MMA
# columns are 16 32-groups, so decoding and scaling take a fraction of the bf16 MMA's instructions a weight byte
# (offline, sm_90: 1.8 against 3.9 a code). H100, one Flash MoE layer at one token: 0.041 ms against the bf16
# plan's 0.047. Tiles of two or four rows (GemmPlan.column_groups 8, 4) gained nothing at 8 to 64 tokens, or lost
# (`ds4 bench moe --sweep`); there the bf16 MMA's tiles stay.
_COLUMN_GROUP_TIERS = (  # (rows per touched expert up to, plan)
    (1.05, GemmPlan(bm=1, weight_rows=64, bk=512, warps=4, stages=3, column_groups=16)),
)
_MIN_WEIGHT_ROWS = 64
_PROGRAMS_PER_SM = 2
_ACT_QUANT_ELEMENTS = 2048  # an act_quant program's tile
_ELEMENTWISE_BLOCK = 1024  # columns a program of the slot sum takes
_COMBINE_STAGES = tl.constexpr(3)  # slot rows in flight while the slot sum adds them (decode: few programs)


def plan_shared_memory(plan: GemmPlan, mxfp4: bool, a_bytes: int) -> int:
    """Bytes of shared memory the pipelined operand tiles of a plan take (`stages` copies)."""
    w_bytes = plan.bk // 2 + plan.bk // MXFP4_GROUP if mxfp4 else plan.bk * a_bytes
    a_tile = 16 * plan.bk if plan.column_groups else plan.bm * plan.bk * a_bytes  # 16 e4m3 columns
    return plan.stages * (a_tile + plan.weight_rows * w_bytes)


def gemm_plan(
    rows: int,
    n_experts: int,
    n: int,
    k: int,
    gated: bool,
    mxfp4: bool,
    a_bytes: int,
    sms: int,
    shared_memory: int,
    tma: bool = True,
    registers_hold_operands: bool = False,
    e4m3_mma: bool = False,
) -> GemmPlan:
    """The plan for `rows` (token, slot) rows, n output columns (gated: of gate and of up), K = k, from the
    device's SM count and shared memory (and whether it has TMA, whether its MMA takes its operands from
    registers, whether it multiplies e4m3): fewer stages, then narrower K steps where it has less."""
    touched = max(1.0, n_experts * -math.expm1(rows * math.log1p(-1 / n_experts)))  # distinct experts, uniform
    tiers = _REGISTER_OPERAND_TIERS if registers_hold_operands else _TIERS
    if e4m3_mma and mxfp4:
        tiers = tuple((limit, p) for limit, p in _COLUMN_GROUP_TIERS if k % p.bk == 0) + tiers
    plan = next(p for limit, p in tiers if limit is None or rows / touched <= limit)
    # TMA where the device has it and the act_quant pass puts the activations (MXFP4's) in expert order; a pass's
    # two launches read them alike
    use_tma = plan.tma and mxfp4 and tma
    plan = replace(plan, tma=use_tma, rest=plan.rest and replace(plan.rest, tma=use_tma))
    while (
        plan.weight_rows > _MIN_WEIGHT_ROWS
        and touched * triton.cdiv(n, plan.weight_rows // (2 if gated else 1)) < _PROGRAMS_PER_SM * sms
    ):
        plan = replace(plan, weight_rows=plan.weight_rows // 2)
    return _fit(plan, k, mxfp4, a_bytes, shared_memory)


def _fit(plan: GemmPlan, k: int, mxfp4: bool, a_bytes: int, budget: int) -> GemmPlan:
    """K steps that divide K, then fewer stages and narrower K steps until the pipelined tiles fit `budget` (a
    first cut: `_fitted` checks the compiled kernel's own size); the same for the rest launch's plan."""
    min_bk = plan.bk if plan.column_groups else MXFP4_GROUP if mxfp4 else 16  # a scale group; the MMA's K
    bk = plan.bk
    while k % bk and bk > min_bk:
        bk //= 2
    if k % bk:
        raise ValueError(f"routed experts need K ({k}) to be a multiple of {min_bk}")
    plan = replace(plan, bk=bk)
    while plan.stages > 2 and plan_shared_memory(plan, mxfp4, a_bytes) > budget:
        plan = replace(plan, stages=plan.stages - 1)
    while plan.bk > min_bk and plan_shared_memory(plan, mxfp4, a_bytes) > budget:
        plan = replace(plan, bk=plan.bk // 2)
    if plan.rest is None:
        return plan
    rest = _fit(replace(plan.rest, bk=min(plan.rest.bk, plan.bk)), k, mxfp4, a_bytes, budget)
    return replace(plan, bk=rest.bk, rest=rest)  # one K step for both launches (their activations' column order)


_FITTED: dict[tuple, GemmPlan] = {}


def _fitted(plan: GemmPlan, key: tuple, compile_plan, shared_memory: int, mxfp4: bool) -> GemmPlan:
    """`plan`, or the same with fewer stages, then narrower K steps, until its compiled kernel fits in
    `shared_memory` bytes: plan_shared_memory counts the pipelined operand tiles only, the compiler adds buffers of
    its own (the decoded weight tile, layout changes); its rest launch's plan alike. compile_plan(plan, part,
    split) compiles one launch (`_launches`). Compiled once per plan and key (dtypes, device)."""
    key = (plan, *key)
    if key not in _FITTED:
        fitted = _fitted_launch(plan, "wide" if plan.rest else "all", plan, compile_plan, shared_memory, mxfp4)
        if plan.rest:  # one K step for both launches (their activations' column order): the smaller of the two
            rest = _fitted_launch(
                replace(plan.rest, bk=min(plan.rest.bk, fitted.bk)), "rest", plan, compile_plan, shared_memory, mxfp4
            )
            if rest.bk < fitted.bk:
                fitted = _fitted_launch(replace(fitted, bk=rest.bk), "wide", plan, compile_plan, shared_memory, mxfp4)
            fitted = replace(fitted, rest=rest)
        _FITTED[key] = fitted
    return _FITTED[key]


def _fitted_launch(launch: GemmPlan, part: str, plan: GemmPlan, compile_plan, shared_memory: int, mxfp4: bool):
    """One launch's plan of `plan`'s pass, fitted as `_fitted` says."""
    split = _split(plan)
    fitted, min_bk = launch, launch.bk if launch.column_groups else MXFP4_GROUP if mxfp4 else 16
    while compile_plan(fitted, part, split).metadata.shared > shared_memory:
        if fitted.stages > 2:
            fitted = replace(fitted, stages=fitted.stages - 1)
        elif fitted.bk > min_bk:
            fitted = replace(fitted, bk=fitted.bk // 2)
        else:
            raise RuntimeError(f"no grouped-GEMM plan fits in {shared_memory} bytes of shared memory ({launch})")
    return fitted


def _split(plan: GemmPlan) -> tuple[int, int]:
    """(wide, rest) row tiles of a pass of two launches; (0, 0) for one."""
    return (plan.bm, plan.rest.bm) if plan.rest else (0, 0)


def _launches(plan: GemmPlan) -> list[tuple[GemmPlan, str]]:
    """The launches of one grouped-GEMM pass: (plan, part) for `_grouped_gemm_kernel`'s PART."""
    return [(plan, "wide"), (plan.rest, "rest")] if plan.rest else [(plan, "all")]


def _act_quant(
    x: torch.Tensor,
    rows: int,
    chunk: int,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    k_slots: int = 1,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """act_quant of x's first `rows` rows, dequantised in bf16 (into `out` if given), columns in the MMA order of
    K steps of `chunk`; with `order` (the slots in expert order), out's rows are its slots' tokens' rows. With
    `scales`: the e4m3 MMA's activations (`_expert_act_quant_kernel`'s E4M3) into `out`, the 128-group scales into
    `scales` [rows, K / 128]."""
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.bfloat16, device=x.device)
    cols = max(ACT_GROUP, chunk)
    block_rows = max(1, _ACT_QUANT_ELEMENTS // cols)
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(x.shape[1], cols))
    pdl = launches_dependents_early(x.device)
    xs = scales if scales is not None else out
    _expert_act_quant_kernel[grid](
        x, x.stride(0), order if order is not None else x, k_slots, out, out.stride(0), xs, xs.stride(0), rows,
        x.shape[1], ROWS=block_rows, COLS=cols, CHUNK=chunk, E4M3=scales is not None, GATHER=order is not None,
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return out


def _e4m3_activations(rows: int, k: int, device: torch.device):
    """The e4m3 MMA's activation buffers of `rows` rows (`_act_quant`'s out and scales): e4m3 on the GPU, fp32
    (the same values) under the interpreter."""
    dtype = torch.float32 if interpreting() else torch.float8_e4m3fn
    a = torch.empty(max(1, rows), k, dtype=dtype, device=device)
    return a, torch.empty(max(1, rows), k // ACT_GROUP, dtype=torch.float32, device=device)


def _grouped_gemm(
    a, order, bounds, w, up, scale, up_scale, route_w, out, n_experts, k_slots, limit, plan, part, split,
    compile_only=False, a_scales=None,
):  # fmt: skip
    """One launch of a grouped-GEMM pass (`_launches`: part, and the pass's (wide, rest) row tiles); compile_only:
    compile it for `plan` without launching, returning the kernel. a_scales: the activations' scales of a
    column-group plan."""
    gated = up is not None
    mxfp4 = scale is not None
    k_dim = w.shape[2] * (2 if mxfp4 else 1)
    if mxfp4 and not plan.column_groups:  # eight e2m1 codes an int32 word (`_e2m1_tile`)
        w, up = w.view(torch.int32), up.view(torch.int32) if gated else None
    n = w.shape[1]
    bn = plan.weight_rows // 2 if gated else plan.weight_rows
    rows = order.shape[0]
    dot = tl.float32 if interpreting() or a.dtype == torch.float32 else tl.bfloat16
    touched = min(n_experts, rows)
    if part == "rest":  # one tile an expert at most
        row_tiles = touched
    elif part == "wide":  # a remainder of up to split[1] rows takes no tile here
        row_tiles = (rows + touched * (plan.bm - split[1] - 1)) // plan.bm
    else:
        row_tiles = (rows + touched * (plan.bm - 1)) // plan.bm
    grid = (triton.cdiv(n, bn), row_tiles)
    pdl = launches_dependents_early(a.device)
    # weight bytes a K step of all programs reads (surplus programs ask for none)
    step_bytes = grid[0] * grid[1] * plan.weight_rows * (plan.bk // 2 if mxfp4 else plan.bk * w.element_size())
    early_steps = min(k_dim // plan.bk, early_prefetch_bytes(a.device) // max(1, step_bytes)) if pdl else 0
    launch = functools.partial(_grouped_gemm_kernel.warmup, grid=grid) if compile_only else _grouped_gemm_kernel[grid]
    xs = a_scales if plan.column_groups else a
    return launch(
        TensorDescriptor.from_tensor(a, [plan.bm, plan.bk]) if plan.tma else a,
        a.stride(0),
        xs,
        xs.stride(0),
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
        early_steps,
        E_PAD=triton.next_power_of_2(n_experts),
        BM=plan.bm,
        BN=bn,
        BK=plan.bk,
        MXFP4=mxfp4,
        COLUMN_GROUPS=plan.column_groups,
        GATED=gated,
        ROUND_BF16=out.dtype == torch.bfloat16,
        DOT=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32",
        PTX=not interpreting(),
        TMA_A=plan.tma,
        PDL=pdl,
        PART=part,
        WIDE_ROWS=split[0],
        REST_ROWS=split[1],
        num_warps=plan.warps,
        num_stages=plan.stages,
        launch_pdl=pdl,
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


# N (the hidden size: one variant a model) stays specialised: its divisibility by 16 makes the loads 16 bytes wide.
@triton.jit(do_not_specialize=["k_slots"])
def _combine_kernel(
    slots_ptr, stride_s, shared_ptr, stride_sh, out_ptr, stride_out, k_slots, N, HAS_SHARED: tl.constexpr,
    BN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = sum of slots[t * k + j] over j in slot order, in fp32, plus shared[t] (combine_reference). PDL:
    launched early."""
    dependent_launch_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = cols < N
    y = tl.zeros((BN,), tl.float32)
    for j in tl.range(0, k_slots, num_stages=_COMBINE_STAGES):
        y += tl.load(slots_ptr + (t * k_slots + j) * stride_s + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        y += tl.load(shared_ptr + t * stride_sh + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _combine(slots: torch.Tensor, k: int, shared: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    t, n = slots.shape[0] // k, slots.shape[1]
    out = torch.empty(t, n, dtype=out_dtype, device=slots.device)
    bn = min(_ELEMENTWISE_BLOCK, triton.next_power_of_2(n))
    pdl = launches_dependents_early(slots.device)
    _combine_kernel[(t, triton.cdiv(n, bn))](
        slots, slots.stride(0), shared if shared is not None else slots, shared.stride(0) if shared is not None else 0,
        out, out.stride(0), k, n, HAS_SHARED=shared is not None, BN=bn, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out


def routed_experts_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: ExpertWeights,
    limit: float,
    plans: tuple[GemmPlan, GemmPlan] | None = None,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """routed_experts_reference through the grouped-GEMM kernels (no host sync; any device Triton runs on).
    plans: (gate-up pass, down pass) instead of gemm_plan's, for tile sweeps. groups: the routes' (order,
    bounds) if the router made them (moe_routing.Routes), else they are made here."""
    if indices.shape[0] == 0:
        return x.new_zeros(0, experts.hidden, dtype=out_dtype)
    slots = routed_slots_triton(x, weights, indices, experts, limit, plans, groups)
    return _combine(slots, indices.shape[1], shared, out_dtype)


def routed_slots_triton(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: ExpertWeights,
    limit: float,
    plans: tuple[GemmPlan, GemmPlan] | None = None,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """routed_slots_reference through the grouped-GEMM kernels (arguments as routed_experts_triton's)."""
    _check(x, experts)
    t, k = indices.shape
    slot_dtype = torch.bfloat16 if experts.mxfp4 else x.dtype
    if t == 0:
        return x.new_zeros(0, experts.hidden, dtype=slot_dtype)
    n_experts, inter, hidden = experts.gate.shape[0], experts.inter, experts.hidden
    order, bounds = groups or group_by_expert(indices, n_experts)
    sms, smem = num_sms(x.device), shared_memory_per_block(x.device)
    a_bytes = 2 if experts.mxfp4 or x.dtype == torch.bfloat16 else 4
    traits = (sms, smem, has_tma(x.device), mma_operands_in_registers(x.device), has_fp8(x.device))
    plan1, plan2 = plans or (
        gemm_plan(t * k, n_experts, inter, hidden, True, experts.mxfp4, a_bytes, *traits),
        gemm_plan(t * k, n_experts, hidden, inter, False, experts.mxfp4, a_bytes, *traits),
    )
    h = torch.empty(t * k, inter, dtype=slot_dtype, device=x.device)
    out = torch.empty(t * k, hidden, dtype=slot_dtype, device=x.device)
    route_w = weights.reshape(-1).float()
    x = x.contiguous()
    if (plan1.column_groups or plan2.column_groups) and not experts.mxfp4:
        raise ValueError("column-group plans take MXFP4 experts (the e4m3 MMA multiplies their codes)")
    if plan1.tma and not experts.mxfp4:
        raise ValueError("TMA plans take MXFP4 experts (their act_quant pass puts the activations in expert order)")
    a_rows = t * k if plan1.tma else t
    a = torch.empty(a_rows, hidden, dtype=torch.bfloat16, device=x.device) if experts.mxfp4 else x
    a_scales = None
    if plan1.column_groups:
        a, a_scales = _e4m3_activations(a_rows, hidden, x.device)
    h_quant = torch.empty_like(h, dtype=torch.bfloat16) if experts.mxfp4 else h
    h_scales = None
    if plan2.column_groups:
        h_quant, h_scales = _e4m3_activations(t * k, inter, x.device)

    def gate_up(plan, part, split, compile_only=False):
        return _grouped_gemm(
            a, order, bounds, experts.gate, experts.up, experts.gate_scale, experts.up_scale, route_w, h,
            n_experts, k, limit, plan, part, split, compile_only, a_scales,
        )  # fmt: skip

    def down(plan, part, split, compile_only=False):
        return _grouped_gemm(
            h_quant, order, bounds, experts.down, None, experts.down_scale, None, route_w, out, n_experts, k, limit,
            plan, part, split, compile_only, h_scales,
        )  # fmt: skip

    if not interpreting() and plans is None:
        key = (experts.mxfp4, x.dtype, slot_dtype, x.device)
        plan1 = _fitted(plan1, ("gate-up", *key), functools.partial(gate_up, compile_only=True), smem, experts.mxfp4)
        plan2 = _fitted(plan2, ("down", *key), functools.partial(down, compile_only=True), smem, experts.mxfp4)
    if any(p.rest and (p.rest.bk, p.rest.tma) != (p.bk, p.tma) for p in (plan1, plan2)):
        raise ValueError("a pass's two launches read the activations alike: one K step (its MMA column order), TMA")
    if experts.mxfp4:
        _act_quant(x, a_rows, plan1.bk, a, order if plan1.tma else None, k, a_scales)
    for launch, part in _launches(plan1):
        gate_up(launch, part, _split(plan1))
    if experts.mxfp4:
        _act_quant(h, t * k, plan2.bk, h_quant, None, 1, h_scales)
    for launch, part in _launches(plan2):
        down(launch, part, _split(plan2))
    return out


def routed_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: ExpertWeights,
    limit: float,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    shared: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [T, D], router weights / expert indices [T, k] -> [T, D] in out_dtype, plus shared if given (module
    docstring); groups: (order, bounds) of the routes, if the router made them."""
    slots = routed_slots(x, weights, indices, experts, limit, groups)
    return combine_slots(slots, indices.shape[1], shared, out_dtype)


def routed_slots(
    x: torch.Tensor,
    weights: torch.Tensor,
    indices: torch.Tensor,
    experts: ExpertWeights,
    limit: float,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """routed_experts' first part: each (token, slot)'s weighted expert output [T * k, D]."""
    if x.is_cuda:
        return routed_slots_triton(x, weights, indices, experts, limit, None, groups)
    return routed_slots_reference(x, weights, indices, experts, limit)


def combine_slots(slots: torch.Tensor, k: int, shared: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """routed_experts' second part: a token's k slots [T * k, D] summed in fp32 (slot order), plus shared [T, D] if
    given, in out_dtype."""
    if slots.is_cuda and slots.shape[0]:
        return _combine(slots, k, shared, out_dtype)
    return combine_reference(slots, k, shared, out_dtype)
