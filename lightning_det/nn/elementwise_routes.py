"""Elementwise functions that ``det_function_mode`` sends to their det versions.

``torch.sin`` / ``torch.cos`` / ``torch.tanh`` / ``torch.sigmoid`` and their ``Tensor`` methods
(``F.tanh`` and ``F.sigmoid`` call those), ``F.gelu`` and ``F.silu``, of a float32, bfloat16 or
float16 tensor -> :func:`~lightning_det.nn.functional.det_sin` / ``det_cos`` / ``det_tanh`` /
``det_sigmoid`` / ``det_gelu`` / ``det_silu``: fp64 detmath rounded once, so the same bytes on
every device, and a gradient that is one fp64 product rounded once (PyTorch's ``tanh_backward``,
``sigmoid_backward`` and ``gelu`` are outside the verified set; its CPU sigmoid, SiLU and
tanh-GELU are even position-dependent). Rotary position embeddings (Llama's ``cos``/``sin`` of
``position * inv_freq``), classification heads (``torch.tanh`` in RoBERTa's), squeeze-excite
gates and functional activations are where models call them. The in-place forms and calls with
``out=`` are left to PyTorch (the op audit reports them).
"""
from __future__ import annotations

import torch

from .attention_routes import NOT_ROUTED
import torch.nn.functional as F

from .functional import det_cos, det_gelu, det_sigmoid, det_silu, det_sin, det_tanh

__all__ = ["DETMATH_FUNCS", "detmath_route"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

_ONE_ARG = {torch.sin: det_sin, torch.Tensor.sin: det_sin, torch.cos: det_cos, torch.Tensor.cos: det_cos,
            torch.tanh: det_tanh, torch.Tensor.tanh: det_tanh, torch.sigmoid: det_sigmoid,
            torch.Tensor.sigmoid: det_sigmoid}

DETMATH_FUNCS = frozenset(_ONE_ARG) | {F.gelu, F.silu}


def _gelu_args(input, approximate="none"):
    return input, approximate


def _silu_args(input, inplace=False):
    return input, inplace


def detmath_route(func, args, kwargs):
    """The det version for one float tensor argument, else NOT_ROUTED."""
    try:
        if func is F.gelu:
            x, approximate = _gelu_args(*args, **kwargs)
            ok = approximate in ("none", "tanh")
            fn = lambda t: det_gelu(t, approximate)  # noqa: E731
        elif func is F.silu:
            x, inplace = _silu_args(*args, **kwargs)
            ok, fn = not inplace, det_silu
        else:
            x = args[0] if len(args) == 1 and not kwargs else kwargs.get("input") if not args and len(kwargs) == 1 \
                else None
            ok, fn = True, _ONE_ARG[func]
    except TypeError:
        return NOT_ROUTED  # PyTorch's own error message
    if not ok or not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        return NOT_ROUTED
    return fn(x)
