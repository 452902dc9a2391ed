"""The FP8 attention-cache entry: what the reference's fp8 KV simulation keeps, stored as bytes.

The reference rounds the non-RoPE channels of every attention KV entry (window and compressed) through
e4m3 in blocks of 64 with power-of-two (ue8m0) scales, as its act_quant with rounded scales: amax floored at
1e-4, scale = 2^ceil(log2(amax * fp32(1/448))), values x / scale clamped to +-448 and rounded to the nearest
e4m3; the RoPE channels stay bf16. An entry of head_dim = nope + rope channels is one row of
`kv_entry_bytes` bytes:

    [0, nope)                          the non-RoPE channels, e4m3
    [nope, nope + 2 rope)              the RoPE channels, bf16
    [nope + 2 rope, ... + nope / 64)   one scale exponent byte per block of 64 (scale = 2^(byte - 127))
    then zeros up to a multiple of 8 bytes.

DeepSeek-V4 (512 = 448 + 64): 448 + 128 + 7 + 1 = 584 bytes, vLLM's entry size. vLLM puts a page's scales
after all its entries' data; ds4 keeps each entry in one row, so that the window ring, the compressed pages
and the boundary snapshots stay pools of rows that the same code writes, copies and gathers for either cache
dtype, and a kernel reads a key's bytes from one place (rows are 8-byte aligned).

`quantize_kv` is the spec (and the CPU path); `store_fp8_entries` writes the same bytes inside a Triton kernel
(the kernels that finish entries end with it), with the exponent and the e4m3 rounding (to nearest, ties to an
even mantissa) taken from the fp32 bits, so that it is bit-exact on every GPU and in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
KV_QUANT_BLOCK = 64
_AMAX_FLOOR = 1e-4
_ENTRY_ALIGN = 8
_EXPONENT_BIAS = 127
# The same, as Triton kernels read them.
_MAX_K, _BLOCK_K, _FLOOR_K = tl.constexpr(E4M3_MAX), tl.constexpr(KV_QUANT_BLOCK), tl.constexpr(_AMAX_FLOOR)
_ALIGN_K, _BIAS_K = tl.constexpr(_ENTRY_ALIGN), tl.constexpr(_EXPONENT_BIAS)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0, fp32): the ue8m0 scale rounding."""
    return torch.ldexp(torch.ones_like(x), _ceil_log2(x))


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)
    # frexp gives x = m * 2^e with m in [0.5, 1); an exact power of two has m == 0.5.
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _block_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """Scale exponents of fp32 blocks [..., n, block]: [..., n, 1] int."""
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(_AMAX_FLOOR)
    return _ceil_log2(amax * (1.0 / E4M3_MAX))


def fp8_quant_dequant(x: torch.Tensor, block: int = KV_QUANT_BLOCK) -> torch.Tensor:
    """Round x's last dim through e4m3 in blocks of `block` channels; returns x's dtype."""
    if x.shape[-1] % block:
        raise ValueError(f"fp8 quantisation needs a channel count divisible by {block}, got {x.shape[-1]}")
    blocks = x.float().unflatten(-1, (-1, block))
    scale = torch.ldexp(torch.ones_like(blocks[..., :1]), _block_exponents(blocks))
    q = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2).to(x.dtype)


