"""RMSNorm then RoPE at each row's position, kept in the compute dtype or written as FP8 cache entries.

An attention entry is finished this way (kv = RoPE(RMSNorm(wkv(x))), then the cache's form) and so is each head of
a query (without a norm weight, kept in the compute dtype). The reference composes the two ops and quantize_kv;
on CUDA one launch does all three (torch's path is a dozen elementwise kernels and quantize_kv's twenty). The
kernel rounds to the compute dtype where the composed ops return it (after the norm, after the rotation), so it
differs from them only in the order of the norm's fp32 sum (and, as the rope kernel, in fused multiply-adds of the
rotation), and the FP8 bytes are quantize_kv's of its values.

`finish_entries` is that computation on rows already in registers, shared with the compressor's pooling kernel;
`normalized_rotated` (the values, not stored) with the sparse attention kernel, which finishes its queries itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4.kernels._device import dependent_launch_start, launches_dependents_early
from ds4.kernels.fp8_kv import KV_QUANT_BLOCK, bf16_bits, kv_entry_bytes, quantize_kv, store_fp8_entries
from ds4.kernels.rmsnorm import inverse_rms, rms_norm_reference
from ds4.kernels.rope import apply_rope_reference, turn_row_pairs

# Chosen settings: elements of a program's tile (rows x the row length rounded up to a power of two).
ROW_TILE = 2048  # H200, 8K tokens x 64 query heads of 512: 0.85 ms at 4096 (153 registers), 0.58 at 2048


@dataclass(frozen=True)
class EntryForm:
    """How raw rows become entries: RMSNorm (fp32 `weight` or None, `eps`), RoPE of the last 2 * len(inv_freq)
    channels, each rounded to `dtype`; then FP8 cache entries (`fp8`) or kept in `dtype`."""

    weight: torch.Tensor | None
    inv_freq: torch.Tensor
    eps: float
    dtype: torch.dtype
    fp8: bool = False

    @property
    def rope_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def fits_kernel(self, head_dim: int) -> bool:
        """Whether the Triton kernels take rows of head_dim: a power-of-two count of frequencies (32 and 64 in
        DeepSeek-V4) that fits, on whole channel pairs, the rotated ones starting at a multiple of it (their angles
        are tiled over the row, see turn_row_pairs)."""
        half = self.inv_freq.numel()
        fits = half & (half - 1) == 0 and 2 * half <= head_dim and head_dim % 2 == 0
        return fits and (head_dim // 2 - half) % half == 0

    def reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The spec: the composed torch ops."""
        y = rms_norm_reference(x.to(self.dtype), self.weight, self.eps)
        y = apply_rope_reference(y, positions, self.inv_freq)
        return quantize_kv(y, self.rope_dim) if self.fp8 else y

    def entry_size(self, head_dim: int) -> int:
        """Elements (FP8: bytes) of one finished row."""
        return kv_entry_bytes(head_dim, self.rope_dim) if self.fp8 else head_dim

    def entry_dtype(self) -> torch.dtype:
        return torch.uint8 if self.fp8 else self.dtype


def pair_block(head_dim: int) -> int:
    """The pairs of a row's tile: a power of two, whole FP8 quantisation blocks."""
    return max(KV_QUANT_BLOCK // 2, triton.next_power_of_2(head_dim // 2))


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest, ties to even), back in fp32."""
    if DTYPE == tl.bfloat16:
        return bf16_bits(x).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def normalized_rotated(
    even,
    odd,
    pair,
    w_ptr,
    positions,
    freq_ptr,
    D,
    eps,
    WEIGHTED: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DTYPE: tl.constexpr,
):
    """Rows of channels 2 * pair (even) and 2 * pair + 1 (odd), fp32 [rows, BLOCK_P] (0 past D) at `positions`
    [ROWS] (see turn_row_pairs): normalised (times the weight when WEIGHTED), rounded to DTYPE, rotated (the last HALF
    pairs, see turn_row_pairs) and rounded again, as the composed ops return them; fp32 (even, odd)."""
    p_ok = pair < D // 2
    inverse = inverse_rms(tl.sum(even * even, axis=1) + tl.sum(odd * odd, axis=1), D, eps)[:, None]
    even, odd = even * inverse, odd * inverse
    if WEIGHTED:
        even = even * tl.load(w_ptr + 2 * pair, mask=p_ok, other=0.0).to(tl.float32)[None, :]
        odd = odd * tl.load(w_ptr + 2 * pair + 1, mask=p_ok, other=0.0).to(tl.float32)[None, :]
    even, odd = rounded(even, DTYPE), rounded(odd, DTYPE)
    even, odd = turn_row_pairs(even, odd, pair, positions, freq_ptr, D, 1.0, HALF, ROWS, BLOCK_P)
    return rounded(even, DTYPE), rounded(odd, DTYPE)


@triton.jit
def finish_entries(
    even,
    odd,
    pair,
    row_ok,
    out_row,
    w_ptr,
    positions,
    freq_ptr,
    D,
    eps,
    WEIGHTED: tl.constexpr,
    FP8: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DTYPE: tl.constexpr,
    copy_row=None,
    COPY: tl.constexpr = False,
):
    """normalized_rotated's rows written to out_row [ROWS] (pointers to the rows: FP8 entries, or values of
    out_row's type) and, with COPY, to copy_row [ROWS] too."""
    even, odd = normalized_rotated(
        even, odd, pair, w_ptr, positions, freq_ptr, D, eps, WEIGHTED, HALF, ROWS, BLOCK_P, DTYPE
    )
    if FP8:
        store_fp8_entries(out_row, even, odd, pair, row_ok, D - 2 * HALF, 2 * HALF, ROWS, BLOCK_P, copy_row, COPY)
    else:  # the pairs interleaved back into whole rows: one contiguous store
        channel = tl.arange(0, 2 * BLOCK_P)
        rows = tl.reshape(tl.join(even, odd), (ROWS, 2 * BLOCK_P)).to(out_row.dtype.element_ty)
        ok = row_ok[:, None] & (channel < D)[None, :]
        tl.store(out_row[:, None] + channel[None, :], rows, mask=ok)
        if COPY:
            tl.store(copy_row[:, None] + channel[None, :], rows, mask=ok)


