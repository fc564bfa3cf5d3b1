"""An eager fp64 evaluation of the erf-GELU kernels (csrc/detmath.h ``act_forward`` /
``act_derivative`` with ``kActGeluErf``), one IEEE operation per eager op, with true divisions.

The kernels replace the erf series' divisions by small odd integers with a multiply and two FMA
(``div_odd``, proved there to give the division's bits). This module keeps the plain division, so
the tests that compare the kernels' bytes with it check that proof on real data, on the CPU and
on CUDA. Separate eager ops are single correctly rounded IEEE operations (no FMA contraction
across ops), so these are the same fp64 values on every device.
"""
from __future__ import annotations

import math

import torch

from .log1p_ref import _LN2_HI, _LN2_LO  # log(2) split as hi + lo, the same constants

__all__ = ["norm_cdf_fp64", "gelu_erf_fp64", "gelu_erf_grad_fp64"]

# The kernels' constants (csrc/detmath.h), as exact hex literals.
_H = float.fromhex
_INV_LN2 = _H("0x1.71547652b82fep+0")
_INV_SQRT_PI, _TWO_OVER_SQRT_PI = _H("0x1.20dd750429b6dp-1"), _H("0x1.20dd750429b6dp+0")
_INV_SQRT2, _INV_SQRT_2PI = _H("0x1.6a09e667f3bccp-1"), _H("0x1.9884533d43651p-2")
# 1/n!: Python's int/int division is correctly rounded (the kernels' table holds the same values).
_INV_FACT = tuple(1 / math.factorial(n) for n in range(17))


def _exp(x: torch.Tensor) -> torch.Tensor:
    t = x * _INV_LN2
    k = torch.where(t >= 0, torch.trunc(t + 0.5), torch.trunc(t - 0.5))  # C's truncating int()
    r = (x - k * _LN2_HI) - k * _LN2_LO
    p = torch.full_like(x, _INV_FACT[13])
    for n in range(12, -1, -1):
        p = p * r + _INV_FACT[n]
    k = torch.nan_to_num(k).clamp(-2000, 2000).to(torch.int64)  # the rows that use it are in range
    k1 = torch.where(k >= 0, k // 2, -((-k) // 2))  # C's k / 2 truncates toward zero
    y = torch.ldexp(torch.ldexp(p, k1), k - k1)
    y = torch.where(x > 709.78, torch.full_like(x, math.inf), y)
    y = torch.where(x < -745.2, torch.zeros_like(x), y)
    return torch.where(torch.isnan(x), x, y)


def _exp_neg_sq(z: torch.Tensor) -> torch.Tensor:
    c = 134217729.0 * z  # Veltkamp split: z*z == hi + lo exactly
    zh = c - (c - z)
    zl = z - zh
    hi = z * z
    lo = ((zh * zh - hi) + 2.0 * zh * zl) + zl * zl
    return _exp(-hi) * (1.0 - lo)


def _erf_series(z: torch.Tensor) -> torch.Tensor:
    z2 = 2.0 * z * z
    t, s = z.clone(), z.clone()
    live = torch.ones_like(z, dtype=torch.bool)
    for n in range(1, 60):
        t_new = t * z2 / float(2 * n + 1)  # two eager ops: the multiply, then the true division
        s_new = s + t_new
        t, s = torch.where(live, t_new, t), torch.where(live, s_new, s)
        live = live & ~(t < s * 2.0**-56)
        if not bool(live.any()):
            break
    return s * _exp_neg_sq(z) * _TWO_OVER_SQRT_PI


def _erfc_cf(z: torch.Tensor) -> torch.Tensor:
    terms = torch.where(z < 4.0, 40, torch.where(z < 6.0, 28, 20))
    f = z.clone()
    for n in range(40, 0, -1):
        f = torch.where(n <= terms, z + (0.5 * n) / f, f)
    return _exp_neg_sq(z) * _INV_SQRT_PI / f


def norm_cdf_fp64(x: torch.Tensor) -> torch.Tensor:
    """Phi(x) for a float64 tensor, as the kernels' ``dm::norm_cdf`` computes it."""
    z = x * _INV_SQRT2
    a = z.abs()
    small = a < 3.0
    erf_s = _erf_series(torch.where(small, a, torch.zeros_like(a)))
    erfc_c = _erfc_cf(torch.where(small | (a > 40.0) | torch.isnan(a), torch.full_like(a, 3.0), a))
    erf_a = torch.where(small, erf_s, 1.0 - erfc_c)
    erfc_a = torch.where(small, 1.0 - erf_s, erfc_c)
    y = torch.where(x >= 0, 0.5 * (1.0 + erf_a), 0.5 * erfc_a)
    y = torch.where(a > 40.0, (x > 0).to(x.dtype), y)
    return torch.where(torch.isnan(x), x, y)


def gelu_erf_fp64(x: torch.Tensor) -> torch.Tensor:
    """x * Phi(x) in fp64 (the forward kernel's value before its one rounding)."""
    return x * norm_cdf_fp64(x)


def gelu_erf_grad_fp64(x: torch.Tensor) -> torch.Tensor:
    """d/dx x Phi(x) = Phi(x) + x phi(x) in fp64 (the backward kernel multiplies it by the incoming
    gradient, in fp64, and rounds once)."""
    return norm_cdf_fp64(x) + x * (_exp(-0.5 * x * x) * _INV_SQRT_2PI)
