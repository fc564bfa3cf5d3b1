"""The eager fp64 reference of the cross-entropy's row loss (csrc/detmath.h ``ce_row_loss``).

The det cross-entropy once computed log1p with these ~40 eager PyTorch ops per call; the kernel
now runs the same IEEE operations in the same order, and the tests hold it to these bytes on
CPU and CUDA (and to ``math.log1p`` for accuracy).
"""
from __future__ import annotations

import torch

__all__ = ["log1p_fp64", "ce_row_loss_ref"]

# log(2) split so that k * _LN2_HI is exact for |k| < 2^20 (its low 32 bits are zero).
_LN2_HI = float.fromhex("0x1.62e42feep-1")
_LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
_SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")  # only chooses a branch; any nearby value works
_SQRT2_M1 = float.fromhex("0x1.a827999fcef32p-2")  # sqrt(2) - 1, likewise
# 1/(2n+1): Python's int/int division is correctly rounded. Twelve terms of the atanh series:
# |u| <= 0.1716 on the reduced range, so the first omitted term is below 2^-60 of the sum.
_ATANH = tuple(1.0 / (2 * n + 1) for n in range(12))


def log1p_fp64(t: torch.Tensor) -> torch.Tensor:
    """log(1 + t) for a float64 tensor of t >= 0 (or NaN), from IEEE + - * / and frexp only.

    Why not ``torch.log1p``: CPU (glibc/SLEEF) and CUDA (libdevice) logs differ in the last bit.
    Separate eager torch ops are single, correctly rounded IEEE operations on both (no FMA
    contraction across ops), and frexp/doubling are exact, so this is the same fp64 function on
    every device. Absolute error about 2^-52 * max(1, |log(1+t)|).

    1 + t = 2^k f with f in [sqrt(1/2), sqrt(2)); log f = 2 atanh(u), u = (f - 1) / (f + 1).
    For t < sqrt(2) - 1, k = 0 and u = t / (t + 2), so 1 + t is never rounded (t may be 1e-30).
    For larger t (an fp32 value, so its ulp is >= 2^-25), 1 + t is exact in fp64.
    """
    small = t < _SQRT2_M1
    mant, expo = torch.frexp(torch.where(small, torch.ones_like(t), t + 1.0))  # mant in [0.5, 1)
    low = mant < _SQRT_HALF
    f = torch.where(low, mant + mant, mant)  # exact doubling
    k = torch.where(small, torch.zeros_like(expo), expo - low.to(expo.dtype)).to(torch.float64)
    u = torch.where(small, t / (t + 2.0), (f - 1.0) / (f + 1.0))
    w = u * u
    p = torch.full_like(w, _ATANH[-1])
    for c in reversed(_ATANH[:-1]):
        p = p * w + c  # two eager ops: multiply, then add, each rounded once
    return k * _LN2_HI + (k * _LN2_LO + (u + u) * p)


def ce_row_loss_ref(m: torch.Tensor, picked: torch.Tensor, t_minus: torch.Tensor) -> torch.Tensor:
    """fp32((m - picked) + log1p(t_minus)) in fp64, eagerly; m, picked, t_minus (N,) float32.
    NaN losses as the kernel writes them: the canonical quiet NaN."""
    loss = ((m.double() - picked.double()) + log1p_fp64(t_minus.double())).float()
    return torch.where(loss.isnan(), torch.full_like(loss, float("nan")), loss)
