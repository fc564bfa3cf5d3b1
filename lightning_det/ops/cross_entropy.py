"""Cross-entropy kernels over rows of logits (``ldet::ce_forward`` / ``ce_backward`` / ``ce_row_loss``,
csrc/cross_entropy.h).

:mod:`lightning_det.nn.loss` states the arithmetic and builds ``det_cross_entropy`` on these;
``lightning_det.reference.ce_ref`` is the plain-Python reference. The kernels check shapes, dtypes
and devices and name the offending argument (csrc/ce_checks.h).
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._registry import ldet

__all__ = ["ce_forward", "ce_backward", "ce_row_loss"]


def ce_forward(x: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row losses of logits x (N, C) (float32/bfloat16/float16) for int64 targets (N,) in
    [0, C) where the bool mask ``valid`` (N,) is set.

    Returns ``(loss, e, s)``: fp32 losses (N,) (+0.0 where not valid), and the fp32 exponentials
    e (N, C) and their rounded sums s (N,) that :func:`ce_backward` needs.
    """
    return ldet().ce_forward(x, target, valid)


def ce_backward(
    e: torch.Tensor, s: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The logits' gradient (N, C) for row-loss gradients ``grad`` (N,), rounded to ``out_dtype``."""
    return ldet().ce_backward(e, s, target, valid, grad, out_dtype)


def ce_row_loss(m: torch.Tensor, picked: torch.Tensor, t_minus: torch.Tensor) -> torch.Tensor:
    """The row-loss step alone: ``fp32((m - picked) + log1p(t_minus))`` per element, fp32 inputs."""
    return ldet().ce_row_loss(m, picked, t_minus)
