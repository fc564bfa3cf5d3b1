"""How det_function_mode sends the attention calls of library code (Hugging Face eager and sdpa
attention, hand-written attention) to exact versions.

- ``torch.matmul`` / ``@`` / ``torch.bmm`` / ``torch.mm`` of two float activations (at least 2-D,
  neither a leaf tensor that requires grad nor a view of one, i.e. not a Parameter or its
  transpose) -> :func:`det_matmul`. A product
  with a Parameter is left to PyTorch: its gradient would cross the batch outside the exact
  modules, and the op audit names it in its module.
- ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` with an explicit ``dim`` -> :func:`det_softmax`.
- ``F.scaled_dot_product_attention(..., enable_gqa=True)``: the query heads of a group attend the
  same key/value head, so they are stacked as rows of one (g * Lq, E) slice per key/value head;
  rows are computed independently (det attention is row-invariant), so each is the bytes of its
  own head's attention, and dK, dV are exact sums over the group's heads, rounded once.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention import det_scaled_dot_product_attention
from .matmul import det_matmul, det_softmax

__all__ = ["MATMUL_FUNCS", "SOFTMAX_FUNCS", "matmul_route", "softmax_route", "det_sdpa_gqa", "NOT_ROUTED"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

NOT_ROUTED = object()

MATMUL_FUNCS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                          torch.bmm, torch.Tensor.bmm, torch.mm, torch.Tensor.mm})
SOFTMAX_FUNCS = frozenset({torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax})


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


def det_sdpa_gqa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, *, plans="default", dropout_key=None):
    """det_scaled_dot_product_attention with ``F.scaled_dot_product_attention``'s ``enable_gqa``."""
    if not enable_gqa or query.dim() < 3 or key.dim() < 3 or query.shape[-3] == key.shape[-3]:
        return det_scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                is_causal=is_causal, scale=scale, plans=plans, dropout_key=dropout_key)
    h, hkv = query.shape[-3], key.shape[-3]
    if h % hkv or value.shape[-3] != hkv:
        raise ValueError(f"key, value: with enable_gqa the query heads ({h}) must be a multiple of the key/value "
                         f"heads, got key {tuple(key.shape)} and value {tuple(value.shape)}")
    lead, (lq, e), lk = tuple(query.shape[:-3]), query.shape[-2:], key.shape[-2]
    g = h // hkv
    mask: Optional[torch.Tensor] = None
    if is_causal:
        if attn_mask is not None:
            raise ValueError("attn_mask: expected None when is_causal=True (as F.scaled_dot_product_attention)")
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()
    elif attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a tensor or None, got {type(attn_mask).__name__}")
        mask = attn_mask
    if mask is not None:
        try:
            mask = mask.expand(*lead, h, lq, lk)
        except RuntimeError as err:
            raise ValueError(f"attn_mask: expected a shape broadcastable to {(*lead, h, lq, lk)}, "
                             f"got {tuple(mask.shape)}") from err
        mask = mask.reshape(*lead, hkv, g * lq, lk)
    out = det_scaled_dot_product_attention(query.reshape(*lead, hkv, g * lq, e), key, value, attn_mask=mask,
                                           dropout_p=dropout_p, scale=scale, plans=plans, dropout_key=dropout_key)
    return out.reshape(*lead, h, lq, value.shape[-1])
