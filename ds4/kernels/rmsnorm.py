"""RMSNorm, computed in fp32 and returned in the input dtype (the weight, when given, is applied in fp32).

On CUDA one launch (torch's path is five elementwise and reduction kernels): each program normalises a few
whole rows held in registers, as many rows as keep a program's tile near ROW_TILE elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early

# Chosen settings: elements of a program's tile (rows x the row length rounded up to a power of two) and the
# elements each thread holds.
ROW_TILE = 4096
ELEMENTS_PER_THREAD = 16
VECTOR_BYTES = 16  # the widest load or store of one thread


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dim."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


@triton.jit
def inverse_rms(sum_of_squares, D, eps):
    """1 / sqrt(mean(x^2) + eps) of rows of D values whose squares sum to sum_of_squares (fp32)."""
    return 1.0 / tl.sqrt(sum_of_squares / D + eps)


# D and the row strides are the model's (few variants): specialised, so that rows load as wide vectors.
@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    y_ptr,
    y_stride,
    rows,
    D,
    eps,
    WEIGHTED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RUN: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS rows a program. PDL: launched early (`dependent_launch_start`)."""
    dependent_launch_start(PDL)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    # Columns in contiguous runs of RUN (the same columns), so that the rows and the weight load RUN values a
    # thread alike: an fp32 weight's 16-byte loads hold half as many values as bf16 rows' and the weight, loaded
    # in its own layout, would be moved through shared memory to the rows'.
    d = tl.arange(0, BLOCK_D) // RUN * RUN + tl.arange(0, BLOCK_D) % RUN
    ok = (r < rows)[:, None] & (d < D)[None, :]
    x = tl.load(x_ptr + r[:, None] * x_stride + d[None, :], mask=ok, other=0.0).to(tl.float32)
    y = x * inverse_rms(tl.sum(x * x, axis=1), D, eps)[:, None]
    if WEIGHTED:
        y = y * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + r[:, None] * y_stride + d[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """rms_norm_reference in one launch (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    d = x.shape[-1]
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"rms_norm: weight {list(weight.shape)} does not fit rows of {d}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block_d = triton.next_power_of_2(d)
        per_program = max(1, ROW_TILE // block_d)
        widest = max(x.element_size(), weight.element_size() if weight is not None else 1)
        warps = min(16, max(1, per_program * block_d // (32 * ELEMENTS_PER_THREAD)))
        pdl = launches_dependents_early(x.device)
        _rms_norm_kernel[(triton.cdiv(rows.shape[0], per_program),)](
            rows,
            rows.stride(0),
            weight if weight is not None else rows,
            y,
            y.stride(0),
            rows.shape[0],
            d,
            eps,
            WEIGHTED=weight is not None,
            ROWS=per_program,
            BLOCK_D=block_d,
            RUN=min(block_d, VECTOR_BYTES // widest),
            PDL=pdl,
            num_warps=warps,
            launch_pdl=pdl,
        )
    return y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight] over the last dim, in x's dtype (fp32 inside)."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
