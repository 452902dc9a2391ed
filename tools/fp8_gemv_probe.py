"""Probe (not used by ds4): how fast can a plain FP8 GEMV (M = 1, no tl.dot, weight rows read K-contiguous,
fp32 FMA per 128-block times the block scale) read a 4096 x 4096 e4m3 weight on this GPU, over tile sizes and
K splits? Prints the best plans next to the copy-bandwidth roofline; a lead for the split-K kernel."""

import torch
import triton
import triton.language as tl

from ds4.bench.ceilings import copy_bandwidth, graph_ms


@triton.jit
def _gemv1(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, ws_stride, per_split, BN: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    kb0 = tl.program_id(1) * per_split
    acc = tl.zeros([BN], dtype=tl.float32)
    for kb in range(kb0, kb0 + per_split):
        k = kb * 128 + tl.arange(0, 128)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :]).to(tl.float32)
        x = tl.load(x_ptr + k)
        acc += tl.sum(w * x[None, :], axis=1) * tl.load(ws_ptr + (n // 128) * ws_stride + kb)
    tl.store(out_ptr + tl.program_id(1) * N + n, acc)


def main():
    n = k = 4096
    bandwidth = copy_bandwidth(torch.device("cuda"))
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    ws = torch.rand(n // 128, k // 128, device="cuda")
    x = torch.randn(k, device="cuda")
    want = (w.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)) @ x
    roofline = (n * k) / bandwidth * 1e3
    rows = []
    for bn in (16, 32):
        for splits in (4, 8):
            for warps in (4,):
                part = torch.empty(splits, n, device="cuda")

                def run(bn=bn, splits=splits, warps=warps, part=part):
                    _gemv1[(n // bn, splits)](
                        x, w, ws, part, n, k, ws.stride(0), k // 128 // splits, BN=bn, num_warps=warps
                    )
                    return part.sum(0)

                err = ((run() - want).abs().max() / want.abs().max()).item()
                rows.append((graph_ms(run), bn, splits, warps, err))
    rows.sort()
    print(f"roofline {roofline:.4f} ms (copy {bandwidth / 1e12:.2f} TB/s)")
    for ms, bn, splits, warps, err in rows[:6]:
        plan = f"BN={bn} splits={splits} warps={warps}"
        print(f"gemv M=1 4096x4096 {plan}: {ms:.4f} ms, {roofline / ms:.2f} of roofline, err {err:.1e}")


if __name__ == "__main__":
    main()
