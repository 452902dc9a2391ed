"""Compile a ds4 Triton kernel for a CUDA target on a machine without a GPU, and report what the compiled code
does: registers, spill stack, shared memory, SASS instructions and barriers, and the layout conversions of large
tensors in its TTGIR (a `convert_layout` of a big tile moves it through shared memory). The triton wheel ships
ptxas and cuobjdump, so this runs anywhere triton installs; use it before spending device time.

    PYTHONPATH=$PWD python3 tools/offline_compile.py        # the FP8 linear's M = 1 kernel on sm_90/100/120

As a library, from a script of your own:

    from tools.offline_compile import compile_kernel, report
    c = compile_kernel(fp8_linear._fp8_gemv_kernel, args, constexprs, arch=90, num_warps=4, num_stages=1)
    print(report(c))

`args` names every argument that is not a constexpr: tensors as `torch.empty(1, dtype=...)` (only the dtype
matters), TMA descriptors as `TensorDescriptor.from_tensor(torch.empty(rows, cols, dtype=...), block)`, ints and
floats with realistic values. Like a real launch, an int divisible by 16 (unless the kernel
lists it in do_not_specialize) and every pointer get the divisibility hint: without realistic strides the loads
compile scalar and mislead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile
from triton.tools.tensor_descriptor import TensorDescriptor

_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.bool: "i1",
}
_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
BIG_TENSOR = 256  # elements: a layout conversion of more than this is worth a look


def compile_kernel(kernel, args: dict, constexprs: dict, arch: int, num_warps: int = 4, num_stages: int = 3):
    """The kernel (a triton.jit function) compiled for sm_`arch` with these arguments' types and hints."""
    names = kernel.arg_names
    unspecialized = {names[i] if isinstance(i, int) else i for i in (kernel.do_not_specialize or ())}
    signature, hints = {}, {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = args[name]
        if isinstance(value, TensorDescriptor):  # a TMA descriptor: its dtype and box shape are the signature
            signature[name] = f"tensordesc<{_TYPES[value.base.dtype]}[{', '.join(map(str, value.block_shape))}]>"
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(value).__name__} is not a tensor, int, float or bool")
        aligned = isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)
        if aligned and name not in unspecialized:
            hints[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=dict(constexprs), attrs=hints)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton_compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def sass(compiled) -> str:
    """The compiled kernel's SASS (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [os.path.join(_TOOLS, "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True, check=True
        ).stdout


def _usage(compiled) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run(
            [os.path.join(_TOOLS, "cuobjdump"), "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no registers: {out[-300:]}")
    return int(found.group(1)), int(found.group(2))


def big_conversions(compiled, threshold: int = BIG_TENSOR) -> list[str]:
    """The TTGIR layout conversions of tensors with more than `threshold` elements, as 'AxB dtype'."""
    found = []
    for line in compiled.asm["ttgir"].splitlines():
        if "ttg.convert_layout" not in line:
            continue
        shape = re.search(r"tensor<([0-9x]+)x([a-zA-Z0-9]+),", line)
        if shape:
            elements = 1
            for size in shape.group(1).split("x"):
                elements *= int(size)
            if elements > threshold:
                found.append(f"{shape.group(1)} {shape.group(2)}")
    return found


def report(compiled) -> dict:
    """Registers, spill stack bytes, shared memory bytes, SASS instruction count, barriers, big conversions."""
    registers, stack = _usage(compiled)
    opcodes = Counter(
        match.group(1)
        for match in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", sass(compiled), re.M)
    )
    return {
        "registers": registers,
        "stack": stack,
        "shared": compiled.metadata.shared,
        "instructions": sum(opcodes.values()),
        "barriers": opcodes["BAR"],
        "big_conversions": big_conversions(compiled),
    }


def _fp8_linear_at_m1(arch: int, n: int = 32768, k: int = 1024, groups: int = 1, tiles=None) -> dict:
    """The FP8 linear's FMA kernel as a decode step launches it (default wq_b: 32768 x 1024, M = 1; `tiles`
    overrides TILE_TABLE's)."""
    from ds4.kernels import fp8_linear

    plan = fp8_linear.linear_plan(1, n // groups, groups, k, 2, sms=132, smem=227 << 10, tiles=tiles, use_dot=False)

    def tensor(dtype):
        return torch.empty(1, dtype=dtype)

    args = dict(
        x_ptr=tensor(torch.bfloat16), x_stride=groups * k, up_ptr=tensor(torch.bfloat16), up_stride=k, limit=0.0,
        w_ptr=tensor(torch.float8_e4m3fn), w_stride=k, ws_ptr=tensor(torch.float32), ws_stride=-(-k // 128),
        out_ptr=tensor(torch.bfloat16), out_stride=n, part_ptr=tensor(torch.float32), part_split_stride=n,
        part_stride=n, arrivals_ptr=tensor(torch.int32), rows_per_group=n // groups, K=k,
        chunks_per_split=plan.chunks_per_split, splits=plan.splits, early_chunks=2,
    )  # fmt: skip
    constexprs = dict(
        QUANTIZE_X=groups == 1, SWIGLU=False, ROW_SCALES=False, SPLIT=plan.splits > 1, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, WARPS=plan.num_warps, RUN=fp8_linear.fma_weight_run(plan, 2), STAGES=plan.num_stages,
        PREFETCH=plan.prefetch, PDL=arch >= 90,
    )  # fmt: skip
    compiled = compile_kernel(fp8_linear._fp8_gemv_kernel, args, constexprs, arch, plan.num_warps, plan.num_stages)
    return report(compiled)


if __name__ == "__main__":
    from dataclasses import replace

    from ds4.kernels.fp8_linear import TILE_TABLE

    ahead = replace(TILE_TABLE[0][2], max_stages=1, prefetch=True)
    for target in (90, 100, 120):  # e4m3 needs sm_89+ (sm_80 runs ds4's FP8 linears dequantised)
        print(f"sm_{target} fp8_linear M = 1 (wq_b):", _fp8_linear_at_m1(target), flush=True)
        print(f"sm_{target} the same, prefetching:", _fp8_linear_at_m1(target, tiles=ahead), flush=True)
    sys.exit(0)
