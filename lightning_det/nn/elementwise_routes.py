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

__all__ = ["DETMATH_FUNCS", "POW_FUNCS", "det_pow_int", "detmath_route", "pow_route"]

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


POW_FUNCS = frozenset({torch.pow, torch.Tensor.pow})
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def det_pow_int(base: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``base ** exponent`` for a float ``base`` and an integer ``exponent`` tensor (BLOOM's ALiBi
    slopes), broadcast: in fp64 by binary powering, each step an IEEE multiply, a negative exponent
    one IEEE division of 1 by the power, then one rounding to the result dtype (PyTorch's). A fixed
    sequence of correctly rounded operations, so the same bytes at every position and on every
    device; exact wherever the power is representable (powers of two, small integers), else within
    a few fp64 ulps before the one rounding. No gradient (pow_route takes it only without one)."""
    if not isinstance(base, torch.Tensor) or base.dtype not in _FLOATS:
        raise TypeError(f"det_pow_int: base: expected a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(base, 'dtype', type(base).__name__)}")
    if not isinstance(exponent, torch.Tensor) or exponent.dtype not in _INTS:
        raise TypeError(f"det_pow_int: exponent: expected an integer tensor, got "
                        f"{getattr(exponent, 'dtype', type(exponent).__name__)}")
    out_dtype = torch.result_type(base, exponent)
    shape = torch.broadcast_shapes(base.shape, exponent.shape)
    x = base.to(torch.float64).expand(shape)
    e = exponent.to(base.device, torch.int64).expand(shape)
    k = e.abs()
    acc = torch.ones(shape, dtype=torch.float64, device=base.device)
    sq = x.clone()
    top = int(k.max()) if k.numel() else 0
    while top:
        acc = torch.where((k & 1).bool(), acc * sq, acc)
        k = k >> 1
        top >>= 1
        if top:
            sq = sq * sq
    acc = torch.where(e < 0, torch.ones_like(acc) / acc, acc)
    return acc.to(out_dtype)


def _pow_args(input, exponent, *, out=None):
    return input, exponent, out


def pow_route(func, args, kwargs):
    """det_pow_int for a float tensor raised to an integer tensor, neither needing a gradient;
    else NOT_ROUTED (a scalar exponent is PyTorch's own, which the op audit judges)."""
    try:
        base, exponent, out = _pow_args(*args, **kwargs)
    except TypeError:
        return NOT_ROUTED
    if out is not None or not isinstance(base, torch.Tensor) or not isinstance(exponent, torch.Tensor):
        return NOT_ROUTED
    if base.dtype not in _FLOATS or exponent.dtype not in _INTS or (base.device != exponent.device and exponent.dim()):
        return NOT_ROUTED
    if torch.is_grad_enabled() and base.requires_grad:
        return NOT_ROUTED
    return det_pow_int(base, exponent)
