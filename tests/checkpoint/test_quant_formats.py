"""FP8 block-scaled and MXFP4 weights against hand-decoded bytes and transformers' own dequantiser."""

import math

import pytest
import torch
from transformers.integrations import finegrained_fp8

from ds4.checkpoint.quant import (
    QuantFormatError,
    e2m1_encode,
    e8m0_to_float,
    float_to_e8m0,
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
)

E8M0 = torch.float8_e8m0fnu


def e4m3_value(byte: int) -> float:
    """OCP e4m3fn by hand: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


E2M1_BY_HAND = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_BY_HAND[code & 7]


def bytes_tensor(values, dtype, shape):
    return torch.tensor(values, dtype=torch.uint8).view(dtype).reshape(shape)


def test_e8m0_bytes_are_biased_powers_of_two():
    raw = [0, 1, 100, 126, 127, 128, 200, 254]
    scale = bytes_tensor(raw, E8M0, (len(raw),))
    assert e8m0_to_float(scale).tolist() == [math.ldexp(1.0, b - 127) for b in raw]
    assert float_to_e8m0(torch.tensor([0.25, 1.0, 2.0**100])).view(torch.uint8).tolist() == [125, 127, 227]
    with pytest.raises(QuantFormatError, match="powers of two"):
        float_to_e8m0(torch.tensor([3.0]))
    with pytest.raises(QuantFormatError, match="NaN"):
        e8m0_to_float(bytes_tensor([255], E8M0, (1,)))


def test_fp8_dequantize_hand_built_bytes_with_partial_blocks():
    # 130 x 131: every non-NaN e4m3 byte appears, and both dims end in a partial 128-block.
    codes = [b for b in range(256) if b not in (0x7F, 0xFF)]
    rows, cols = 130, 131
    raw = [codes[(i * 7 + 3) % len(codes)] for i in range(rows * cols)]
    weight = bytes_tensor(raw, torch.float8_e4m3fn, (rows, cols))
    scale_bytes = [[127 + 1, 127 - 3], [127 + 5, 127 - 10]]
    scale = bytes_tensor(sum(scale_bytes, []), E8M0, (2, 2))
    got = fp8_block_dequantize(weight, scale, (128, 128), torch.float32)
    expected = torch.tensor(
        [
            [e4m3_value(raw[r * cols + c]) * 2.0 ** (scale_bytes[r // 128][c // 128] - 127) for c in range(cols)]
            for r in range(rows)
        ]
    )
    assert torch.equal(got, expected)
    assert torch.equal(fp8_block_dequantize(weight, scale, (128, 128), torch.bfloat16).float(), expected)


def test_fp8_dequantize_matches_transformers_dequantiser():
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 0x7F, (256, 384), generator=g, dtype=torch.uint8)
    weight |= torch.randint(0, 2, (256, 384), generator=g, dtype=torch.uint8) << 7
    weight = weight.view(torch.float8_e4m3fn)
    scale = torch.randint(110, 140, (2, 3), generator=g, dtype=torch.uint8).view(E8M0)
    oracle = finegrained_fp8.Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)
    assert torch.equal(fp8_block_dequantize(weight, scale, (128, 128), torch.float32), oracle)


def test_fp8_quantize_reproduces_known_codes_and_scales():
    # Each block holds +-448 (byte 0x7E / 0xFE), so its scale is exactly the one the values were built with.
    g = torch.Generator().manual_seed(1)
    rows, cols, block = 200, 300, (128, 128)
    raw = torch.randint(0, 0x7F, (rows, cols), generator=g, dtype=torch.uint8)
    raw |= torch.randint(0, 2, (rows, cols), generator=g, dtype=torch.uint8) << 7
    for r0 in range(0, rows, 128):
        for c0 in range(0, cols, 128):
            raw[r0, c0] = 0xFE if (r0 + c0) % 256 else 0x7E
    scale_bytes = torch.randint(100, 150, (2, 3), generator=g, dtype=torch.uint8)
    values = torch.tensor([e4m3_value(b) for b in raw.flatten().tolist()]).reshape(rows, cols)
    values *= torch.tensor(
        [[2.0 ** (int(scale_bytes[r // 128, c // 128]) - 127) for c in range(cols)] for r in range(rows)]
    )
    weight, scale = fp8_block_quantize(values, block)
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == E8M0
    assert torch.equal(scale.view(torch.uint8), scale_bytes)
    # +0 and -0 are the same value; compare values, and bytes everywhere else.
    per_element = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    assert torch.equal(weight.float(), values / per_element)
    nonzero = values != 0
    assert torch.equal(weight.view(torch.uint8)[nonzero], raw[nonzero])


def test_fp8_round_trip_error_and_fixed_point():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(2)) * 0.05
    weight, scale = fp8_block_quantize(w, (128, 128))
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    back = fp8_block_dequantize(weight, scale, (128, 128), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale for subnormals.
    assert bool(((back - w).abs() <= torch.maximum(w.abs() * 2.0**-4, s * 2.0**-10)).all())
    # Power-of-two scales are the smallest that fit: every block's largest |q| lies in (224, 448].
    blocks = torch.nn.functional.pad((w / s).abs(), (0, 56, 0, 84)).view(3, 128, 2, 128).amax(dim=(1, 3))
    assert bool(((blocks > 224) & (blocks <= 448)).all())
    # Representable values survive a second round trip (the scale may halve where a block's max rounded to 224).
    assert torch.equal(fp8_block_dequantize(*fp8_block_quantize(back, (128, 128)), (128, 128), torch.float32), back)


def test_mxfp4_dequantize_hand_built_bytes_low_nibble_first():
    # One row, 64 values = 32 bytes = two 32-element scale blocks.
    packed_bytes = [0x21, 0xF8, 0x7A, 0x09] + [0x00] * 12 + [0x3C, 0x5D] + [0x77] * 14
    packed = bytes_tensor(packed_bytes, torch.int8, (1, 32))
    scale = bytes_tensor([127 + 1, 127 - 2], E8M0, (1, 2))
    got = mxfp4_dequantize(packed, scale, torch.float32)
    expected = []
    for i, byte in enumerate(packed_bytes):
        block_scale = 2.0 if i < 16 else 0.25
        expected += [e2m1_value(byte & 0xF) * block_scale, e2m1_value(byte >> 4) * block_scale]
    assert got.tolist() == [expected]
    # Spelled out at scale 2: 0x21 -> (0.5, 1.0); 0xF8 -> (-0, -6); 0x7A -> (-1, 6); 0x09 -> (-0.5, 0);
    # and at scale 1/4: 0x3C -> (-2, 1.5).
    assert got[0, :8].tolist() == [1.0, 2.0, -0.0, -12.0, -2.0, 12.0, -1.0, 0.0]
    assert got[0, 32:34].tolist() == [-0.5, 0.375]


def test_mxfp4_dequantize_matches_transformers_dequantiser():
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (48, 64), generator=g, dtype=torch.int8)
    scale = torch.randint(110, 140, (48, 4), generator=g, dtype=torch.uint8).view(E8M0)
    oracle = finegrained_fp8.Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)
    assert torch.equal(mxfp4_dequantize(packed, scale, torch.float32), oracle)


def test_e2m1_encode_every_code_and_round_half_to_even():
    for code in range(16):
        if code == 8:
            continue  # -0 encodes as +0's code unless the input is negative
        assert int(e2m1_encode(torch.tensor([e2m1_value(code)]))) == code
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0])
    assert [e2m1_value(int(c)) for c in e2m1_encode(ties)] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]
    near = torch.tensor([0.26, 0.74, 2.49, 5.01, 0.1])
    assert [e2m1_value(int(c)) for c in e2m1_encode(near)] == [0.5, 0.5, 2.0, 6.0, 0.0]
    with pytest.raises(QuantFormatError):
        e2m1_encode(torch.tensor([6.5]))


def test_mxfp4_quantize_reproduces_known_codes_and_scales():
    g = torch.Generator().manual_seed(4)
    rows, cols = 16, 96
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    codes[codes == 8] = 0
    codes[:, ::32] = 7  # a +6 in every block pins the block's scale
    scale_bytes = torch.randint(100, 150, (rows, cols // 32), generator=g, dtype=torch.uint8)
    values = torch.tensor([[e2m1_value(int(c)) for c in row] for row in codes])
    values *= (scale_bytes.float() - 127).exp2().repeat_interleave(32, dim=1)
    packed, scale = mxfp4_quantize(values)
    assert packed.dtype == torch.int8 and packed.shape == (rows, cols // 2)
    assert torch.equal(scale.view(torch.uint8), scale_bytes)
    expected_bytes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    assert torch.equal(packed.view(torch.uint8), expected_bytes)


def test_mxfp4_round_trip_error():
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(5))
    packed, scale = mxfp4_quantize(w)
    back = mxfp4_dequantize(packed, scale, torch.float32)
    s = scale.float().repeat_interleave(32, dim=1)
    # Grid spacing is at most 2 (between 4 and 6) in units of the scale: error <= half of it.
    assert bool(((back - w).abs() <= s).all())
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(back), torch.float32), back)


def test_shape_and_dtype_errors_name_the_shapes():
    weight = torch.zeros(130, 131).to(torch.float8_e4m3fn)
    with pytest.raises(QuantFormatError, match=r"\(1, 1\).*\(130, 131\).*\(2, 2\)"):
        fp8_block_dequantize(weight, torch.ones(1, 1).to(E8M0), (128, 128))
    with pytest.raises(QuantFormatError, match="float8_e4m3fn"):
        fp8_block_dequantize(torch.zeros(2, 2), torch.ones(1, 1).to(E8M0), (128, 128))
    with pytest.raises(QuantFormatError, match=r"\(4, 1\).*\[4, 64\].*\(4, 2\)"):
        mxfp4_dequantize(torch.zeros(4, 32, dtype=torch.int8), torch.ones(4, 1).to(E8M0))
    with pytest.raises(QuantFormatError, match="in % 32"):
        mxfp4_quantize(torch.zeros(4, 48))
