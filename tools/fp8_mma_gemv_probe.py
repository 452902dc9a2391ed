"""Probe (not used by ds4): can an M = 1 FP8 linear read its weights at the copy rate if the tensor cores multiply
the e4m3 weights straight from shared memory (an e4m3 x e4m3 MMA, x act_quant'ed beforehand into 16 padded rows),
instead of the production kernel's FMA over weights converted in registers (`ds4.kernels.fp8_linear`)? Times both
on the decode step's Flash shapes (CUDA-graph replays, L2 flushed), over row tiles, stages and K splits, next to
the copy-rate roofline, with each one's error against the reference (the e4m3 MMA sums inside the tensor core, at
less than fp32 precision: each 128-column group's sum is scaled and added in fp32, as the official kernel does).

    python3 tools/fp8_mma_gemv_probe.py
"""

import torch
import triton
import triton.language as tl

from ds4.bench.ceilings import copy_bandwidth, graph_ms
from ds4.checkpoint.quant import fp8_block_quantize
from ds4.kernels import fp8_linear as fl

ROWS = 16  # x's rows as the MMA's N (one live)
SHAPES = {"wq_a+wkv": (1536, 4096), "wq_b+idx": (40960, 1024), "wo_b": (4096, 8192), "w1+w3": (4096, 4096)}


@triton.jit
def _mma_gemv(q_ptr, xs_ptr, xs_stride, w_ptr, w_stride, ws_ptr, ws_stride, out_ptr, N, K, per_split,
              BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    pid_n, split = tl.program_id(0), tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BN, BM), tl.float32)
    first = split * per_split
    for c in tl.range(first, tl.minimum(first + per_split, K // 128), num_stages=STAGES):
        k = c * 128 + tl.arange(0, 128)
        w = tl.load(w_ptr + n[:, None] * w_stride + k[None, :])
        q = tl.load(q_ptr + m[:, None] * K + k[None, :])
        scale = tl.load(ws_ptr + (pid_n * BN // 128) * ws_stride + c) * tl.load(xs_ptr + c * xs_stride + m)
        acc += tl.dot(w, tl.trans(q)) * scale[None, :]
    tl.atomic_add(out_ptr + m[None, :] * N + n[:, None], acc, mask=(m < 1)[None, :])


def main():
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}, copy {bandwidth / 1e12:.2f} TB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    total = {}
    for name, (n, k) in SHAPES.items():
        w, s = fp8_block_quantize(torch.randn(n, k, device="cuda", generator=g) * k**-0.5, (128, 128))
        s = s.float()
        x = torch.randn(1, k, device="cuda", generator=g).to(torch.bfloat16)
        want = fl.fp8_linear_reference(x, w, s, out_dtype=torch.float32)
        roof = (n * k + 2 * k + 2 * n) / bandwidth * 1e3

        def err(got):
            return ((got.float() - want).norm() / want.norm()).item()

        fma_ms = graph_ms(lambda: fl.fp8_linear(x, w, s))
        results = [(fma_ms, "production (FMA)", err(fl.fp8_linear(x, w, s, out_dtype=torch.float32)))]
        out = torch.zeros(1, n, device="cuda")
        for bn in (64, 128):
            for programs_per_sm in (2, 4, 8):
                tiles, chunks = n // bn, k // 128
                splits = max(1, min(chunks, triton.cdiv(programs_per_sm * sms, tiles)))
                per_split = triton.cdiv(chunks, splits)
                splits = triton.cdiv(chunks, per_split)
                for stages in (3, 5):

                    def run(bn=bn, splits=splits, per_split=per_split, stages=stages):
                        q, xs = fl.act_quant_triton(x, ROWS)
                        out.zero_()
                        _mma_gemv[(n // bn, splits)](
                            q, xs, xs.stride(1), w, w.stride(0), s, s.stride(0), out, n, k, per_split,
                            BM=ROWS, BN=bn, STAGES=stages, num_warps=4,
                        )  # fmt: skip
                        return out

                    try:
                        e = err(run().clone())
                        results.append((graph_ms(run), f"e4m3 MMA {bn} rows, {splits} splits, {stages} stages", e))
                    except Exception as error:  # a plan that does not compile on this device
                        print(f"  {name} {bn} rows {stages} stages: {type(error).__name__}: {str(error)[:200]}")
        results.sort()
        print(f"{name} {n}x{k}: roofline {roof:.4f} ms")
        for ms, plan, e in results[:4] + [r for r in results[4:] if r[1].startswith("production")]:
            print(f"  {plan}: {ms:.4f} ms ({roof / ms:.2f} of roofline), rel err {e:.1e}")
        total[name] = (fma_ms, results[0][0])
    print("sum over shapes (production, best):", [round(sum(v[i] for v in total.values()), 4) for i in (0, 1)])


if __name__ == "__main__":
    main()
