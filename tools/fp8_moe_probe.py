"""Probe (not used by ds4), offline: what one decode-sized tile of the routed experts costs in instructions if the
MXFP4 codes became e4m3 bytes for the FP8 MMA instead of bf16 pairs for the bf16 one. Compiles a scratch kernel for
sm_90 (no GPU needed) and prints the SASS instructions of its K loop per weight byte a thread, beside ds4's own
decode tile (`ds4.kernels.moe._grouped_gemm_kernel` at 1 token).

A code's magnitude bits go to bits 2-4 of a byte and its sign to bit 7: the e4m3 value is the code times 2^-6
(exact), so a K step of 32 (one MXFP4 scale group) is one FP8 MMA whose fp32 product is scaled into the accumulator
by its row's 2^(s - 121). The scratch kernel loads its activations plainly (ds4's would pipeline them), so its
count is an upper bound for the decoding and the MMAs.

    PYTHONPATH=$PWD python3 tools/fp8_moe_probe.py
"""

from __future__ import annotations

import re
from collections import Counter

import torch
import triton
import triton.language as tl

from tools.offline_compile import compile_kernel, sass


@triton.jit
def _e2m1_to_e4m3(words, BK: tl.constexpr):
    """int32 words [R, BK/8] of eight codes (low nibble first) -> e4m3 [R, BK], each word's even codes then its odd."""
    rows: tl.constexpr = words.shape[0]
    w = words.to(tl.uint32, bitcast=True)
    even = ((w << 2) & 0x1C1C1C1C) | ((w << 4) & 0x80808080)
    odd = ((w >> 2) & 0x1C1C1C1C) | (w & 0x80808080)
    packed = tl.join(even, odd).reshape(rows, BK // 4).to(tl.int32, bitcast=True)
    spread = tl.broadcast_to(packed[:, :, None], (rows, BK // 4, 4)).reshape(rows, BK)
    # four bytes of one register, as the four int8 elements it packs
    codes = tl.inline_asm_elementwise("mov.b32 $0, $4;", "=r,r,r,r,r", [spread], dtype=tl.int8, is_pure=True, pack=4)
    return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _fp8_tile(w_ptr, s_ptr, a_ptr, out_ptr, K, WROWS: tl.constexpr, BM: tl.constexpr, GROUPS: tl.constexpr):
    r = tl.arange(0, WROWS)
    m = tl.arange(0, BM)
    acc = tl.zeros((WROWS, BM), tl.float32)
    for k0 in range(0, K, 32 * GROUPS):
        for g in tl.static_range(GROUPS):
            kg = k0 + g * 32
            words = tl.load(w_ptr + r[:, None] * (K // 8) + kg // 8 + tl.arange(0, 4)[None, :])
            a = tl.load(a_ptr + (kg + tl.arange(0, 32))[:, None] * BM + m[None, :])
            s = tl.load(s_ptr + r * (K // 32) + kg // 32).to(tl.int32)
            part = tl.dot(_e2m1_to_e4m3(words, 32), a)
            acc += part * ((s + 6) << 23).to(tl.float32, bitcast=True)[:, None]
    tl.store(out_ptr + r[:, None] * BM + m[None, :], acc)


def loop_counts(compiled) -> Counter:
    """Opcodes of the compiled kernel's longest loop."""
    ins = []
    for line in sass(compiled).splitlines():
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if found:
            ins.append((int(found.group(1), 16), found.group(2).strip()))
    loops = []
    for address, text in ins:
        target = re.search(r"BRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in ins if start <= a <= end)


def main() -> None:
    from ds4.kernels import moe

    t = {dtype: torch.empty(1, dtype=dtype) for dtype in (torch.int32, torch.uint8, torch.float32, torch.bfloat16)}
    args = dict(w_ptr=t[torch.int32], s_ptr=t[torch.uint8], a_ptr=torch.empty(1, dtype=torch.float8_e4m3fn))
    args.update(out_ptr=t[torch.float32], K=4096)
    for groups in (4, 8):
        counts = loop_counts(compile_kernel(_fp8_tile, args, dict(WROWS=64, BM=16, GROUPS=groups), 90, 4, 3))
        per_byte = sum(counts.values()) / (64 * 16 * groups / 128)
        print(f"e4m3 + FP8 MMA, {groups} groups a step: {per_byte:.1f} instructions a byte; {counts.most_common(8)}")
    n, k = 2048, 4096
    plan = moe.gemm_plan(6, 256, n, k, True, True, 2, 132, 232448, True)
    args = dict(
        a_ptr=t[torch.bfloat16], stride_a=k, order_ptr=t[torch.int32], bounds_ptr=t[torch.int32],
        gate_ptr=t[torch.int32], up_ptr=t[torch.int32], gate_scale_ptr=t[torch.uint8], up_scale_ptr=t[torch.uint8],
        stride_we=n * k // 8, stride_wn=k // 8, stride_se=n * k // 32, stride_sn=k // 32, route_w_ptr=t[torch.float32],
        out_ptr=t[torch.bfloat16], stride_out=n, n_experts=256, k_slots=6, K=k, N=n, limit=7.0, early_steps=2,
    )  # fmt: skip
    constexprs = dict(
        E_PAD=256, BM=plan.bm, BN=plan.weight_rows // 2, BK=plan.bk, MXFP4=True, GATED=True, ROUND_BF16=True,
        DOT=tl.bfloat16, PRECISION="tf32", PTX=True, TMA_A=False, PDL=True, PART="all", WIDE_ROWS=0, REST_ROWS=0,
    )  # fmt: skip
    counts = loop_counts(compile_kernel(moe._grouped_gemm_kernel, args, constexprs, 90, plan.warps, plan.stages))
    per_byte = sum(counts.values()) / (plan.weight_rows * plan.bk / 2 / (32 * plan.warps))
    print(f"ds4's bf16 decode tile ({plan}): {per_byte:.1f} instructions a byte; {counts.most_common(8)}")


if __name__ == "__main__":
    main()
