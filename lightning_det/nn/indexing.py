"""Advanced indexing and gathers whose gradient is exact, as model code calls them.

``x[idx]`` with tensor or list indices (a sequence classifier's ``logits[arange(B), last]``, a
boolean mask's ``h[mask]``), ``torch.gather`` / ``Tensor.gather`` (relative position tables) and
``torch.take_along_dim``, of a float tensor that needs a gradient. Under ``det_function_mode``
they come here.

The forward is PyTorch's own selection: no arithmetic. PyTorch's backward adds the output
gradient into zeros with ``index_put(accumulate=True)`` or ``scatter_add``: an element picked
more than once gets its gradients summed in an order set by where they sit in the batch (and on
CUDA by thread timing). Here the gradient of each input element is

    +0                           where no output picked it,
    the one output gradient      where one output picked it (a write: no sum),
    their exact sum, rounded once  where several did (``scatter_sum_digits``),

a function of the picked values alone, on every device and in any batch layout. The input
element each output picked comes from running the same selection on int64 coordinates of the
input (expanded, so no input-sized integer tensor is made).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..ops import det_finalize, scatter_sum_digits
from ..ops.trust import trusted_fn
from .attention_routes import NOT_ROUTED
from .functional import fresh

__all__ = ["INDEX_FUNCS", "det_index", "det_gather", "det_take_along_dim", "index_route"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _picked_positions(shape: torch.Size, device: torch.device, select: Callable) -> torch.Tensor:
    """int64 tensor of the selection's output shape: the row-major position, in a tensor of
    ``shape``, of the element each output element picked. ``select`` is the forward's selection,
    applied to one expanded coordinate tensor per dimension."""
    pos = None
    stride = 1
    for d in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[d] = shape[d]
        coord = select(torch.arange(shape[d], device=device).view(view).expand(shape))
        term = coord if stride == 1 else coord * stride
        pos = term if pos is None else pos + term
        stride *= shape[d]
    if pos is None:  # a 0-d input
        return select(torch.zeros((), dtype=torch.int64, device=device))
    return pos


def _exact_scatter(gy: torch.Tensor, pos: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of a selection: ``gy`` added into zeros of ``shape`` at ``pos``, exactly."""
    g = gy.reshape(-1).to(dtype)
    p = pos.reshape(-1)
    out = torch.zeros(math.prod(shape), dtype=dtype, device=gy.device)
    if p.numel() == 0:
        return out.view(shape)
    uniq, inv = torch.unique(p, sorted=True, return_inverse=True)
    if uniq.numel() == p.numel():  # each element picked at most once: a write
        out[p] = g
    else:
        sums = det_finalize(scatter_sum_digits(g.unsqueeze(1), inv, uniq.numel()), dtype)
        out[uniq] = sums.reshape(-1)
    return out.view(shape)


class _DetSelect(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, select):
        ctx.select, ctx.shape, ctx.dtype = select, x.shape, x.dtype
        return fresh(select(x))

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        pos = _picked_positions(ctx.shape, gy.device, ctx.select)
        return _exact_scatter(gy, pos, ctx.shape, ctx.dtype), None


def _float_with_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in _FLOATS and x.requires_grad and torch.is_grad_enabled()


def _advanced(idx) -> bool:
    """Whether an index holds a tensor or a list, which make ``x[idx]`` advanced indexing."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(p, (torch.Tensor, list)) for p in parts)


def _on_device(idx, device: torch.device):
    """Index tensors on the input's device (a CPU index of a CUDA tensor is legal), lists kept."""
    if isinstance(idx, tuple):
        return tuple(_on_device(p, device) for p in idx)
    if isinstance(idx, torch.Tensor) and idx.device != device:
        return idx.to(device)
    return idx


def det_index(x: torch.Tensor, idx) -> torch.Tensor:
    """``x[idx]`` with an exact gradient (module docstring), for any index PyTorch takes."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"det_index: x: expected a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    idx = _on_device(idx, x.device)
    return _DetSelect.apply(x, lambda t: t[idx])


def _check_gather(name: str, x, index) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"{name}: input: expected a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
        raise TypeError(f"{name}: index: expected an int64 tensor, got {getattr(index, 'dtype', type(index).__name__)}")


def det_gather(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``torch.gather(x, dim, index)`` with an exact gradient (module docstring)."""
    _check_gather("det_gather", x, index)
    return _DetSelect.apply(x, lambda t: torch.gather(t, dim, index))


def det_take_along_dim(x: torch.Tensor, indices: torch.Tensor, dim=None) -> torch.Tensor:
    """``torch.take_along_dim(x, indices, dim)`` with an exact gradient (module docstring)."""
    _check_gather("det_take_along_dim", x, indices)
    return _take(x, indices, dim)


def _take(x, indices, dim):
    if dim is None:  # along the flattened input (a view): its positions are the indices
        return _DetSelect.apply(x.reshape(-1), lambda t: torch.take_along_dim(t, indices))
    return _DetSelect.apply(x, lambda t: torch.take_along_dim(t, indices, dim))


INDEX_FUNCS = frozenset({torch.Tensor.__getitem__, torch.gather, torch.Tensor.gather, torch.take_along_dim,
                         torch.Tensor.take_along_dim})


def _gather_signature(input, dim, index, *, sparse_grad=False, out=None):
    return input, dim, index, sparse_grad, out


def _take_signature(input, indices, dim=None, *, out=None):
    return input, indices, dim, out


def index_route(func, args, kwargs):
    """The exact-gradient selection for a float tensor that needs a gradient, else NOT_ROUTED."""
    if func is torch.Tensor.__getitem__:
        if len(args) != 2 or kwargs or not _float_with_grad(args[0]) or not _advanced(args[1]):
            return NOT_ROUTED
        return det_index(args[0], args[1])
    gather = func in (torch.gather, torch.Tensor.gather)
    try:
        if gather:
            x, dim, index, sparse_grad, out = _gather_signature(*args, **kwargs)
            ok = not sparse_grad and out is None
        else:
            x, index, dim, out = _take_signature(*args, **kwargs)
            ok = out is None
    except TypeError:
        return NOT_ROUTED  # PyTorch's own error message
    if not ok or not _float_with_grad(x) or not isinstance(index, torch.Tensor) or index.dtype != torch.int64:
        return NOT_ROUTED
    return _DetSelect.apply(x, lambda t: torch.gather(t, dim, index)) if gather else _take(x, index, dim)
