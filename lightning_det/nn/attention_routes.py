"""How det_function_mode sends the hand-written attention of library code (Hugging Face's "eager"
attention) to exact versions; ``F.scaled_dot_product_attention`` goes to
:func:`~lightning_det.nn.det_scaled_dot_product_attention` (``enable_gqa`` included).

- ``torch.matmul`` / ``@`` / ``torch.bmm`` / ``torch.mm`` of two float activations (at least 2-D,
  neither a leaf tensor that requires grad nor a view of one, i.e. not a Parameter or its
  transpose) -> :func:`det_matmul`. A product
  with a Parameter is left to PyTorch: its gradient would cross the batch outside the exact
  modules, and the op audit names it in its module.
- ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` with an explicit ``dim`` -> :func:`det_softmax`.
"""
from __future__ import annotations

import torch

from .matmul import det_matmul, det_softmax

__all__ = ["BADDBMM_FUNCS", "MATMUL_FUNCS", "SOFTMAX_FUNCS", "baddbmm_route", "matmul_route", "softmax_route",
           "NOT_ROUTED"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

NOT_ROUTED = object()

MATMUL_FUNCS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                          torch.bmm, torch.Tensor.bmm, torch.mm, torch.Tensor.mm})
SOFTMAX_FUNCS = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax})
BADDBMM_FUNCS = frozenset({torch.baddbmm, torch.Tensor.baddbmm})


def _activation(t) -> bool:
    if not (isinstance(t, torch.Tensor) and t.dtype in _FLOATS and t.dim() >= 2):
        return False
    base = t._base if t._is_view() else t  # a view of a Parameter (weight.t()) is the Parameter
    return not (base.is_leaf and base.requires_grad)


def matmul_route(func, args, kwargs, plans):
    """det_matmul for a product of two float activations, else NOT_ROUTED."""
    if kwargs.get("out") is not None or len(args) != 2:
        return NOT_ROUTED
    a, b = args
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    if not (_activation(a) and _activation(b)) or a.dtype != b.dtype or a.device != b.device:
        return NOT_ROUTED
    if func in (torch.bmm, torch.Tensor.bmm) and (a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]):
        return NOT_ROUTED  # PyTorch's own error message
    if func in (torch.mm, torch.Tensor.mm) and (a.dim() != 2 or b.dim() != 2):
        return NOT_ROUTED
    return det_matmul(a, b, plans=plans)


def _baddbmm_args(input, batch1, batch2, *, beta=1, alpha=1, out=None):
    return input, batch1, batch2, beta, alpha, out


def baddbmm_route(func, args, kwargs, plans):
    """``beta * input + alpha * (batch1 @ batch2)`` (BLOOM's ALiBi scores) with the product an exact
    det_matmul rounded once, then ``alpha *`` and ``beta *`` (each skipped where 1) and the sum as
    separate IEEE operations in the operands' dtype; with ``beta == 0`` the input is ignored, as
    PyTorch's. NOT_ROUTED where the input needs a gradient (a broadcast add here would sum it over
    the batch in floating point), for ``out=``, or operands det_matmul does not take."""
    try:
        inp, b1, b2, beta, alpha, out = _baddbmm_args(*args, **kwargs)
    except TypeError:
        return NOT_ROUTED  # PyTorch's own error message
    if out is not None or not isinstance(inp, torch.Tensor) or (inp.requires_grad and torch.is_grad_enabled()):
        return NOT_ROUTED
    if isinstance(beta, torch.Tensor) or isinstance(alpha, torch.Tensor):
        return NOT_ROUTED
    if not (_activation(b1) and _activation(b2)) or b1.dim() != 3 or b2.dim() != 3 or b1.shape[0] != b2.shape[0] \
            or b1.dtype != b2.dtype or b1.device != b2.device or inp.dtype != b1.dtype or inp.device != b1.device:
        return NOT_ROUTED
    try:
        torch.broadcast_shapes(inp.shape, (b1.shape[0], b1.shape[1], b2.shape[2]))
    except RuntimeError:
        return NOT_ROUTED
    prod = det_matmul(b1, b2, plans=plans)
    if alpha != 1:
        prod = prod * alpha
    if beta == 0:
        return prod
    return prod + (inp if beta == 1 else inp * beta)


def softmax_route(func, args, kwargs):
    """det_softmax for a float softmax with an explicit dim, else NOT_ROUTED."""
    kwargs = dict(kwargs)
    kwargs.pop("_stacklevel", None)
    x = args[0] if args else kwargs.pop("input", None)
    rest = list(args[1:])
    if func is torch.nn.functional.softmax and len(rest) >= 2:  # F.softmax(input, dim, _stacklevel, dtype)
        rest.pop(1)
    dim = rest[0] if rest else kwargs.pop("dim", None)
    dtype = rest[1] if len(rest) > 1 else kwargs.pop("dtype", None)
    if kwargs or not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS or not isinstance(dim, int) \
            or x.dim() == 0 or (dtype is not None and dtype not in _FLOATS):
        return NOT_ROUTED
    return det_softmax(x, dim, dtype=dtype)
