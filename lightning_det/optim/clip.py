"""Exact global gradient-norm clipping: invariant to world size and parameter order."""
from __future__ import annotations

import math
from typing import Iterable

import torch

from ..ops import det_combine, det_finalize, det_gemm_partial
from ..ops.trust import trusted

__all__ = ["clip_grad_norm_exact_", "grad_norm_exact"]


def grad_norm_exact(params: Iterable[torch.Tensor]) -> float:
    """sqrt(sum of g^2 over every gradient element), the sum exact and rounded once to fp32.

    Each square is exact in the long accumulator (a 1 x n by 1 x n exact GEMM), the partial sums
    of all parameters combine exactly (any order), the total is rounded once to fp32 and the
    square root is taken in fp64 and rounded to fp32 (sqrt's double rounding is innocuous).
    """
    with trusted():
        accs = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            flat = g.detach().reshape(1, -1)
            accs.append(det_gemm_partial(flat, flat).reshape(1, -1).cpu())
        if not accs:
            return 0.0
        total = det_finalize(det_combine(accs), torch.float32).item()
    return float(torch.tensor(math.sqrt(total), dtype=torch.float32).item())


def clip_grad_norm_exact_(params: Iterable[torch.Tensor], max_norm: float, eps: float = 1e-6) -> float:
    """In-place clipping like ``torch.nn.utils.clip_grad_norm_`` (norm type 2), exactly.

    Args:
        params: parameters whose ``.grad`` to clip (already reduced across ranks).
        max_norm: the maximum global norm.

    The coefficient ``max_norm / (norm + eps)`` is formed in Python (fp64) and rounded once to
    fp32, then each gradient is multiplied by it (one correctly rounded multiply per element),
    so every device and world size gives the same bytes. Returns the norm before clipping.
    """
    params = [p for p in params if p.grad is not None]
    norm = grad_norm_exact(params)
    coef = float(torch.tensor(max_norm / (norm + eps), dtype=torch.float32).item())
    if coef < 1.0:
        with torch.no_grad(), trusted():
            for p in params:
                p.grad.mul_(coef)
    return norm
