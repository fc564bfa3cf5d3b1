"""Exact scalar arithmetic on LongAcc values in Python integers (for small, host-side results).

Used where a value must be divided by a count that is not a power of two (a global mean over
3 ranks) and still be rounded only once. Everything here is integer arithmetic.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..profile import LSB_EXP, NDIGITS, STATUS_BITS

_FORMATS = {torch.float32: (24, -149, 128), torch.bfloat16: (8, -133, 128), torch.float16: (11, -24, 16)}
_MASK = (1 << STATUS_BITS) - 1


def acc_to_int(words) -> int:
    """The integer n (value = n * 2^-298) held by one LongAcc's words (canonical or not)."""
    return sum(int(d) << (32 * i) for i, d in enumerate(list(words)[:NDIGITS]))


def acc_special(words):
    """NaN / +inf / -inf implied by a LongAcc's status word, or None when the value is finite."""
    st = int(list(words)[NDIGITS])
    nan, pinf, ninf = st & _MASK, (st >> STATUS_BITS) & _MASK, (st >> 2 * STATUS_BITS) & _MASK
    if nan or (pinf and ninf):
        return math.nan
    if pinf:
        return math.inf
    if ninf:
        return -math.inf
    return None


def round_ratio(num: int, den: int, dtype: torch.dtype = torch.float32) -> float:
    """(num * 2^-298) / den rounded once, to nearest-even, into ``dtype``; as a Python float."""
    if den <= 0:
        raise ValueError(f"den: expected a positive integer, got {den}")
    prec, emin_ulp, emax = _FORMATS[dtype]
    if num == 0:
        return 0.0
    neg = num < 0
    m = -num if neg else num
    e = m.bit_length() - den.bit_length()  # floor(log2(m / den)) is e or e - 1
    if (m < (den << e)) if e >= 0 else ((m << -e) < den):
        e -= 1
    p = e + LSB_EXP
    ulp = max(p - (prec - 1), emin_ulp)
    s = ulp - LSB_EXP
    n_, d_ = (m, den << s) if s >= 0 else (m << -s, den)
    q, r = divmod(n_, d_)
    if 2 * r > d_ or (2 * r == d_ and q & 1):
        q += 1
    if q.bit_length() + ulp > emax:
        return -math.inf if neg else math.inf
    v = math.ldexp(q, ulp)
    return -v if neg else v


def mean_of_acc(words, count: int, dtype: torch.dtype = torch.float32) -> float:
    """Exact value of a LongAcc divided by ``count``, rounded once."""
    special = acc_special(words)
    if special is not None:
        return special
    return round_ratio(acc_to_int(words), count, dtype)


def reciprocal(count: int, dtype: torch.dtype = torch.float32) -> float:
    """1 / count correctly rounded into ``dtype`` (Python's 1.0 / count would round twice)."""
    return round_ratio(1 << -LSB_EXP, count, dtype)


def pow2_scale_exp(count: int) -> Optional[int]:
    """-k when ``count`` is 2^k, 0 <= k <= 64, else None: the ``scale_exp`` with which
    ``det_finalize`` divides by ``count`` inside its one rounding (exactly, on the device)."""
    if count <= 0 or count & (count - 1) or count > 1 << 64:
        return None
    return -(count.bit_length() - 1)
