"""Elementwise functions that ``det_function_mode`` sends to their det versions.

``torch.sin`` / ``torch.cos`` / ``Tensor.sin`` / ``Tensor.cos`` of a float32, bfloat16 or
float16 tensor -> :func:`~lightning_det.nn.functional.det_sin` / ``det_cos``: fp64 detmath
rounded once, so the same bytes on every device. PyTorch's own sin and cos are invariant on one
device but differ between CPU and CUDA; rotary position embeddings (Llama's ``cos``/``sin`` of
``position * inv_freq``) are where models call them. The in-place forms and calls with ``out=``
are left to PyTorch (the op audit reports them).
"""
from __future__ import annotations

import torch

from .attention_routes import NOT_ROUTED
from .functional import det_cos, det_sin

__all__ = ["TRIG_FUNCS", "trig_route"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

TRIG_FUNCS = {torch.sin: det_sin, torch.Tensor.sin: det_sin, torch.cos: det_cos, torch.Tensor.cos: det_cos}


def trig_route(func, args, kwargs):
    """det_sin / det_cos for one float tensor argument, else NOT_ROUTED."""
    x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 else None
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        return NOT_ROUTED
    return TRIG_FUNCS[func](x)