# D and the row strides are the model's (few variants): specialised, so that rows load as wide vectors.
@triton.jit(do_not_specialize=["rows", "heads"])
def _norm_rope_kernel(
    x_ptr,
    x_stride,
    w_ptr,
    pos_ptr,
    freq_ptr,
    y_ptr,
    y_stride,
    copy_ptr,
    copy_row_ptr,
    rows,
    heads,
    D,
    eps,
    WEIGHTED: tl.constexpr,
    FP8: tl.constexpr,
    HALF: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    COPY: tl.constexpr,
    PDL: tl.constexpr,
):
    # COPY: each row also to row copy_row_ptr[r] of copy_ptr (rows of y_stride elements). PDL: launched early
    # (`dependent_launch_start`).
    dependent_launch_start(PDL)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = r < rows
    pair = tl.arange(0, BLOCK_P)
    channel = tl.arange(0, 2 * BLOCK_P)
    ok = row_ok[:, None] & (channel < D)[None, :]
    # Whole rows in one contiguous load, split into the channel pairs in registers.
    x = tl.load(x_ptr + r[:, None] * x_stride + channel[None, :], mask=ok, other=0.0).to(tl.float32)
    even, odd = tl.split(tl.reshape(x, (ROWS, BLOCK_P, 2)))
    positions = tl.load(pos_ptr + r // heads, mask=row_ok, other=0)
    copy_row = copy_ptr
    if COPY:
        copy_row = copy_ptr + tl.load(copy_row_ptr + r, mask=row_ok, other=0) * y_stride
    finish_entries(
        even,
        odd,
        pair,
        row_ok,
        y_ptr + r * y_stride,
        w_ptr,
        positions,
        freq_ptr,
        D,
        eps,
        WEIGHTED,
        FP8,
        HALF,
        ROWS,
        BLOCK_P,
        x_ptr.dtype.element_ty,
        copy_row,
        COPY,
    )


def norm_rope_triton(
    x: torch.Tensor, positions: torch.Tensor, form: EntryForm, copy: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """form.reference(x, positions) in one launch (CUDA, or the CPU under TRITON_INTERPRET=1); x in form.dtype.
    copy: see norm_rope."""
    d, tokens = x.shape[-1], x.shape[0]
    if x.dtype != form.dtype or not form.fits_kernel(d) or positions.shape != (tokens,):
        raise ValueError(
            f"norm_rope: x {x.dtype} {list(x.shape)}, positions {list(positions.shape)} do not fit {form.rope_dim} "
            f"RoPE dims in {form.dtype}"
        )
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape[0], form.entry_size(d), dtype=form.entry_dtype(), device=x.device)
    if copy is not None:
        _check_copy(copy, y)
    if rows.shape[0]:
        block_p = pair_block(d)
        per_program = max(1, ROW_TILE // (2 * block_p))
        pdl = launches_dependents_early(x.device)
        _norm_rope_kernel[(triton.cdiv(rows.shape[0], per_program),)](
            rows,
            rows.stride(0),
            form.weight if form.weight is not None else rows,
            positions,
            form.inv_freq.to(device=x.device, dtype=torch.float32).contiguous(),
            y,
            y.stride(0),
            y if copy is None else copy[0],
            positions if copy is None else copy[1],
            rows.shape[0],
            rows.shape[0] // max(tokens, 1),
            d,
            form.eps,
            WEIGHTED=form.weight is not None,
            FP8=form.fp8,
            HALF=form.inv_freq.numel(),
            ROWS=per_program,
            BLOCK_P=block_p,
            COPY=copy is not None,
            PDL=pdl,
            launch_pdl=pdl,
        )
    return y.view(*x.shape[:-1], y.shape[-1])


def _check_copy(copy: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> None:
    target, rows = copy
    if target.dtype != y.dtype or target.shape[-1] != y.shape[-1] or not target.is_contiguous():
        raise ValueError(f"norm_rope: copy target {target.dtype} {list(target.shape)} does not take {y.dtype} rows")
    if rows.shape != (y.shape[0],) or rows.dtype != torch.int64:
        raise ValueError(f"norm_rope: copy rows must be int64 [{y.shape[0]}], got {rows.dtype} {list(rows.shape)}")


def norm_rope(
    x: torch.Tensor, positions: torch.Tensor, form: EntryForm, copy: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Rows x [T, D] (or [T, heads, D]) normalised and rotated at positions [T], in the form `form` names (see the
    module). copy (target, rows): each finished row r also written to row rows[r] of target's rows (contiguous, of
    the finished rows' dtype and length; rows [T] int64, only with x [T, D]): the attention's window ring, stored
    in the same launch."""
    if copy is not None and x.dim() != 2:
        raise ValueError(f"norm_rope: a copy takes rows x [T, D], got {list(x.shape)}")
    if x.is_cuda and form.fits_kernel(x.shape[-1]):
        return norm_rope_triton(x.to(form.dtype), positions, form, copy)
    y = form.reference(x, positions)
    if copy is not None:
        _check_copy(copy, y)
        copy[0].view(-1, y.shape[-1])[copy[1]] = y
    return y
