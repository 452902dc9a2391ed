"""Ceilings measured in the run that uses them: copy bandwidth and GEMM rates of the device at hand.

Copy bandwidth counts bytes read + written of a large device-to-device copy (a step's bytes to read over it
give the memory roofline). GEMM rates: bf16 (torch.matmul) and fp8 e4m3 (torch._scaled_mm, rowwise scales),
on square problems. Without fp8 tensor cores (a CPU, sm_80) the fp8 rate is None.

And the timers the measurements use: `median_ms` (CUDA events around each call, or the wall clock) for steps,
`kernel_ms` and `graph_ms` (CUDA) for single kernels, timed from memory as inside a model step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import triton.testing


def median_ms(fn: Callable[[], object], device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median wall time of fn in milliseconds (CUDA: between events around each call, after warm-up)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Median milliseconds of fn by triton.testing.do_bench (repeated for about `rep` ms), which flushes the L2
    cache before each call: a kernel's cost when a model step's other layers have evicted its inputs."""
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def graph_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """kernel_ms of fn replayed from a CUDA graph (captured after a warm-up call on a side stream), as in a
    decode step: the launches' host cost gone, their device cost kept."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return kernel_ms(graph.replay, rep)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second of a device-to-device copy of nbytes."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms * 1e-3)


def gemm_rate(device: torch.device, dtype: torch.dtype, n: int = 8192) -> float | None:
    """FLOP/s of an n^3 GEMM in bf16 (fp32 on CPU) or, with dtype float8_e4m3fn, fp8 via torch._scaled_mm (None where
    there is none to time)."""
    if dtype == torch.float8_e4m3fn:
        # fp8 tensor cores start with sm_89 (Ada, Hopper); older GPUs and CPUs have no fp8 GEMM to measure.
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype).t()
        sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
        try:
            torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        except (RuntimeError, NotImplementedError):  # this torch has no rowwise recipe on this part: nothing to time
            return None
        ms = median_ms(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device)
    else:
        compute = dtype if device.type == "cuda" else torch.float32
        a, b = torch.randn(n, n, device=device, dtype=compute), torch.randn(n, n, device=device, dtype=compute)
        ms = median_ms(lambda: a @ b, device)
    return 2 * n**3 / (ms * 1e-3)


def fp8_or_bf16_rate(device: torch.device) -> tuple[float, str]:
    """(FLOP/s, "fp8") of the fp8 GEMM, or of the bf16 one (kind "bf16") where this part has no fp8 GEMM of torch's to
    time: the rate an FP8 kernel's roofline is bounded by."""
    rate = gemm_rate(device, torch.float8_e4m3fn)
    return (rate, "fp8") if rate is not None else (gemm_rate(device, torch.bfloat16), "bf16")
