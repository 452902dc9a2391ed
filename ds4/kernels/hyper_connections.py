"""Manifold-constrained hyper-connections (mHC): hc_mult residual streams collapsed into a sub-layer's input, its
output expanded back into the streams, the streams mixed by a Sinkhorn-projected (nearly doubly stochastic) matrix.

hc_pre: mixes = (flat(h) @ fn.T) * rsqrt(mean(flat(h)^2) + eps) over the flattened streams [T, hc * D] in fp32;
the gates pre / post and the mixing matrix comb from them (hc_split_sinkhorn); the sub-layer input
sum_i pre_i h_i. hc_post: stream k = post_k * out + sum_j comb[j, k] h_j. hc_head: the final collapse, with
sigmoid weights only.

On CUDA hc_pre and hc_head are two launches and hc_post one. The projection reads each token's streams once for
both the dot products with fn and the sum of squares, split along the flattened channels when there are too few
tokens to fill the device (one partial row per split, summed in a fixed order by the next launch: deterministic,
no atomics, nothing to zero). The collapse launch sums a token's partials, computes its gates and the Sinkhorn
iterations in registers (an hc x hc matrix) and writes a slice of the channels; when a token's channels are
split over several programs each recomputes those few values, and when tokens are many a program takes several.
Everything is fp32 as in the reference. With bf16 streams the projection's products run on tensor cores as three
bf16 products: fn's fp32 weights split into three bf16 parts (each the rounding of what the ones before leave, their
sum fn to about 2^-27 of itself), each part's products with the streams exact, a K block's summed on the tensor
cores and the blocks' sums in fp32: no conversion of the streams, half the MMA instructions of Triton's tf32x3,
which fp16 streams keep (exact in TF32; its low x low product dropped, the weight's rest rounded to TF32: about
2^-22 of a product). fp32 streams keep IEEE fp32 FMAs (an fp32 model agrees with its CPU run up to the order of the
sums). hc_pre at 8192 bf16 tokens (`ds4 bench kernels --only mhc`): H200, tf32x3, 0.380 ms (23c2fb5); H100,
bf16x3, 0.262 ms with a tensor-core sum a K block (d367be9), 0.255 ms with one over all of K (e923bad, whose output
was up to 2.7e-5 off the fp32 reference).
A decode step's hc_post, the hc_pre after it and that sub-layer's RMSNorm (`hc_post_pre`, up to POST_PRE_TOKENS
tokens) are one launch: each program expands a block of channels and writes that block's projection row (fp32
FMAs: too few tokens for an MMA), and the last program to arrive (an arrival counter) runs the collapse from the
rows and streams the others wrote, then the norm, while the one before it computes the next gates (the Sinkhorn
steps) from the same rows; more tokens take the launches of each.
Shapes are launch arguments and nothing waits on the host: the launches are CUDA-graph capturable. hc must be a
power of two (the real models' 4; other values take the reference).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4.kernels._device import (
    arrival_counters,
    dependent_launch_start,
    interpreting,
    launches_dependents_early,
    num_sms,
    prefetch_to_l2,
    shared_memory_per_block,
)
from ds4.kernels.norm_rope import rounded
from ds4.kernels.rmsnorm import inverse_rms, rms_norm

# Chosen settings. Projection: a program's tile of tokens (fewer for small batches, where tokens are padding) and
# of flattened channels; programs per SM the split-K aims for. Collapse / expand: channels per program step and
# programs per SM the collapse's channel split aims for.
PROJECTION_SMALL_T = 16
PROJECTION_LARGE_T = 64
PROJECTION_BLOCK_K = 64
PROJECTION_WAVES = 1
PROJECTION_MAX_STAGES = 3
PROJECTION_PRECISION = {torch.bfloat16: "bf16x3", torch.float16: "tf32x3"}  # by stream dtype; else "ieee"
WARPS = 4
# 1024 = WARPS x 32 threads x one 16-byte load of 16-bit streams: each thread then holds all hc streams of its
# channels and the sums over the streams stay in its registers (with 512, hc is split over warps and summed
# through shared memory, and the result moved to the store's layout).
CHANNEL_BLOCK = 1024
COLLAPSE_WAVES = 4
COLLAPSE_MAX_TOKENS = 8
COLLAPSE_TILE = 1024  # channels x tokens a collapse step of several tokens takes
POST_PRE_TOKENS = 4  # up to this many tokens hc_post and the next hc_pre are one launch (its collapse is serial)
# Channels a step of that launch's collapse and norm reads: Flash's whole row at once, Pro's in two (registers). Its
# last program's reads wait one after another; at 1024 channels a step they were about ten.
POST_PRE_COLLAPSE_D = 4096


def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2 + hc) * hc] (fp32) -> pre [..., hc], post [..., hc], comb [..., hc, hc].

    comb[j, k] weighs input stream j into output stream k; it is made (nearly) doubly stochastic by
    a row softmax followed by alternating column / row normalisation (columns first and last).
    """
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = mixes[..., 2 * hc :].unflatten(-1, (hc, hc)) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """Projection of the RMS-normalised flattened streams [T, hc * D] -> [T, fn rows] (fp32)."""
    flat = streams.flatten(1).float()
    return F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def hc_pre_reference(streams: torch.Tensor, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """streams [T, hc, D] -> (sub-layer input [T, D], post [T, hc], comb [T, hc, hc])."""
    pre, post, comb = hc_split_sinkhorn(_mixes(streams, fn, norm_eps), scale, base, hc, iters, hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1)
    return collapsed.to(streams.dtype), post, comb


def hc_post_reference(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream k = post[k] * out + sum_j comb[j, k] * streams[j]."""
    mixed = torch.einsum("tjk,tjd->tkd", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)


def hc_head_reference(streams: torch.Tensor, fn, scale, base, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams [T, hc, D] -> [T, D] with sigmoid weights."""
    pre = torch.sigmoid(_mixes(streams, fn, norm_eps) * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


# The channel counts (K, D) and row strides are the model's: left to Triton's specialisation (one variant a model),
# they let it prove rows 16-byte aligned and load them in wide vectors; token and split counts vary per call.
@triton.jit(do_not_specialize=["T", "k_blocks_per_split"])
def _projection_kernel(
    h_ptr,
    h_stride,
    fn_ptr,
    part_ptr,
    T,
    K,
    k_blocks_per_split,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PARTS_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """part[split, t, :MIX] = flat(h)[t, K slice] @ fn[:, K slice].T, part[split, t, MIX] = sum of squares. PDL:
    launched early (`dependent_launch_start`)."""
    dependent_launch_start(PDL)
    split = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, MIX_PAD)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    row_ptr = h_ptr + rows.to(tl.int64)[:, None] * h_stride
    acc = tl.zeros((BLOCK_T, MIX_PAD), tl.float32)
    squares = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)  # summed over the channels once, after the loop
    k_start = split * k_blocks_per_split * BLOCK_K
    for step in range(0, k_blocks_per_split):
        k = k_start + step * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(row_ptr + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(fn_ptr + cols[None, :] * K + k[:, None], mask=(cols[None, :] < MIX) & k_ok[:, None], other=0.0)
        if PRECISION == "bf16x3":
            # fp32 w as the sum of three bf16 parts (each the rounding of what the ones before leave: w to about
            # 2^-27 of itself), each part's products with the bf16 streams exact. The tensor cores truncate
            # where they add (an addend's bits below the sum's last are dropped, not rounded): a chain of MMAs
            # over all of K drifts (H100, 8K tokens: gates 2.5e-5 off the fp32 reference with one chain for all
            # parts, ~1e-5 with the small parts' apart). So each K block's products sum in a chain of their own,
            # smallest part first, and the blocks' sums add in fp32 (as Triton's tf32x3 does). PARTS_F32 (the
            # interpreter, whose bf16 dot is wrong): the same exact products from fp32 copies.
            high = w.to(tl.bfloat16)
            rest = w - high.to(tl.float32)
            middle = rest.to(tl.bfloat16)
            low = (rest - middle.to(tl.float32)).to(tl.bfloat16)
            if PARTS_F32:
                xf = x.to(tl.float32)
                block = tl.dot(xf, low.to(tl.float32), input_precision="ieee")
                block = tl.dot(xf, middle.to(tl.float32), block, input_precision="ieee")
                block = tl.dot(xf, high.to(tl.float32), block, input_precision="ieee")
            else:
                block = tl.dot(x, low)
                block = tl.dot(x, middle, block)
                block = tl.dot(x, high, block)
            acc += block
        else:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision=PRECISION)
        squares += x.to(tl.float32) * x.to(tl.float32)
    acc = tl.where(cols[None, :] == MIX, tl.sum(squares, axis=1)[:, None], acc)
    out = part_ptr + (split * T + rows.to(tl.int64))[:, None] * MIX_PAD + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None])


