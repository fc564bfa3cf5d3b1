"""Exact batched products and softmax of activations, as attention code written by hand calls them.

Hugging Face's "eager" attention (and much user code) computes ``torch.matmul(q, k.transpose(2, 3))``,
``F.softmax(scores, dim=-1)`` and ``torch.matmul(probs, v)`` on activations. Under
``det_function_mode`` (det_ddp) those calls come here:

- :func:`det_matmul` ``(a, b)``: ``a @ b`` for ``a`` (..., M, K) and ``b`` (..., K, N), leading
  dims broadcast. Every output element is the exact sum of its K products, rounded once to the
  inputs' dtype (``det_bmm``: each (batch) slice is its own exact GEMM, so a slice's bytes do not
  depend on the other slices computed with it). Backward: ``da = g @ b^T`` and ``db = a^T @ g``, each exact and
  rounded once per slice. Broadcast leading dims are expanded before the exact product, so the
  gradient of a broadcast operand is summed over them by autograd (the op audit sees that sum).
- :func:`det_softmax` ``(x, dim, dtype=None)``: per row along ``dim``, in fp32 (bf16/fp16 widened
  exactly): ``m = max``, ``e = det_exp(x - m)``, ``p = e / round(exact sum e)`` (an IEEE
  division, in fp64 then rounded once to the output dtype; for fp32 output that is the fp32
  division's bits). Backward: ``dx = p * (g - round(exact sum p * g))``, in fp32, rounded to x's
  dtype.

A row's result depends only on that row: not on the batch size, the heads, the thread count.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops import det_bmm, det_finalize
from ..ops.trust import trusted_fn
from .functional import det_exp, det_row_sums

__all__ = ["det_matmul", "det_softmax"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _DetBmm(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, a, b, plans):  # a (N, M, K), b (N, K, P)
        ctx.save_for_backward(a, b)
        ctx.plans = plans
        return det_bmm(a, b.transpose(1, 2), out_dtype=a.dtype, plans=plans)

    @staticmethod
    @trusted_fn
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            da = det_bmm(g, b, out_dtype=a.dtype, plans=ctx.plans)  # g[i] @ b[i]^T
        if ctx.needs_input_grad[1]:
            db = det_bmm(a.transpose(1, 2), g.transpose(1, 2), out_dtype=b.dtype, plans=ctx.plans)  # a[i]^T @ g[i]
        return da, db, None


def _check_float(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")


def det_matmul(a: torch.Tensor, b: torch.Tensor, *, plans="default") -> torch.Tensor:
    """Exact ``torch.matmul(a, b)`` for a (..., M, K) and b (..., K, N), both at least 2-D.

    Args:
        a, b: float32, bfloat16 or float16 of one dtype and device; leading dims broadcast.
        plans: how the exact GEMMs plan their integer slices, as :func:`lightning_det.ops.det_gemm`'s.

    Returns:
        (*broadcast leading dims, M, N) of the inputs' dtype: each element the exact sum of its K
        products, rounded once.
    """
    _check_float(a, "a")
    _check_float(b, "b")
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"a, b: det_matmul expects at least 2-D operands, got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    if b.dtype != a.dtype or b.device != a.device:
        raise ValueError(f"b: expected dtype {a.dtype} on {a.device} like a, got {b.dtype} on {b.device}")
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k2 != k:
        raise ValueError(f"b: expected shape (..., {k}, N) to match a's last dimension, got {tuple(b.shape)}")
    try:
        lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError as err:
        raise ValueError(f"a, b: leading dims {tuple(a.shape[:-2])} and {tuple(b.shape[:-2])} "
                         "do not broadcast") from err
    if tuple(a.shape[:-2]) != tuple(lead):
        a = a.expand(*lead, m, k)
    if tuple(b.shape[:-2]) != tuple(lead):
        b = b.expand(*lead, k, n)
    count = 1
    for d in lead:
        count *= d
    out = _DetBmm.apply(a.reshape(count, m, k), b.reshape(count, k, n), plans)
    return out.reshape(*lead, m, n)


def _row_sums(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """round(exact sum over the last dim of a (* b)): (R, W) fp32 -> (R, 1) fp32."""
    return det_finalize(det_row_sums(a, b)).reshape(-1, 1)


class _DetSoftmax(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x2, out_dtype):  # x2 (R, W), softmax over W
        xf = x2.float()  # exact widening
        e = det_exp(xf - xf.amax(dim=1, keepdim=True))
        s = _row_sums(e)
        p = (e / s) if out_dtype == torch.float32 else (e.double() / s.double()).to(out_dtype)
        ctx.save_for_backward(p)
        ctx.in_dtype = x2.dtype
        return p

    @staticmethod
    @trusted_fn
    def backward(ctx, g):
        (p,) = ctx.saved_tensors
        pf, gf = p.float(), g.float()
        return (pf * (gf - _row_sums(pf, gf))).to(ctx.in_dtype), None


def det_softmax(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Exact-sum ``F.softmax(x, dim, dtype=dtype)`` (see the module docstring).

    Args:
        x: float32, bfloat16 or float16, any shape with at least one dimension.
        dim: the dimension normalized over (required: PyTorch's implicit choice is deprecated).
        dtype: the output dtype (float32, bfloat16 or float16); default x's. As PyTorch, x is cast
            to it first (a widening is exact; a narrowing rounds x once).
    """
    _check_float(x, "x")
    if dtype is not None and dtype not in _FLOATS:
        raise TypeError(f"dtype: expected float32, bfloat16, float16 or None, got {dtype}")
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"dim: expected an int, got {dim!r}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension, got a 0-d tensor")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected a dimension of x's shape {tuple(x.shape)}, got {dim}")
    if dtype is not None and dtype != x.dtype:
        x = x.to(dtype)
    moved = x.movedim(dim, -1)
    rows = 1
    for d in moved.shape[:-1]:
        rows *= d
    p = _DetSoftmax.apply(moved.reshape(rows, moved.shape[-1]), x.dtype)
    return p.reshape(moved.shape).movedim(-1, dim)
