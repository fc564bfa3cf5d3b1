"""Plain-Python/PyTorch reference for the fused cross-entropy row ops ``ldet::ce_forward`` and
``ldet::ce_backward`` (lightning_det/nn/loss.py states the arithmetic).

Independent of csrc/: the row sums are the exact sums of :mod:`longacc_ref` (Python integers,
rounded once to fp32 nearest-even), exp is the eager evaluation of detmath.h's exp in
:mod:`gelu_ref`, the loss the eager :func:`log1p_ref.ce_row_loss_ref`; every other step is one
eager CPU torch op per IEEE operation. Slow by design; use it on small shapes.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .gelu_ref import _exp
from .log1p_ref import ce_row_loss_ref
from .longacc_ref import gemm_rounded

__all__ = ["ce_forward_ref", "ce_backward_ref"]


def ce_forward_ref(x: torch.Tensor, target: torch.Tensor, valid: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference ``ldet::ce_forward``: x (N, C) float, target (N,) int64 (in [0, C) where valid),
    valid (N,) bool -> (loss (N,) fp32, +0.0 where not valid; e (N, C) fp32; S (N,) fp32)."""
    xf = x.cpu().float()
    n, c = xf.shape
    m = xf.amax(dim=1, keepdim=True)  # exact; NaN propagates
    e = _exp((xf - m).double()).float()  # fp32 subtract, exp in fp64, one rounding
    ones = torch.ones(1, c)
    s = torch.tensor([gemm_rounded(e[r : r + 1], ones).item() for r in range(n)], dtype=torch.float32)
    t_minus = torch.tensor([gemm_rounded(e[r : r + 1], ones, bias=torch.tensor([-1.0])).item() for r in range(n)],
                           dtype=torch.float32)
    tgt = torch.where(valid.cpu(), target.cpu(), torch.zeros_like(target.cpu()))
    picked = xf.gather(1, tgt.unsqueeze(1)).squeeze(1)
    loss = ce_row_loss_ref(m.squeeze(1), picked, t_minus)
    return torch.where(valid.cpu(), loss, torch.zeros_like(loss)), e, s


def ce_backward_ref(e: torch.Tensor, s: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                    grad: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Reference ``ldet::ce_backward``: (e / S - [j == t]) * grad per element of valid rows, +0.0
    elsewhere, rounded to ``out_dtype``."""
    e, s, valid = e.cpu(), s.cpu(), valid.cpu()
    tgt = torch.where(valid, target.cpu(), torch.zeros_like(target.cpu())).unsqueeze(1)
    p = e / s.unsqueeze(1)  # tensor / tensor: a true IEEE division
    cols = torch.arange(e.shape[1]).unsqueeze(0)
    d = torch.where(cols == tgt, p - 1.0, p)
    g = d * grad.cpu().float().unsqueeze(1)
    g = torch.where(valid.unsqueeze(1), g, torch.zeros_like(g))
    return g.to(out_dtype)