def kv_entry_bytes(head_dim: int, rope_dim: int) -> int:
    """Bytes of one stored FP8 entry (see the module docstring)."""
    nope = _nope_dims(head_dim, rope_dim)
    raw = nope + 2 * rope_dim + nope // KV_QUANT_BLOCK
    return -(-raw // _ENTRY_ALIGN) * _ENTRY_ALIGN


def _nope_dims(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    if nope <= 0 or nope % KV_QUANT_BLOCK:
        raise ValueError(
            f"the FP8 KV cache needs the non-RoPE dims ({head_dim} - {rope_dim} = {nope}) to be a positive "
            f"multiple of the fp8 block {KV_QUANT_BLOCK}"
        )
    return nope


def quantize_kv(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """Entries kv [..., head_dim] -> their stored bytes, uint8 [..., kv_entry_bytes]."""
    head_dim = kv.shape[-1]
    nope = _nope_dims(head_dim, rope_dim)
    blocks = kv[..., :nope].float().unflatten(-1, (-1, KV_QUANT_BLOCK))
    exponents = _block_exponents(blocks)
    scale = torch.ldexp(torch.ones_like(blocks[..., :1]), exponents)
    values = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).flatten(-2)
    out = kv.new_zeros(*kv.shape[:-1], kv_entry_bytes(head_dim, rope_dim), dtype=torch.uint8)
    rope_end = nope + 2 * rope_dim
    out[..., :nope] = values.view(torch.uint8)
    out[..., nope:rope_end] = kv[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out[..., rope_end : rope_end + nope // KV_QUANT_BLOCK] = (exponents.squeeze(-1) + _EXPONENT_BIAS).to(torch.uint8)
    return out


def dequantize_kv(packed: torch.Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored entries uint8 [..., kv_entry_bytes] -> the values they hold, [..., head_dim] in `dtype`."""
    nope = _nope_dims(head_dim, rope_dim)
    if packed.dtype != torch.uint8 or packed.shape[-1] != kv_entry_bytes(head_dim, rope_dim):
        raise ValueError(
            f"FP8 KV entries must be uint8 [..., {kv_entry_bytes(head_dim, rope_dim)}], got "
            f"{packed.dtype} {tuple(packed.shape)}"
        )
    rope_end = nope + 2 * rope_dim
    values = packed[..., :nope].contiguous().view(torch.float8_e4m3fn).float().unflatten(-1, (-1, KV_QUANT_BLOCK))
    exponents = packed[..., rope_end : rope_end + nope // KV_QUANT_BLOCK].int() - _EXPONENT_BIAS
    scale = torch.ldexp(torch.ones_like(values[..., :1]), exponents.unsqueeze(-1).float())
    rope = packed[..., nope:rope_end].contiguous().view(torch.bfloat16).float()
    return torch.cat(((values * scale).flatten(-2), rope), dim=-1).to(dtype)


@triton.jit
def _ceil_log2_bits(x):
    """ceil(log2(x)) of positive normal fp32 x, from its bits (the _ceil_log2 of the spec)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - _BIAS_K + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def bf16_bits(x):
    """The bf16 nearest to finite fp32 x (ties to even), as an int32 holding its 16 bits in the high half (a cast
    would do, but the interpreter's truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536


@triton.jit
def e4m3_bytes(v):
    """The e4m3fn byte (as int32) nearest to fp32 v in [-448, 448], ties to an even mantissa, from the bits (the
    interpreter has no e4m3 rounding of its own, sm_80 no instruction)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    magnitude = tl.abs(v)
    bits = magnitude.to(tl.int32, bitcast=True)
    # Normal e4m3 (>= 2^-6): drop 20 of fp32's 23 mantissa bits rounding to even, rebias the exponent 127 -> 7.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal e4m3: the count of 2^-9 steps, magnitude * 2^9 = significand * 2^(exponent - 141), rounded to even.
    significand = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - ((bits >> 23) & 0xFF), 31)
    steps = significand >> shift
    rest, half = significand & ((1 << shift) - 1), 1 << (shift - 1)
    steps += ((rest > half) | ((rest == half) & ((steps & 1) == 1))).to(tl.int32)
    return tl.where(magnitude >= 0.015625, normal, steps) | (sign << 7)


@triton.jit
def e4m3_values(bits):
    """e4m3 bytes (int32) -> their values in fp32 (exponent bias 7, subnormals multiples of 2^-9), from the bits
    (sm_80 has no e4m3 conversion)."""
    magnitude = bits & 0x7F
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    value = tl.where(magnitude < 8, magnitude.to(tl.float32) * 0.001953125, normal)
    return tl.where((bits & 0x80) != 0, -value, value)


@triton.jit
def store_fp8_entries(
    row_ptr,
    even,
    odd,
    pair,
    row_ok,
    nope,
    rope_dim,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    copy_ptr=None,
    COPY: tl.constexpr = False,
):
    """Writes entries as quantize_kv does: row_ptr [ROWS] the uint8 rows, even / odd [ROWS, BLOCK_P] fp32 their
    channels 2 * pair and 2 * pair + 1 (pair = tl.arange(0, BLOCK_P); BLOCK_P a multiple of KV_QUANT_BLOCK / 2).
    COPY: the same bytes to the rows copy_ptr [ROWS] too."""
    GROUPS: tl.constexpr = BLOCK_P // (_BLOCK_K // 2)
    is_nope = (pair < nope // 2)[None, :]
    magnitude = tl.where(is_nope, tl.maximum(tl.abs(even), tl.abs(odd)), 0.0)
    amax = tl.max(tl.reshape(magnitude, (ROWS, GROUPS, _BLOCK_K // 2)), axis=2)
    exponent = _ceil_log2_bits(tl.maximum(amax, _FLOOR_K) * (1.0 / _MAX_K))
    # x / 2^e equals x * 2^-e (a power of two, exact): 2^-e built from its bits.
    inverse = ((-exponent + _BIAS_K) << 23).to(tl.float32, bitcast=True)
    inverse = tl.reshape(tl.broadcast_to(inverse[:, :, None], (ROWS, GROUPS, _BLOCK_K // 2)), (ROWS, BLOCK_P))
    even_code = e4m3_bytes(tl.minimum(tl.maximum(even * inverse, -_MAX_K), _MAX_K))
    odd_code = e4m3_bytes(tl.minimum(tl.maximum(odd * inverse, -_MAX_K), _MAX_K))
    # The channels go back in order (pairs interleaved), so that a thread's bytes are one contiguous run.
    codes = tl.reshape(tl.join(even_code, odd_code), (ROWS, 2 * BLOCK_P)).to(tl.uint8)
    # The RoPE channels as bf16, little-endian: channel c at byte nope + 2 (c - nope), a pair one 4-byte word.
    words = (bf16_bits(odd) & -65536) | ((bf16_bits(even) >> 16) & 0xFFFF)
    _write_entries(row_ptr, codes, words, exponent, pair, row_ok, nope, rope_dim, ROWS, BLOCK_P, GROUPS)
    if COPY:
        _write_entries(copy_ptr, codes, words, exponent, pair, row_ok, nope, rope_dim, ROWS, BLOCK_P, GROUPS)


@triton.jit
def _write_entries(
    row_ptr,
    codes,
    words,
    exponent,
    pair,
    row_ok,
    nope,
    rope_dim,
    ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    GROUPS: tl.constexpr,
):
    """store_fp8_entries' bytes into the rows row_ptr [ROWS]. Entries start on _ALIGN_K bytes (kv_entry_bytes): with
    the hint each store writes runs of 8 bytes."""
    row = row_ptr[:, None]
    channel = tl.arange(0, 2 * BLOCK_P)[None, :]
    tl.store(tl.multiple_of(row + channel, [1, _ALIGN_K]), codes, mask=row_ok[:, None] & (channel < nope))
    ok = row_ok[:, None] & (pair >= nope // 2)[None, :] & (pair < (nope + rope_dim) // 2)[None, :]
    at = (row + nope).to(tl.pointer_type(tl.int32)) + (pair - nope // 2)[None, :]
    tl.store(tl.multiple_of(at, [1, _ALIGN_K]), words, mask=ok)
    # The exponent bytes, then zeros up to the entry's end.
    scales = nope + 2 * rope_dim
    group = tl.arange(0, GROUPS)[None, :]
    tl.store(row + scales + group, (exponent + _BIAS_K).to(tl.uint8), mask=row_ok[:, None] & (group < nope // _BLOCK_K))
    padding = scales + nope // _BLOCK_K
    gap = tl.arange(0, _ALIGN_K)[None, :]
    end = (padding + _ALIGN_K - 1) // _ALIGN_K * _ALIGN_K
    tl.store(row + padding + gap, tl.zeros((ROWS, _ALIGN_K), tl.uint8), mask=row_ok[:, None] & (padding + gap < end))
