"""fp8 quantization inside Triton kernels: ``x / scale``, saturated and rounded to nearest even.

The formats are OCP's FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): E4M3
(``torch.float8_e4m3fn``, max 448, no infinities) and E5M2 (``torch.float8_e5m2``, max
57344). :func:`quantize_fp8` rounds in float32 to the exact fp8 value first, so the final cast
never rounds: Triton 3.7's interpreter rounds a float32-to-fp8 cast wrongly whenever rounding
up carries into the exponent (1.99 becomes 1.0; its ``_convert_float`` ORs the carried bit into
the exponent field), and on a GPU a cast of a representable value is exact either way. The
result equals PyTorch's ``(x / scale).clamp(-max, max).to(dtype)`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8Format:
    """The constants :func:`quantize_fp8` needs for one fp8 dtype.

    Attributes:
        mantissa_bits: explicit mantissa bits (3 for E4M3, 2 for E5M2).
        max_value: largest finite value.
        min_normal: smallest normal value, ``2 ** (1 - exponent_bias)``.
    """

    mantissa_bits: int
    max_value: float
    min_normal: float


def fp8_format(dtype: torch.dtype) -> Fp8Format:
    """The :class:`Fp8Format` of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.

    Raises:
        ValueError: any other dtype.
    """
    formats = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}
    if dtype not in formats:
        raise ValueError(f"not an fp8 KV cache dtype: {dtype}")
    info = torch.finfo(dtype)
    return Fp8Format(formats[dtype], float(info.max), float(info.smallest_normal))


@triton.jit
def quantize_fp8(
    x, scale, MANTISSA_BITS: tl.constexpr, MAX_VALUE: tl.constexpr, MIN_NORMAL: tl.constexpr
):
    """``x / scale`` (float32 block, float32 scalar) rounded to the nearest fp8 value (ties to
    even) and saturated to ``+-MAX_VALUE``, still in float32: cast it to the fp8 type."""
    y = x.to(tl.float32) / scale
    a = tl.abs(y)
    # Normal range: round the float32 mantissa to MANTISSA_BITS bits by integer arithmetic
    # (add half an fp8 ulp minus one, plus the kept lowest bit for ties to even, then
    # truncate); a carry out of the mantissa increments the exponent, as it should.
    drop: tl.constexpr = 23 - MANTISSA_BITS
    bits = a.to(tl.int32, bitcast=True)  # a >= 0: the sign bit is clear
    bits = bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)
    bits = bits & ~((1 << drop) - 1)
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormal range: a fixed step of MIN_NORMAL / 2**MANTISSA_BITS; adding and subtracting
    # 1.5 * 2**23 steps rounds to a multiple of it (float32 addition rounds to nearest even).
    magic: tl.constexpr = MIN_NORMAL / (1 << MANTISSA_BITS) * 12582912.0
    subnormal = (a + magic) - magic
    r = tl.minimum(tl.where(a < MIN_NORMAL, subnormal, normal), MAX_VALUE)
    # The sign bit copied back (not ``-r``, which is ``0 - r``: it loses the sign of zero).
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
