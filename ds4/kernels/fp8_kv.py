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
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
KV_QUANT_BLOCK = 64
_AMAX_FLOOR = 1e-4
_ENTRY_ALIGN = 8
_EXPONENT_BIAS = 127


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
