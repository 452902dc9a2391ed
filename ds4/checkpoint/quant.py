"""The two quantised weight formats of DeepSeek-V4 checkpoints, both with power-of-two (UE8M0) scales.

FP8 linears: `float8_e4m3fn` weight [out, in] and one `float8_e8m0fnu` scale per (b0 x b1) block,
scale shape [ceil(out/b0), ceil(in/b1)] (the block shape is the config's `weight_block_size`, 128x128).

MXFP4 routed experts: int8 weight [out, in/2] holding two e2m1 codes per byte, the LOW nibble being the
element with the smaller column index; code bit 3 is the sign, bits 0-2 index E2M1_VALUES. One
`float8_e8m0fnu` scale per 32 consecutive elements of a row: scale shape [out, in/32].

Dequantisation is exact in bfloat16 and float32: a 4-bit or e4m3 value times a power of two needs at most
4 significant bits, and every UE8M0 scale is a normal float32/bfloat16 number.
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP4_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_SIGN = 0x8
_E8M0_BIAS = 127
_E8M0_NAN = 0xFF


class QuantFormatError(ValueError):
    """A quantised tensor whose shape or dtype does not match its scales."""


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 powers of two (2 ** (byte - 127)); the NaN byte 0xFF is rejected."""
    if scale.dtype != torch.float8_e8m0fnu:
        raise QuantFormatError(f"scale dtype {scale.dtype}; expected torch.float8_e8m0fnu")
    if bool((scale.view(torch.uint8) == _E8M0_NAN).any()):
        raise QuantFormatError("scale holds the UE8M0 NaN byte 0xFF")
    return scale.float()


def float_to_e8m0(power_of_two: torch.Tensor) -> torch.Tensor:
    """Exact powers of two in [2^-127, 2^127] -> UE8M0."""
    mantissa, exponent = torch.frexp(power_of_two.float())
    if not bool((mantissa == 0.5).all()):
        raise QuantFormatError("UE8M0 holds only powers of two")
    biased = exponent - 1 + _E8M0_BIAS
    if bool(((biased < 0) | (biased > _E8M0_NAN - 1)).any()):
        raise QuantFormatError("scale outside the UE8M0 range 2^-127 .. 2^127")
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def power_of_two_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= qmax (float32; all-zero blocks get the smallest scale)."""
    ratio = (amax.float() / qmax).clamp(min=2.0**-_E8M0_BIAS, max=2.0**_E8M0_BIAS)
    mantissa, exponent = torch.frexp(ratio)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(ratio), exponent.clamp(-_E8M0_BIAS, _E8M0_BIAS))


# ---- FP8 e4m3, block-scaled ----


def fp8_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn weight [out, in], float8_e8m0fnu scale [ceil(out/b0), ceil(in/b1)])."""
    if weight.dim() != 2:
        raise QuantFormatError(f"FP8 block quantisation needs a 2-d weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    srows, scols = fp8_scale_shape((rows, cols), block)
    padded = weight.float().new_zeros(srows * block[0], scols * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(srows, block[0], scols, block[1])
    scale = power_of_two_scale(blocks.abs().amax(dim=(1, 3)), FP8_E4M3_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, float_to_e8m0(scale)


def fp8_block_dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """(float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/b0), ceil(in/b1)]) -> weight * scale in `dtype`."""
    if weight.dtype != torch.float8_e4m3fn:
        raise QuantFormatError(f"FP8 weight dtype {weight.dtype}; expected torch.float8_e4m3fn")
    if weight.dim() != 2:
        raise QuantFormatError(f"FP8 weight must be 2-d, got shape {tuple(weight.shape)}")
    expected = fp8_scale_shape(tuple(weight.shape), block)
    if tuple(scale.shape) != expected:
        raise QuantFormatError(
            f"FP8 scale shape {tuple(scale.shape)}; weight {tuple(weight.shape)} with {block[0]}x{block[1]} "
            f"blocks needs {expected}"
        )
    rows, cols = weight.shape
    s = e8m0_to_float(scale).repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return (weight.float() * s[:rows, :cols]).to(dtype)


# ---- MXFP4 (e2m1 codes, 32-element UE8M0 blocks along the input dim) ----

_E2M1_TABLE = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
_E2M1_MIDPOINTS = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:])], dtype=torch.float32)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """Float values in [-6, 6] -> uint8 e2m1 codes, rounding to nearest, ties to the even code (as IEEE)."""
    magnitude = values.float().abs()
    if bool((magnitude > E2M1_MAX).any()) or bool(magnitude.isnan().any()):
        raise QuantFormatError("e2m1 encodes values in [-6, 6] only")
    mids = _E2M1_MIDPOINTS.to(values.device)
    lower = torch.bucketize(magnitude, mids, right=False)
    upper = torch.bucketize(magnitude, mids, right=True)
    code = torch.where(lower % 2 == 0, lower, upper)
    sign = (values < 0).to(torch.uint8) * _E2M1_SIGN
    return code.to(torch.uint8) | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) -> float32 values."""
    return _E2M1_TABLE.to(codes.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> int8 bytes [..., n]; element 2i goes to the low nibble of byte i."""
    if codes.shape[-1] % 2:
        raise QuantFormatError(f"packing e2m1 needs an even last dim, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8 bytes [..., n] -> uint8 codes [..., 2n] (low nibble first)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise QuantFormatError(f"packed e2m1 dtype {packed.dtype}; expected torch.int8")
    u = packed.view(torch.uint8)
    return torch.stack((u & 0xF, u >> 4), dim=-1).flatten(-2)


def mxfp4_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return (shape[0], shape[1] // MXFP4_BLOCK)


def mxfp4_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float (in % 32 == 0) -> (int8 packed [out, in/2], float8_e8m0fnu scale [out, in/32])."""
    if weight.dim() != 2 or weight.shape[1] % MXFP4_BLOCK:
        raise QuantFormatError(f"MXFP4 needs a 2-d weight with in % {MXFP4_BLOCK} == 0, got {tuple(weight.shape)}")
    blocks = weight.float().unflatten(1, (-1, MXFP4_BLOCK))
    scale = power_of_two_scale(blocks.abs().amax(dim=2), E2M1_MAX)
    q = (blocks / scale[..., None]).clamp(-E2M1_MAX, E2M1_MAX).flatten(1)
    return pack_e2m1(e2m1_encode(q)), float_to_e8m0(scale)


def mxfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(int8 [out, in/2], float8_e8m0fnu [out, in/32]) -> [out, in] in `dtype`."""
    if packed.dim() != 2:
        raise QuantFormatError(f"MXFP4 weight must be 2-d, got shape {tuple(packed.shape)}")
    cols = packed.shape[1] * 2
    expected = mxfp4_scale_shape((packed.shape[0], cols))
    if cols % MXFP4_BLOCK or tuple(scale.shape) != expected:
        raise QuantFormatError(
            f"MXFP4 scale shape {tuple(scale.shape)}; packed weight {tuple(packed.shape)} "
            f"(logical [{packed.shape[0]}, {cols}]) needs {expected}"
        )
    values = e2m1_decode(unpack_e2m1(packed))
    s = e8m0_to_float(scale).repeat_interleave(MXFP4_BLOCK, dim=1)
    return (values * s).to(dtype)
