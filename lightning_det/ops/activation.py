"""Elementwise activation kernels (``ldet::act``, ``act_backward``, ``act_fp64``, csrc/detmath.h).

Each element is computed in fp64 from IEEE +, -, *, / and fma only and rounded once to the
input's dtype, so its bytes depend on its own value alone. :mod:`lightning_det.nn.functional`
builds the user-facing ``det_gelu``/``det_silu``/... on :func:`act`, which has an autograd
formula (its gradient is :func:`act_backward`).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._registry import ldet
from .longacc import _check_float

__all__ = ["ACT_KINDS", "act", "act_backward", "act_fp64"]

#: Activation names and the kernel's kind numbers (csrc/detmath.h ActKind).
ACT_KINDS = {"gelu_erf": 0, "gelu_tanh": 1, "silu": 2, "tanh": 3, "exp": 4, "sin": 5, "cos": 6, "sigmoid": 7}


def _kind(kind: str) -> int:
    if kind not in ACT_KINDS:
        raise ValueError(f"kind: expected one of {sorted(ACT_KINDS)}, got {kind!r}")
    return ACT_KINDS[kind]


def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The activation ``kind`` of every element of ``x`` (float32/bfloat16/float16, any shape),
    rounded once to x's dtype; differentiable in x."""
    _check_float(x, "x")
    return ldet().act(x, _kind(kind))


def act_backward(grad: torch.Tensor, x: torch.Tensor, kind: str) -> torch.Tensor:
    """``grad * d act(x) / dx`` per element, computed in fp64 and rounded once to x's dtype.
    ``grad`` has x's shape (the kernel checks it)."""
    return ldet().act_backward(grad.contiguous(), x, _kind(kind))


def act_fp64(x: torch.Tensor, kind: str, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The unrounded fp64 values behind :func:`act` (``grad`` given: behind :func:`act_backward`),
    for tests against the references; x (and grad) float64."""
    return ldet().act_fp64(x, _kind(kind), grad)