@triton.jit
def _split_rows(row, ok, columns, CACHE: tl.constexpr):
    """[splits, tokens, columns] of the partial rows `row` (masked rows and tokens read as zero)."""
    return tl.load(row[:, :, None] + columns[None, None, :], mask=ok[:, :, None], other=0.0, cache_modifier=CACHE)


@triton.jit
def _streams(h_ptr, h_stride, t, t_ok, i, chunk, D, BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """h[t, :, chunk] [tokens, hc, BLOCK_D] (zero past D: a chunk past the last reads nothing)."""
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    at = h_ptr + t[:, None, None] * h_stride + i[None, :, None] * D + d[None, None, :]
    return tl.load(at, mask=(t_ok[:, None] & (d < D)[None, :])[:, None, :], other=0.0, cache_modifier=CACHE)


@triton.jit
def _mixing_gates(
    part_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, t, t_ok, T, K, splits, iters, hc_eps, norm_eps,
    HC: tl.constexpr, MIX: tl.constexpr, MIX_PAD: tl.constexpr, SPLIT_BLOCK: tl.constexpr, TOKENS: tl.constexpr,
    CACHE: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """post[t] and comb[t] of the tokens t [TOKENS] (int64) from their split projection rows (hc_split_sinkhorn of
    the rows' sums times their RMS factor). CACHE: as _collapse_tokens's; PTX: CUDA (not the interpreter)."""
    i = tl.arange(0, HC)
    jk = tl.arange(0, HC * HC)
    post_scale = tl.load(scale_ptr + 1)
    post_base = tl.load(base_ptr + HC + i)[None, :]
    comb_scale = tl.load(scale_ptr + 2)
    comb_base = tl.reshape(tl.load(base_ptr + 2 * HC + jk), (HC, HC))[None, :, :]
    split = tl.arange(0, SPLIT_BLOCK)
    row = part_ptr + ((split * T).to(tl.int64)[:, None] + t[None, :]) * MIX_PAD
    ok = (split < splits)[:, None] & t_ok[None, :]
    squares = tl.load(row + MIX, mask=ok, other=0.0, cache_modifier=CACHE)
    post_mix = _split_rows(row, ok, HC + i, CACHE)
    logits = _split_rows(row, ok, 2 * HC + jk, CACHE)
    norm = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + norm_eps)[:, None]
    post = 2.0 * tl.sigmoid(tl.sum(post_mix, 0) * norm * post_scale + post_base)
    tl.store(post_ptr + t[:, None] * HC + i[None, :], post, mask=t_ok[:, None])
    mix = tl.reshape(tl.sum(logits, 0) * norm, (TOKENS, HC, HC)) * comb_scale + comb_base
    e = tl.exp(mix - tl.max(mix, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = tl.reshape(comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps), (TOKENS, HC * HC))
    # The later Sinkhorn steps, a serial chain the launch's end waits on, on HC * HC tensors of the tokens (an entry
    # each): a line's sum is then additions in each thread's registers (a sum over the matrix's axis crossed
    # threads), and a line is scaled by the reciprocal of its sum plus eps (PTX: one rcp.approx.ftz, where a
    # division adds range checks; the sums are at least eps, far above the subnormals).
    entries = ()
    for at in tl.static_range(HC * HC):
        entries = entries + (tl.sum(tl.where(jk[None, :] == at, comb, 0.0), axis=1),)
    for _ in range(1, iters):
        entries = _normalise_lines(entries, hc_eps, HC, HC, 1, PTX)  # rows
        entries = _normalise_lines(entries, hc_eps, HC, 1, HC, PTX)  # columns
    comb = tl.zeros((TOKENS, HC * HC), tl.float32)
    for at in tl.static_range(HC * HC):
        comb = tl.where(jk[None, :] == at, entries[at][:, None], comb)
    tl.store(comb_ptr + t[:, None] * HC * HC + jk[None, :], comb, mask=t_ok[:, None])


@triton.jit
def _normalise_lines(entries, eps, HC: tl.constexpr, LINE: tl.constexpr, ALONG: tl.constexpr, PTX: tl.constexpr):
    """The HC x HC entries (a tuple, row-major) with each line times the reciprocal of its sum plus eps: rows with
    LINE = HC and ALONG = 1, columns with LINE = 1 and ALONG = HC (line l's entries l * LINE + j * ALONG)."""
    scales = ()
    for line in tl.static_range(HC):
        total = entries[line * LINE]
        for j in tl.static_range(1, HC):
            total = total + entries[line * LINE + j * ALONG]
        if PTX:
            scale = tl.inline_asm_elementwise(
                "rcp.approx.ftz.f32 $0, $1;", "=f,f", [total + eps], dtype=tl.float32, is_pure=True, pack=1
            )
        else:
            scale = 1.0 / (total + eps)
        scales = scales + (scale,)
    out = ()
    for at in tl.static_range(HC * HC):
        out = out + (entries[at] * scales[at // HC if LINE == HC else at % HC],)
    return out


@triton.jit
def _collapse_tokens(
    h_ptr,
    h_stride,
    part_ptr,
    scale_ptr,
    base_ptr,
    x_ptr,
    x_stride,
    post_ptr,
    comb_ptr,
    norm_w_ptr,
    t,
    t_ok,
    part,
    T,
    D,
    K,
    splits,
    iters,
    chunks,
    parts,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    MIXING: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CACHE: tl.constexpr,
    NORM: tl.constexpr,
    PTX: tl.constexpr,
):
    """x[t, chunk] = sum_i pre_i h[t, i, chunk] for the tokens t [TOKENS] (int64) and the chunks part, part +
    parts, ...; with MIXING (hc_pre, not hc_head) the first part also writes post[t] and comb[t]. CACHE: the
    loads' cache modifier (".cg" for rows that other programs of the launch wrote). NORM (a row in one chunk): x
    stored as the RMSNorm (weights norm_w_ptr, eps norm_eps) of its values rounded to x's dtype, as rms_norm of
    the stored row, without storing and reading it back."""
    i = tl.arange(0, HC)
    # Whatever does not wait on the gates is read first, the first chunk of streams included: a token's programs
    # are few and short, so their time is that of the reads one after another.
    scale = tl.load(scale_ptr)
    base = tl.load(base_ptr + i)[None, :]
    h = _streams(h_ptr, h_stride, t, t_ok, i, part, D, BLOCK_D, CACHE)
    # A token's projection is the sum of its split rows (at most the SM count: one step), each gate's columns
    # summed apart (no picking out of a row of all the columns).
    split = tl.arange(0, SPLIT_BLOCK)
    row = part_ptr + ((split * T).to(tl.int64)[:, None] + t[None, :]) * MIX_PAD
    ok = (split < splits)[:, None] & t_ok[None, :]
    squares = tl.load(row + MIX, mask=ok, other=0.0, cache_modifier=CACHE)
    pre_mix = _split_rows(row, ok, i, CACHE)
    norm = 1.0 / tl.sqrt(tl.sum(squares, 0) / K + norm_eps)[:, None]
    pre = tl.sigmoid(tl.sum(pre_mix, 0) * norm * scale + base) + hc_eps
    for chunk in range(part, chunks, parts):
        x = tl.sum(pre[:, :, None] * h.to(tl.float32), axis=1)
        d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
        if NORM:
            x = rounded(x, x_ptr.dtype.element_ty)
            w = tl.load(norm_w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            x = rounded(x * inverse_rms(tl.sum(x * x, 1), D, norm_eps)[:, None] * w[None, :], x_ptr.dtype.element_ty)
        tl.store(x_ptr + t[:, None] * x_stride + d[None, :], x.to(x_ptr.dtype.element_ty), mask=t_ok[:, None] & (d < D))
        h = _streams(h_ptr, h_stride, t, t_ok, i, chunk + parts, D, BLOCK_D, CACHE)
    # The mixing outputs wait for hc_post only: their Sinkhorn steps follow the collapse's stores.
    if MIXING:
        if part == 0:
            _mixing_gates(
                part_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, t, t_ok, T, K, splits, iters, hc_eps, norm_eps,
                HC, MIX, MIX_PAD, SPLIT_BLOCK, TOKENS, CACHE, PTX,
            )  # fmt: skip


@triton.jit(do_not_specialize=["T", "splits", "iters", "chunks", "parts"])
def _collapse_kernel(
    h_ptr,
    h_stride,
    part_ptr,
    scale_ptr,
    base_ptr,
    x_ptr,
    x_stride,
    post_ptr,
    comb_ptr,
    T,
    D,
    K,
    splits,
    iters,
    chunks,
    parts,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    MIXING: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """_collapse_tokens for TOKENS tokens and one part of their chunks a program. PDL: launched early; PTX: CUDA."""
    dependent_launch_start(PDL)
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    t_ok = t < T
    _collapse_tokens(
        h_ptr, h_stride, part_ptr, scale_ptr, base_ptr, x_ptr, x_stride, post_ptr, comb_ptr, scale_ptr,
        t.to(tl.int64), t_ok, tl.program_id(1), T, D, K, splits, iters, chunks, parts, hc_eps, norm_eps, HC, MIX,
        MIX_PAD, MIXING, SPLIT_BLOCK, TOKENS, BLOCK_D, "", False, PTX,
    )  # fmt: skip


@triton.jit
def _expand_kernel(
    out_ptr,
    out_stride,
    h_ptr,
    h_stride,
    post_ptr,
    comb_ptr,
    new_ptr,
    new_stride,
    D,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """new[t, k, chunk] = post[t, k] * out[t, chunk] + sum_j comb[t, j, k] * h[t, j, chunk]. PDL: launched early."""
    dependent_launch_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, HC)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    # Stream by stream: each [BLOCK_D] row takes the layout of the new streams' columns (a [hc, hc, BLOCK_D]
    # product would pick a layout of its own, and the rows would move through shared memory to fit it).
    mixed = tl.zeros((HC, BLOCK_D), tl.float32)
    for j in tl.static_range(HC):
        h = tl.load(h_ptr + t * h_stride + j * D + d, mask=d_ok, other=0.0).to(tl.float32)
        mixed += tl.load(comb_ptr + t * HC * HC + j * HC + k)[:, None] * h[None, :]
    out = tl.load(out_ptr + t * out_stride + d, mask=d_ok, other=0.0).to(tl.float32)
    new = tl.load(post_ptr + t * HC + k)[:, None] * out[None, :] + mixed
    tl.store(
        new_ptr + t * new_stride + k[:, None] * D + d[None, :], new.to(new_ptr.dtype.element_ty), mask=d_ok[None, :]
    )


@triton.jit
def _normalize_row(x_ptr, x_stride, token, w_ptr, D, eps, BLOCK_D: tl.constexpr):
    """Row `token` of x (D values this program wrote) replaced by its RMSNorm times w_ptr's weights, as rms_norm of
    the stored values: two passes, the sum of squares then the scaled row; the first block of channels stays in
    registers between them (a row of at most BLOCK_D is read once)."""
    tl.debug_barrier()  # the row's stores, by every thread, before it is read back
    row = x_ptr + token * x_stride
    d = tl.arange(0, BLOCK_D)
    first = tl.load(row + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
    squares = first * first
    for start in range(BLOCK_D, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        v = tl.load(row + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
        squares += v * v
    inverse = inverse_rms(tl.sum(squares, 0), D, eps)
    d = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    tl.store(row + d, rounded(first * inverse * w, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty), mask=d < D)
    for start in range(BLOCK_D, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        v = tl.load(row + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(row + d, rounded(v * inverse * w, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["T", "iters"])
def _post_project_kernel(
    out_ptr,
    out_stride,
    h_ptr,
    h_stride,
    post_ptr,
    comb_ptr,
    new_ptr,
    new_stride,
    fn_ptr,
    part_ptr,
    arrivals_ptr,
    scale_ptr,
    base_ptr,
    x_ptr,
    x_stride,
    x_weight_ptr,
    next_post_ptr,
    next_comb_ptr,
    T,
    D,
    K,
    iters,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    MIX: tl.constexpr,
    MIX_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    COLLAPSE_D: tl.constexpr,
    ROW_NORM: tl.constexpr,
    CONCURRENT: tl.constexpr,
    PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """hc_post, then the next hc_pre, in one launch for a few tokens (T <= BLOCK_T, one program a block of
    BLOCK_D channels): new[t, k, block] = post[t, k] * out[t, block] + sum_j comb[t, j, k] h[t, j, block] (stored
    in the streams' dtype), and part[block, t] its products with fn's columns of the block (fp32 FMAs: too few
    tokens for an MMA tile) and its sum of squares, as the projection kernel's split rows; the last program to
    arrive (a counter, reset for the next launch) runs the collapse of the tokens, one at a time, from the rows and
    streams the others wrote, and the sub-layer's RMSNorm (x_weight_ptr, norm_eps) of each collapsed row (ROW_NORM, a
    row of at most COLLAPSE_D: in registers as it is collapsed; else from the stored row); the next gates as
    CONCURRENT says. PDL: launched early; the next launch may start at once (so that its prologue, an FP8 linear's
    weights asked into L2, overlaps the serial collapse) and fn's columns of the block are asked into L2 before the
    wait for the launch before."""
    block = tl.program_id(0)
    cols = tl.arange(0, MIX_PAD)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        per_stream: tl.constexpr = (BLOCK_D + 31) // 32  # 128-byte lines of fp32 columns
        line = tl.arange(0, HC * per_stream)
        at = (line // per_stream) * D + block * BLOCK_D + (line % per_stream) * 32
        prefetch_to_l2(fn_ptr + tl.where((cols < MIX)[:, None], cols[:, None] * K + at[None, :], 0))
        tl.extra.cuda.gdc_wait()
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    t = t.to(tl.int64)
    d = block * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = t_ok[:, None] & (d < D)[None, :]
    w_ok = (d < D)[:, None] & (cols < MIX)[None, :]
    out = tl.load(out_ptr + t[:, None] * out_stride + d[None, :], mask=ok, other=0.0).to(tl.float32)
    products = tl.zeros((BLOCK_T, BLOCK_D, MIX_PAD), tl.float32)
    squares = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    streams = tl.arange(0, HC)
    news = tl.zeros((BLOCK_T, HC, BLOCK_D), tl.float32)
    # Stream by stream, in [tokens, channels] tiles of one layout: the new stream, then its columns' products,
    # summed over the channels once, after the last stream (each sum across threads costs barriers). The new
    # streams are stored after the loop: a store before a load of fn would hold that load (it might alias) until
    # the store is made, and fn's columns come from DRAM, one wait a stream instead of one for all.
    for k in tl.static_range(HC):
        mixed = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for j in tl.static_range(HC):  # the streams' tiles are read from L1 after the first stream
            h = tl.load(h_ptr + t[:, None] * h_stride + j * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
            mixed += tl.load(comb_ptr + t * HC * HC + j * HC + k, mask=t_ok, other=0.0)[:, None] * h
        post = tl.load(post_ptr + t * HC + k, mask=t_ok, other=0.0)
        new = rounded(post[:, None] * out + mixed, new_ptr.dtype.element_ty)
        news = tl.where((streams == k)[None, :, None], new[:, None, :], news)
        # fn's columns k * D + d, products with the new (rounded) values. Loaded in the products' shape (each
        # token's copy from L1): a [channels, columns] tile would be moved through shared memory into that layout.
        w_at = tl.broadcast_to((fn_ptr + cols[None, :] * K + (k * D + d)[:, None])[None, :, :], products.shape)
        w = tl.load(w_at, mask=tl.broadcast_to(w_ok[None, :, :], products.shape), other=0.0)
        products += new[:, :, None] * w
        squares += new * new
    new_at = new_ptr + t[:, None, None] * new_stride + streams[None, :, None] * D + d[None, None, :]
    tl.store(new_at, news.to(new_ptr.dtype.element_ty), mask=ok[:, None, :])
    acc = tl.where(cols[None, :] == MIX, tl.sum(squares, axis=1)[:, None], tl.sum(products, axis=1))
    tl.store(part_ptr + (block * T + t)[:, None] * MIX_PAD + cols[None, :], acc, mask=t_ok[:, None])
    tl.debug_barrier()  # every thread's stores are made before the release below
    programs = tl.num_programs(0)
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == programs - 1
    # CONCURRENT: the program to arrive before the last computes the next gates (post, comb: Sinkhorn's steps, a
    # few us of dependent values) once every row is in, while the last collapses; both arrive once more and the
    # second resets the counter. Else (the interpreter runs programs one after another: a wait would never end)
    # the last does both.
    gates = arrived == tl.maximum(programs - 2, 0) if CONCURRENT else last
    if last:
        chunks = tl.cdiv(D, COLLAPSE_D)
        for token in range(0, T):
            one = token + tl.zeros([1], tl.int64)
            _collapse_tokens(
                new_ptr, new_stride, part_ptr, scale_ptr, base_ptr, x_ptr, x_stride, next_post_ptr, next_comb_ptr,
                x_weight_ptr, one, one < T, 0, T, D, K, programs, iters, chunks, 1, hc_eps, norm_eps, HC, MIX, MIX_PAD,
                False, SPLIT_BLOCK, 1, COLLAPSE_D, ".cg", ROW_NORM, PTX,
            )  # fmt: skip
            if not ROW_NORM:
                _normalize_row(x_ptr, x_stride, token, x_weight_ptr, D, norm_eps, COLLAPSE_D)
    if gates:
        seen = arrived + 1
        while seen < programs:  # the rows of the programs still out
            seen = tl.atomic_add(arrivals_ptr, 0, sem="acquire", scope="gpu")
        for token in range(0, T):
            one = token + tl.zeros([1], tl.int64)
            _mixing_gates(
                part_ptr, scale_ptr, base_ptr, next_post_ptr, next_comb_ptr, one, one < T, T, K, programs, iters,
                hc_eps, norm_eps, HC, MIX, MIX_PAD, SPLIT_BLOCK, 1, ".cg", PTX,
            )  # fmt: skip
    if gates != last:
        if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == programs + 1:
            tl.atomic_xchg(arrivals_ptr, 0)
    elif last:
        tl.atomic_xchg(arrivals_ptr, 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one hc_pre / hc_head call is launched."""

    block_t: int  # tokens per projection program
    block_k: int  # flattened channels per projection step
    splits: int  # projection programs along the flattened channels
    k_blocks_per_split: int
    stages: int  # the projection's pipeline stages
    block_d: int  # channels per collapse step
    parts: int  # collapse programs per token
    collapse_tokens: int = 1  # tokens per collapse program (more than one: parts is 1)


def plan(tokens: int, k: int, d: int, mix_pad: int, x_bytes: int, sms: int, smem: int) -> Plan:
    """Tiles from the device: the projection split along K until PROJECTION_WAVES programs per SM run, pipeline
    stages as many as half a program's shared memory (`smem` bytes) holds, and each token's collapse split over
    its channel blocks until COLLAPSE_WAVES programs per SM run."""
    block_t = PROJECTION_SMALL_T if tokens <= PROJECTION_SMALL_T else PROJECTION_LARGE_T
    k_blocks = triton.cdiv(k, PROJECTION_BLOCK_K)
    splits = max(1, min(k_blocks, triton.cdiv(PROJECTION_WAVES * sms, triton.cdiv(tokens, block_t))))
    per_split = triton.cdiv(k_blocks, splits)
    # Loaded tiles in their own dtype, `stage` bytes a stage: the compiled kernel takes at most stages x stage
    # (ptxas, sm_80 / sm_90 / sm_120, bf16, fp16 and fp32 streams). Half the shared memory: two programs an SM.
    stage = PROJECTION_BLOCK_K * (block_t * x_bytes + mix_pad * 4)
    stages = max(1, min(PROJECTION_MAX_STAGES, smem // 2 // stage))
    chunks = triton.cdiv(d, CHANNEL_BLOCK)
    parts = max(1, min(chunks, triton.cdiv(COLLAPSE_WAVES * sms, tokens)))
    # Tokens to spare beyond COLLAPSE_WAVES programs an SM share a program (a token alone in one is latency-bound:
    # its gates and Sinkhorn steps are a few dependent values), in steps of COLLAPSE_TILE channels x tokens.
    share = max(1, tokens // (COLLAPSE_WAVES * sms))
    collapse_tokens = min(COLLAPSE_MAX_TOKENS, 1 << (share.bit_length() - 1))
    block_d = CHANNEL_BLOCK if collapse_tokens == 1 else COLLAPSE_TILE // collapse_tokens
    splits = triton.cdiv(k_blocks, per_split)
    return Plan(block_t, PROJECTION_BLOCK_K, splits, per_split, stages, block_d, parts, collapse_tokens)


def _check_streams(streams: torch.Tensor, fn: torch.Tensor) -> None:
    t, hc, d = streams.shape
    if streams.stride(2) != 1 or streams.stride(1) != d:
        raise ValueError(f"mHC: streams [T, hc, D] need contiguous [hc, D] rows, got strides {streams.stride()}")
    if fn.shape[1] != hc * d or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"mHC: fn must be contiguous fp32 [mix, {hc * d}], got {fn.dtype} {list(fn.shape)}")


def _collapse_triton(streams, fn, scale, base, iters, hc_eps, norm_eps, mixing: bool, launch: Plan | None):
    _check_streams(streams, fn)
    tokens, hc, d = streams.shape
    mix, k = fn.shape
    mix_pad = _mix_pad(mix)
    dev = streams.device
    x = torch.empty(tokens, d, dtype=streams.dtype, device=dev)
    post = torch.empty(tokens if mixing else 0, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(tokens if mixing else 0, hc, hc, dtype=torch.float32, device=dev)
    if tokens == 0:
        return x, post, comb
    launch = launch or plan(tokens, k, d, mix_pad, streams.element_size(), num_sms(dev), shared_memory_per_block(dev))
    part = torch.empty(launch.splits, tokens, mix_pad, dtype=torch.float32, device=dev)
    pdl = launches_dependents_early(dev)
    grid = (triton.cdiv(tokens, launch.block_t), launch.splits)
    _projection_kernel[grid](
        streams,
        streams.stride(0),
        fn,
        part,
        tokens,
        k,
        launch.k_blocks_per_split,
        MIX=mix,
        MIX_PAD=mix_pad,
        BLOCK_T=launch.block_t,
        BLOCK_K=launch.block_k,
        PRECISION=PROJECTION_PRECISION.get(streams.dtype, "ieee"),
        PARTS_F32=interpreting(),
        PDL=pdl,
        num_warps=WARPS,
        num_stages=launch.stages,
        launch_pdl=pdl,
    )
    chunks = triton.cdiv(d, launch.block_d)
    parts = min(launch.parts, chunks)
    _collapse_kernel[(triton.cdiv(tokens, launch.collapse_tokens), parts)](
        streams,
        streams.stride(0),
        part,
        scale,
        base,
        x,
        x.stride(0),
        post,
        comb,
        tokens,
        d,
        k,
        launch.splits,
        iters,
        chunks,
        parts,
        hc_eps,
        norm_eps,
        HC=hc,
        MIX=mix,
        MIX_PAD=mix_pad,
        MIXING=mixing,
        SPLIT_BLOCK=triton.next_power_of_2(launch.splits),
        TOKENS=launch.collapse_tokens,
        BLOCK_D=launch.block_d,
        PDL=pdl,
        PTX=not interpreting(),
        num_warps=WARPS,
        launch_pdl=pdl,
    )
    return x, post, comb


def _mix_pad(mix: int) -> int:
    return max(16, triton.next_power_of_2(mix + 1))  # one spare column carries the sum of squares


def hc_pre_triton(streams, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float, launch=None):
    """hc_pre_reference in two launches (CUDA, or the CPU under TRITON_INTERPRET=1); `launch` overrides the plan."""
    if fn.shape[0] != (2 + hc) * hc or streams.shape[1] != hc:
        raise ValueError(f"hc_pre: fn {list(fn.shape)} and streams {list(streams.shape)} do not fit hc = {hc}")
    return _collapse_triton(streams, fn, scale, base, iters, hc_eps, norm_eps, True, launch)


def hc_head_triton(streams, fn, scale, base, hc_eps: float, norm_eps: float, launch=None) -> torch.Tensor:
    """hc_head_reference in two launches."""
    if fn.shape[0] != streams.shape[1]:
        raise ValueError(f"hc_head: fn {list(fn.shape)} does not fit streams {list(streams.shape)}")
    return _collapse_triton(streams, fn, scale, base, 0, hc_eps, norm_eps, False, launch)[0]


def hc_post_triton(out, streams, post, comb, block_d: int = CHANNEL_BLOCK) -> torch.Tensor:
    """hc_post_reference in one launch."""
    tokens, hc, d = streams.shape
    if streams.stride(2) != 1 or streams.stride(1) != d or out.stride(-1) != 1 or out.shape != (tokens, d):
        raise ValueError(f"hc_post: out {list(out.shape)} / streams {list(streams.shape)} layout not supported")
    post, comb = post.contiguous(), comb.contiguous()
    new = torch.empty(tokens, hc, d, dtype=streams.dtype, device=streams.device)
    if tokens:
        grid = (tokens, triton.cdiv(d, block_d))
        pdl = launches_dependents_early(streams.device)
        _expand_kernel[grid](
            out, out.stride(0), streams, streams.stride(0), post, comb, new, new.stride(0), d, HC=hc, BLOCK_D=block_d,
            PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return new


def hc_post_pre_triton(
    out, streams, post, comb, fn, scale, base, x_weight, hc: int, iters: int, hc_eps: float, norm_eps: float,
    block_d=None, collapse_d=POST_PRE_COLLAPSE_D,
):  # fmt: skip
    """hc_post_pre in one launch for at most POST_PRE_TOKENS tokens (CUDA, or the CPU under TRITON_INTERPRET=1).
    block_d: channels a program (default: a block an SM); collapse_d: channels a step of the collapse and norm."""
    tokens, _, d = streams.shape
    if not 0 < tokens <= POST_PRE_TOKENS or fn.shape[0] != (2 + hc) * hc or streams.shape[1] != hc:
        raise ValueError(f"hc_post_pre: {tokens} tokens (1 to {POST_PRE_TOKENS}), fn {list(fn.shape)}, hc {hc}")
    if streams.stride(2) != 1 or streams.stride(1) != d or out.stride(-1) != 1 or out.shape != (tokens, d):
        raise ValueError(f"hc_post_pre: out {list(out.shape)} / streams {list(streams.shape)} layout not supported")
    _check_streams(streams, fn)
    mix, k = fn.shape
    mix_pad = _mix_pad(mix)
    dev = streams.device
    block_d = max(16, block_d or triton.next_power_of_2(triton.cdiv(d, num_sms(dev))))
    blocks = triton.cdiv(d, block_d)
    collapse_d = min(collapse_d, triton.next_power_of_2(d))
    new = torch.empty_like(streams)
    x = torch.empty(tokens, d, dtype=streams.dtype, device=dev)
    next_post = torch.empty(tokens, hc, dtype=torch.float32, device=dev)
    next_comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=dev)
    part = torch.empty(blocks, tokens, mix_pad, dtype=torch.float32, device=dev)
    post, comb = post.contiguous(), comb.contiguous()
    pdl = launches_dependents_early(dev)
    # One token tile for every count: the sums' order (the tile's layout) then does not depend on the batch, so a
    # CUDA graph padded to 4 rows gives the eager step of 2 the same bits.
    _post_project_kernel[(blocks,)](
        out, out.stride(0), streams, streams.stride(0), post, comb, new, new.stride(0), fn, part,
        arrival_counters(dev), scale, base, x, x.stride(0), x_weight, next_post, next_comb, tokens, d, k, iters,
        hc_eps, norm_eps, HC=hc, MIX=mix, MIX_PAD=mix_pad, BLOCK_T=POST_PRE_TOKENS, BLOCK_D=block_d,
        SPLIT_BLOCK=triton.next_power_of_2(blocks), COLLAPSE_D=collapse_d, ROW_NORM=d <= collapse_d,
        CONCURRENT=not interpreting(),
        PDL=pdl, PTX=not interpreting(), num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return new, x, next_post, next_comb


def _fused(streams: torch.Tensor) -> bool:
    hc = streams.shape[1]
    return streams.is_cuda and hc & (hc - 1) == 0


def hc_pre(streams: torch.Tensor, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """streams [T, hc, D] -> (sub-layer input [T, D], post [T, hc], comb [T, hc, hc]); see hc_pre_reference."""
    if _fused(streams):
        return hc_pre_triton(streams, fn, scale, base, hc, iters, hc_eps, norm_eps)
    return hc_pre_reference(streams, fn, scale, base, hc, iters, hc_eps, norm_eps)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, hc, D] from the sub-layer output [T, D]; see hc_post_reference."""
    if _fused(streams):
        return hc_post_triton(out, streams, post, comb)
    return hc_post_reference(out, streams, post, comb)


def hc_post_pre(
    out, streams, post, comb, fn, scale, base, x_weight, hc: int, iters: int, hc_eps: float, norm_eps: float
):  # fmt: skip
    """hc_post, then hc_pre of the new streams, then the RMSNorm (weight x_weight, eps norm_eps) of its sub-layer
    input: (new streams [T, hc, D], normalised input [T, D], post, comb); one launch for a few tokens (decode),
    else hc_post's, hc_pre's and the norm's."""
    if _fused(streams) and 0 < streams.shape[0] <= POST_PRE_TOKENS:
        return hc_post_pre_triton(out, streams, post, comb, fn, scale, base, x_weight, hc, iters, hc_eps, norm_eps)
    new = hc_post(out, streams, post, comb)
    x, post, comb = hc_pre(new, fn, scale, base, hc, iters, hc_eps, norm_eps)
    return new, rms_norm(x, x_weight, norm_eps), post, comb


def hc_head(streams: torch.Tensor, fn, scale, base, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse [T, hc, D] -> [T, D]; see hc_head_reference."""
    if _fused(streams):
        return hc_head_triton(streams, fn, scale, base, hc_eps, norm_eps)
    return hc_head_reference(streams, fn, scale, base, hc_eps, norm_eps)
