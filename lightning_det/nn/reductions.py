"""Exact sums and means over a sample's own dimensions, as model code calls them.

``torch.sum`` / ``torch.mean`` / ``Tensor.sum`` / ``Tensor.mean`` of a float tensor over
explicit dimensions that leave dimension 0 (the batch) alone: ConvNext's global average pool
``x.mean([-2, -1])``, a sentence embedding's ``h.mean(1)``, a masked ``(h * m).sum(1)``. Under
``det_function_mode`` they come here:

    sum  = the exact sum over the reduced dimensions, rounded once to the output dtype
    mean = round_fp32(exact sum) / n (an IEEE division, div_by_count), then to the output dtype

Each output element depends on its own row alone (the long accumulator's row sums), so on the
sample alone, in any batch size, thread count or device. Backward: the output gradient
broadcast back (divided by n for the mean): elementwise. A reduction over dimension 0, or over
every dimension (``x.sum()``, a loss's ``mean()``), crosses the batch: it is left to PyTorch and
to the op audit (``lightning_det.global_mean`` reduces a loss exactly).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from ..ops import det_finalize
from ..ops.sums import det_row_sums
from ..ops.trust import trusted_fn
from .attention_routes import NOT_ROUTED
from .functional import div_by_count

__all__ = ["REDUCTION_FUNCS", "det_sum", "det_mean", "reduction_route"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _DetReduce(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, dims, keepdim, mean, out_dtype):
        keep = [d for d in range(x.dim()) if d not in dims]
        rows = x.permute(*keep, *dims).reshape(-1, math.prod(x.shape[d] for d in dims) if dims else 1)
        n = rows.shape[1]
        if mean:
            y = div_by_count(det_finalize(det_row_sums(rows)), n).to(out_dtype)
        else:
            y = det_finalize(det_row_sums(rows), out_dtype)
        shape = [x.shape[d] for d in keep]
        ctx.dims, ctx.n, ctx.mean, ctx.x_shape, ctx.x_dtype = dims, n, mean, x.shape, x.dtype
        y = y.reshape(shape)
        if keepdim:
            for d in dims:
                y = y.unsqueeze(d)
        return y

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        g = gy
        if gy.dim() != len(ctx.x_shape):  # keepdim False: put the reduced dims back as size 1
            for d in ctx.dims:
                g = g.unsqueeze(d)
        if ctx.mean:
            g = div_by_count(g, ctx.n)
        return g.to(ctx.x_dtype).expand(ctx.x_shape), None, None, None, None


def _dims(x: torch.Tensor, dim) -> Optional[tuple]:
    """Sorted, normalized reduced dims, or None when the call is not a per-sample reduction."""
    if isinstance(dim, int):
        dim = (dim,)
    if not isinstance(dim, Sequence) or isinstance(dim, str) or len(dim) == 0 \
            or not all(isinstance(d, int) and not isinstance(d, bool) for d in dim):
        return None
    nd = x.dim()
    if not all(-nd <= d < nd for d in dim):
        return None  # PyTorch's own error message
    dims = tuple(sorted({d % nd for d in dim}))
    return None if 0 in dims or len(dims) != len(dim) else dims


def _reduce(x, dim, keepdim, dtype, mean: bool):
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() < 2 or isinstance(keepdim, torch.Tensor):
        return NOT_ROUTED
    if dtype is not None and dtype not in _FLOATS:
        return NOT_ROUTED
    dims = _dims(x, dim)
    if dims is None:
        return NOT_ROUTED
    return _DetReduce.apply(x, dims, bool(keepdim), mean, dtype or x.dtype)


def _checked(x, dim, keepdim, dtype, mean: bool, name: str) -> torch.Tensor:
    out = _reduce(x, dim, keepdim, dtype, mean)
    if out is NOT_ROUTED:
        raise ValueError(f"{name}: expected a float tensor of at least 2 dims and dims leaving dimension 0, got "
                         f"{getattr(x, 'dtype', type(x))} of shape {tuple(getattr(x, 'shape', ()))} and dim={dim!r}")
    return out


def det_sum(x: torch.Tensor, dim, keepdim: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x.sum(dim, keepdim, dtype)`` exactly (module docstring), for dims that leave dimension 0."""
    return _checked(x, dim, keepdim, dtype, False, "det_sum")


def det_mean(x: torch.Tensor, dim, keepdim: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x.mean(dim, keepdim, dtype)`` exactly (module docstring), for dims that leave dimension 0."""
    return _checked(x, dim, keepdim, dtype, True, "det_mean")


REDUCTION_FUNCS = {torch.sum: False, torch.Tensor.sum: False, torch.mean: True, torch.Tensor.mean: True}


def _signature(input, dim=None, keepdim=False, *, dtype=None, out=None):
    return input, dim, keepdim, dtype, out


def reduction_route(func, args, kwargs):
    """det_sum / det_mean for a per-sample float reduction, else NOT_ROUTED."""
    try:
        x, dim, keepdim, dtype, out = _signature(*args, **kwargs)
    except TypeError:
        return NOT_ROUTED
    if out is not None or dim is None:
        return NOT_ROUTED
    return _reduce(x, dim, keepdim, dtype, REDUCTION_FUNCS[func])
