"""LayerNorm/RMSNorm kernels over rows (``ldet::norm_forward`` / ``ldet::norm_backward``, csrc/norm.h).

:mod:`lightning_det.nn.norm` states the arithmetic and builds DetLayerNorm/DetRMSNorm on these;
``lightning_det.reference.norm_ref`` is the plain-Python reference. The kernels check shapes,
dtypes and devices and name the offending argument (csrc/norm_checks.h).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._registry import ldet

__all__ = ["norm_forward", "norm_backward"]


def norm_forward(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, rms: bool
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalizes each row of x (R, W) (float32/bfloat16/float16); weight, bias: fp32 (W,) or None.

    Returns ``(y, xhat, rstd)``: y (R, W) in x's dtype, and the fp32 xhat (R, W) and rstd (R,)
    that :func:`norm_backward` needs. ``rms``: RMSNorm (no mean subtracted, no bias).
    """
    return ldet().norm_forward(x, weight, bias, eps, rms)


def norm_backward(
    gy: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor], rms: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The input gradient (R, W) of :func:`norm_forward`, rounded once to ``out_dtype``."""
    return ldet().norm_backward(gy, xhat, rstd, weight, rms, out_dtype)
