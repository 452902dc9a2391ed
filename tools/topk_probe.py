"""Stripped-down top-k scans against a plain read on the GPU: what loading, storing maxima and histograms
cost (tools/topk_trace.py times the real kernels step by step)."""

import torch
import triton
import triton.language as tl
import triton.testing


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


@triton.jit
def _probe_scan(
    x_ptr,
    stride,
    gm_ptr,
    n_cols,
    G: tl.constexpr,
    TILE: tl.constexpr,
    HIST: tl.constexpr,
    STORE: tl.constexpr,
    ARG: tl.constexpr,
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride
    hist = tl.zeros([256], dtype=tl.int32)
    acc = tl.full([TILE // G], -(2**31), tl.int32)
    for t in range(0, n_cols // TILE):
        cols = t * TILE + tl.arange(0, TILE // G)[:, None] * G + tl.arange(0, G)[None, :]
        x = tl.load(base + cols)
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        gmax = tl.max(key, axis=1)
        if ARG:
            lane = tl.arange(0, G)[None, :]
            first = tl.min(tl.where(key == gmax[:, None], lane, G), axis=1)
            second = tl.max(tl.where(lane == first[:, None], -(2**31), key), axis=1)
            tl.store(
                gm_ptr + row.to(tl.int64) * (n_cols // G) + t * (TILE // G) + tl.arange(0, TILE // G) + 7,
                (second & -65536) | first,
            )
        if STORE:
            tl.store(gm_ptr + row.to(tl.int64) * (n_cols // G) + t * (TILE // G) + tl.arange(0, TILE // G), gmax)
        if HIST:
            hist += tl.histogram(((gmax ^ (-(2**31))) >> 24) & 0xFF, 256)
        acc = tl.maximum(acc, gmax)
    tl.store(gm_ptr + row.to(tl.int64) * (n_cols // G) + tl.arange(0, 256), hist + tl.max(acc, axis=0))


def main():
    rows, cols = 2048, 65536
    x = torch.randn(rows, cols, device="cuda")
    gm = torch.empty(rows, cols // 16 + 16, dtype=torch.int32, device="cuda")
    gb = rows * cols * 4
    print(f"amax read: {gb / ms(lambda: x.amax(1)) / 1e9:.2f} TB/s")
    for warps in (4, 8):
        for tile in (4096, 8192):
            for hist, store, arg in (
                (False, False, False),
                (False, True, False),
                (True, True, False),
                (True, True, True),
            ):
                t = ms(
                    lambda: _probe_scan[(rows,)](
                        x, cols, gm, cols, G=16, TILE=tile, HIST=hist, STORE=store, ARG=arg, num_warps=warps
                    )
                )
                print(
                    f"probe scan warps {warps} tile {tile} hist {hist} store {store} arg {arg}: {t * 1e3:.1f} us "
                    f"{gb / t / 1e9:.2f} TB/s"
                )


main()
