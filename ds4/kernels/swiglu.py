"""DeepSeek-V4's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit), computed in fp32.

`clamped_swiglu` is the math on values in registers, shared by the kernels that apply it: the routed experts'
gate-up epilogue (ds4.kernels.moe), the FP8 linear that takes the shared expert's gate and up as its input
(ds4.kernels.fp8_linear), and `swiglu_to`'s own launch where nothing else takes it in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early

BLOCK = 1024  # columns a program of `swiglu_to`'s launch takes


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32 (no clamping when limit <= 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return F.silu(gate) * up


@triton.jit
def clamped_swiglu(gate, up, limit):
    """swiglu of fp32 tiles (limit <= 0: no clamping)."""
    if limit > 0:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-gate)) * up


# N stays specialised (divisible by 16: a model's widths are), so that the column mask keeps the accesses 16 bytes wide.
@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, stride_in, out_ptr, stride_out, N, limit, BN: tl.constexpr, PDL: tl.constexpr):
    """out[t] = swiglu(gate[t], up[t], limit), computed in fp32, stored in out's dtype. PDL: launched early."""
    dependent_launch_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = cols < N
    gate = tl.load(gate_ptr + t * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + t * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, clamped_swiglu(gate, up, limit).to(out_ptr.dtype.element_ty), mask=ok)


def swiglu_to(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    """swiglu(gate, up, limit) in `dtype` ([T, N] each): one kernel on CUDA, the torch reference elsewhere."""
    if gate.is_cuda:
        return swiglu_triton(gate, up, limit, dtype)
    return swiglu(gate, up, limit).to(dtype)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float, dtype: torch.dtype) -> torch.Tensor:
    if (
        gate.stride(-1) != 1 or up.stride(-1) != 1 or gate.stride(0) != up.stride(0)
    ):  # slices of one buffer pass as they are
        gate, up = gate.contiguous(), up.contiguous()
    t, n = gate.shape
    out = torch.empty(t, n, dtype=dtype, device=gate.device)
    bn = min(BLOCK, triton.next_power_of_2(n))
    if t:
        pdl = launches_dependents_early(gate.device)
        _swiglu_kernel[(t, triton.cdiv(n, bn))](
            gate, up, gate.stride(0), out, out.stride(0), n, float(limit), BN=bn, PDL=pdl, launch_pdl=pdl
        )
    return out
