"""Elementwise functions that ``det_function_mode`` sends to their det versions.

``torch.sin`` / ``torch.cos`` / ``torch.tanh`` and their ``Tensor`` methods (``F.tanh`` calls
``Tensor.tanh``) of a float32, bfloat16 or float16 tensor -> :func:`~lightning_det.nn.functional.det_sin`
/ ``det_cos`` / ``det_tanh``: fp64 detmath rounded once, so the same bytes on every device, and
a gradient that is one fp64 product rounded once (PyTorch's ``tanh_backward`` is outside the
verified set). PyTorch's own versions are invariant on one device but differ between CPU and
CUDA; rotary position embeddings (Llama's ``cos``/``sin`` of ``position * inv_freq``) and
classification heads (``torch.tanh`` in RoBERTa's) are where models call them. The in-place forms
and calls with ``out=`` are left to PyTorch (the op audit reports them).
"""
from __future__ import annotations

import torch

from .attention_routes import NOT_ROUTED
from .functional import det_cos, det_sin, det_tanh

__all__ = ["DETMATH_FUNCS", "detmath_route"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

DETMATH_FUNCS = {torch.sin: det_sin, torch.Tensor.sin: det_sin, torch.cos: det_cos, torch.Tensor.cos: det_cos,
                 torch.tanh: det_tanh, torch.Tensor.tanh: det_tanh}


def detmath_route(func, args, kwargs):
    """The det version for one float tensor argument, else NOT_ROUTED."""
    x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 else None
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        return NOT_ROUTED
    return DETMATH_FUNCS[func](x)
