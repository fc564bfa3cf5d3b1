"""Plain-Python reference for the long-accumulator ops (used by the tests).

Independent of csrc/: values are Python integers scaled by 2^298 (every product of two
fp32/bf16/fp16 values is an integer in these units), rounding is written out with integer
arithmetic. Slow by design; use it on small shapes.
"""
from __future__ import annotations

import math
import struct
from typing import List, Optional, Sequence, Tuple

import torch

from ..profile import LSB_EXP, NDIGITS, STATUS_BITS, TOP_BITS, WORDS

SCALE = -LSB_EXP  # 298
HALF = 149  # every fp32/bf16/fp16 value is an integer multiple of 2^-149

# (significand bits, exponent of the smallest subnormal, values stay below 2^emax)
FORMATS = {
    torch.float32: (24, -149, 128),
    torch.bfloat16: (8, -133, 128),
    torch.float16: (11, -24, 16),
}


def scaled_half(v: float) -> int:
    """v * 2^149 as an exact integer (v finite, a value of fp32/bf16/fp16)."""
    num, den = float(v).as_integer_ratio()
    n = num * (1 << HALF)
    assert n % den == 0, f"{v!r} is not a multiple of 2^-149"
    return n // den


class ExactSum:
    """An exact sum in units of 2^-298 plus the IEEE special flags."""

    def __init__(self) -> None:
        self.n = 0
        self.nan = False
        self.pinf = False
        self.ninf = False

    def add_product(self, a: float, b: float) -> None:
        if math.isnan(a) or math.isnan(b):
            self.nan = True
        elif math.isinf(a) or math.isinf(b):
            if a == 0 or b == 0:
                self.nan = True  # inf x 0
            elif (a > 0) == (b > 0):
                self.pinf = True
            else:
                self.ninf = True
        else:
            self.n += scaled_half(a) * scaled_half(b)

    def add_value(self, v: float) -> None:
        self.add_product(v, 1.0)


def round_scaled(n: int, dtype: torch.dtype = torch.float32, extra_shift: int = 0) -> float:
    """Rounds n * 2^-(298 + extra_shift) once, to nearest-even, into `dtype` (a Python float)."""
    prec, emin_ulp, emax = FORMATS[dtype]
    scale = SCALE + extra_shift
    if n == 0:
        return 0.0
    neg = n < 0
    m = -n if neg else n
    p = m.bit_length() - 1 - scale  # the value is in [2^p, 2^(p+1))
    ulp = max(p - (prec - 1), emin_ulp)
    shift = ulp + scale
    q, r = divmod(m, 1 << shift)
    half = 1 << (shift - 1)
    if r > half or (r == half and q % 2 == 1):
        q += 1
    if q.bit_length() + ulp > emax:
        return -math.inf if neg else math.inf
    v = math.ldexp(q, ulp)
    return -v if neg else v


def round_sum(s: ExactSum, dtype: torch.dtype = torch.float32) -> float:
    if s.nan or (s.pinf and s.ninf):
        return math.nan
    if s.pinf:
        return math.inf
    if s.ninf:
        return -math.inf
    return round_scaled(s.n, dtype)


def digits_of(s: ExactSum) -> List[int]:
    """Canonical LongAcc words of an exact sum: digits 0..16 in [0, 2^32), digit 17 signed and
    inside (-2^TOP_BITS, 2^TOP_BITS); a sum beyond that range is an overflow to +-inf."""
    top = s.n >> (32 * (NDIGITS - 1))  # Python's >> floors, like the carry rule
    pinf, ninf = s.pinf, s.ninf
    if abs(top) >= 1 << TOP_BITS:
        pinf, ninf = pinf or top > 0, ninf or top < 0
        words = [0] * NDIGITS
    else:
        words = [(s.n >> (32 * i)) & 0xFFFFFFFF for i in range(NDIGITS - 1)] + [top]
    status = int(s.nan) | (int(pinf) << STATUS_BITS) | (int(ninf) << (2 * STATUS_BITS))
    words.append(status)
    assert len(words) == WORDS
    return words


def value_of_digits(words: Sequence[int]) -> int:
    """The integer (units of 2^-298) held by LongAcc digits, canonical or not."""
    return sum(int(d) << (32 * i) for i, d in enumerate(words[:NDIGITS]))


def gemm(
    x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> Tuple[List[List[ExactSum]], int, int]:
    """Exact sums of x (M, K) @ w (N, K).T (+ bias) as an M x N grid of ExactSum."""
    xl = x.double().tolist()
    wl = w.double().tolist()
    bl = bias.double().tolist() if bias is not None else None
    out = []
    for i in range(len(xl)):
        row = []
        for j in range(len(wl)):
            s = ExactSum()
            for a, b in zip(xl[i], wl[j]):
                s.add_product(a, b)
            if bl is not None:
                s.add_value(bl[j])
            row.append(s)
        out.append(row)
    return out, len(xl), len(wl)


def encode(v: float, dtype: torch.dtype) -> int:
    """Bit pattern of v (already representable in dtype); NaN is the canonical quiet NaN."""
    if dtype == torch.float16:
        return struct.unpack("<H", struct.pack("<e", v))[0] if v == v else 0x7E00
    b32 = struct.unpack("<I", struct.pack("<f", v))[0] if v == v else 0x7FC00000
    return b32 if dtype == torch.float32 else b32 >> 16


def tensor_of(values, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype` built from bit patterns, so no library cast is involved."""
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    width = 32 if dtype == torch.float32 else 16
    raw = [encode(v, dtype) for v in values]
    raw = [r - (1 << width) if r >= 1 << (width - 1) else r for r in raw]
    return torch.tensor(raw, dtype=int_dtype).view(dtype).reshape(shape)


def gemm_rounded(x, w, bias=None, dtype=torch.float32) -> torch.Tensor:
    """Reference det_gemm: (M, N) of `dtype`."""
    sums, m, n = gemm(x, w, bias)
    return tensor_of([round_sum(s, dtype) for row in sums for s in row], dtype, (m, n))


def gemm_digits(x, w, bias=None) -> torch.Tensor:
    """Reference det_gemm_partial: (M, N, 19) int64."""
    sums, m, n = gemm(x, w, bias)
    return torch.tensor([[digits_of(s) for s in row] for row in sums], dtype=torch.int64).reshape(m, n, WORDS)


def float_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]
