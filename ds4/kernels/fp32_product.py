"""x W^T in fp32 from half-precision operands, on tensor cores where they exist.

The product of two bf16 (or fp16) values is exact in fp32, so on CUDA a half-precision GEMM that accumulates into
an fp32 output is x.float() @ W.float().T summed in another order, reading the weight as stored (an fp32 GEMM
runs on FMA units: ~15x slower at prefill). The model's head, the compressor's projections and the router hold
their weights in the compute dtype for it.

Decode-sized calls (up to GEMV_TOKENS rows of x) run a Triton GEMV instead: a program per weight row reads it
once, in its own dtype, GEMV_TILE products a K step (a whole 4096-wide row for one token), and sums the fp32
products itself. H200 (graphs of 50 calls, the smaller weights L2-resident), K = 4096, one token: 1.9 / 2.9 /
4.4 us for 256 / 1024 / 2048 weight rows where cuBLAS took 5.5 / 5.6 / 7.2 (the router's, the compressors'
shapes), the model's head 233 against 245; two tokens: 2.1 / 3.3 / 5.2 against 5.6 / 5.7 / 7.0, the head 256
against 246. From four tokens the GEMV, re-reading x for each row, loses at the larger weights (2048 rows: 9.4
against 6.9 us), so cuBLAS runs those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early

_HALF = (torch.bfloat16, torch.float16)
GEMV_TOKENS = 2
GEMV_TILE = 8192


def fp32_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K] times weight [M, K] transposed, in fp32 [N, M] (either operand in any float dtype)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_TOKENS:
        return fp32_gemv(x, weight)
    if x.is_cuda and x.dtype == weight.dtype and x.dtype in _HALF and x.dim() == 2:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


@triton.jit(do_not_specialize=["T", "N", "K"])
def _gemv_kernel(
    x_ptr, stride_x, w_ptr, stride_w, out_ptr, stride_out, T, N, K, BT: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[t, n] = sum over k of fp32(x[t, k]) * fp32(w[n, k]) for BT tokens and weight row n, fp32 products and
    sums. PDL: launched early."""
    dependent_launch_start(PDL)
    n = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    t_ok = t < T
    acc = tl.zeros((BT,), tl.float32)
    for k0 in range(0, K, BK):  # K is a multiple of BK: no column masks, so loads stay vectorised
        k = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + t.to(tl.int64)[:, None] * stride_x + k[None, :], mask=t_ok[:, None], other=0.0)
        w = tl.load(w_ptr + n * stride_w + k)
        acc += tl.sum(a.to(tl.float32) * w.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + n, acc, mask=t_ok)


def fp32_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32_product by the Triton GEMV (any rows; CPU under TRITON_INTERPRET=1)."""
    t, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"fp32_product: x [{t}, {k}] does not match weight {list(weight.shape)}")
    out = torch.empty(t, n, dtype=torch.float32, device=x.device)
    if t and n:
        x, weight = x.contiguous(), weight.contiguous()
        bt = min(GEMV_TOKENS, triton.next_power_of_2(t))
        grid = (n, triton.cdiv(t, bt))
        bk = min(GEMV_TILE // bt, k & -k)
        pdl = launches_dependents_early(x.device)
        _gemv_kernel[grid](
            x, x.stride(0), weight, weight.stride(0), out, out.stride(0), t, n, k, BT=bt, BK=bk, PDL=pdl,
            launch_pdl=pdl,
        )  # fmt: skip
    return out
