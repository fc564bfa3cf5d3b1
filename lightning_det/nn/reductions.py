"""Exact sums, means and cumulative sums over a sample's own dimensions, as model code calls them.

``torch.sum`` / ``torch.mean`` / ``torch.cumsum`` and their ``Tensor`` methods, of a float tensor
over explicit dimensions that leave dimension 0 (the batch) alone: ConvNext's global average pool
``x.mean([-2, -1])``, a sentence embedding's ``h.mean(1)``, a masked ``(h * m).sum(1)``, OPT's
position ids ``torch.cumsum(mask, dim=1)`` of a float mask. Under ``det_function_mode`` they come
here:

    sum    = the exact sum over the reduced dimensions, rounded once to the output dtype
    mean   = round_fp32(exact sum) / n (an IEEE division, div_by_count), then to the output dtype
    cumsum = each exact prefix sum rounded once (the elements' digits, cumulated in int64)

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

from ..ops import det_finalize, to_digits
from ..ops.sums import det_row_sums
from ..ops.trust import trusted_fn
from .attention_routes import NOT_ROUTED
from .functional import div_by_count, fresh

__all__ = ["REDUCTION_FUNCS", "CUMSUM_FUNCS", "det_sum", "det_mean", "det_cumsum", "reduction_route", "cumsum_route"]

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
        return fresh(y)  # not a view made in here: in-place ops on the output work

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


# Cumulated digits stay inside int64 and the status counters below 2^21 for fewer terms than this
# (csrc/longacc.h: canonical digits below 2^32, the top one within 2^41 in magnitude).
_CUMSUM_MAX = (1 << 21) - 1


def _exact_cumsum(x: torch.Tensor, dim: int, dtype: torch.dtype, reverse: bool = False) -> torch.Tensor:
    d = to_digits(x)
    if reverse:
        return det_finalize(torch.cumsum(d.flip(dim), dim).flip(dim), dtype)
    return det_finalize(torch.cumsum(d, dim), dtype)


class _DetCumsum(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, dim, out_dtype):
        ctx.dim, ctx.x_dtype = dim, x.dtype
        return _exact_cumsum(x, dim, out_dtype)

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        gy = gy if gy.dtype in _FLOATS else gy.float()
        return _exact_cumsum(gy, ctx.dim, ctx.x_dtype, reverse=True), None, None


def _cumsum(x, dim, dtype):
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or x.dim() < 2:
        return NOT_ROUTED
    if dtype is not None and dtype not in _FLOATS:
        return NOT_ROUTED
    dims = _dims(x, dim) if isinstance(dim, int) and not isinstance(dim, bool) else None
    if dims is None or x.shape[dims[0]] > _CUMSUM_MAX:
        return NOT_ROUTED
    return _DetCumsum.apply(x, dims[0], dtype or x.dtype)


def det_cumsum(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.cumsum(x, dim, dtype=dtype)`` exactly: every prefix sum rounded once (module
    docstring), for a float tensor and a dim other than 0 of fewer than 2^21 elements. The
    gradient is the reversed cumulative sum of the output gradient, exact in the same way."""
    out = _cumsum(x, dim, dtype)
    if out is NOT_ROUTED:
        raise ValueError(f"det_cumsum: expected a float tensor of at least 2 dims and an int dim other than 0 "
                         f"of fewer than 2^21 elements, got {getattr(x, 'dtype', type(x))} of shape "
                         f"{tuple(getattr(x, 'shape', ()))} and dim={dim!r}")
    return out


CUMSUM_FUNCS = frozenset({torch.cumsum, torch.Tensor.cumsum})


def _cumsum_signature(input, dim, *, dtype=None, out=None):
    return input, dim, dtype, out


def cumsum_route(func, args, kwargs):
    """det_cumsum for a per-sample float cumulative sum, else NOT_ROUTED."""
    try:
        x, dim, dtype, out = _cumsum_signature(*args, **kwargs)
    except TypeError:
        return NOT_ROUTED
    return NOT_ROUTED if out is not None else _cumsum(x, dim, dtype)
