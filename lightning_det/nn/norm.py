"""DetLayerNorm and DetRMSNorm: batch-invariant, CPU == CUDA forward; exact weight/bias sums.

The arithmetic, per row of width W (all in fp32; bf16/fp16 inputs are widened exactly):

    mean = round(exact sum_j x_j) / W            (LayerNorm only; true IEEE division)
    d    = x - mean                              (RMSNorm: d = x)
    var  = round(exact sum_j d_j * d_j) / W      (products exact, one rounding)
    rstd = fp32( 1 / sqrt_fp64(fp64(var + eps)) )
    xhat = d * rstd ;  y = xhat * weight + bias  (then rounded to x's dtype)

Row sums come from ``det_row_sums`` (the long accumulator), so they do not depend on the width's
vector/tail split or on other rows; everything else is an elementwise IEEE +, -, *, / or sqrt,
which are correctly rounded on every CPU and GPU. We never use ``torch.rsqrt`` (approximate on
CUDA), nor ``tensor / python_scalar`` (CUDA turns it into a multiply by the reciprocal).

Backward, with g = gy * weight, m1 = round(sum g) / W, m2 = round(sum g * xhat) / W:
    dx = (g - m1 - xhat * m2) * rstd        (RMSNorm: dx = (g - xhat * m2) * rstd)
    dweight = exact sum over all rows of gy * xhat, dbias = exact sum of gy, rounded once, or
    left as digits in digit mode (lightning_det.nn.grad_digits).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ._swap import swap_class

from ..ops import det_finalize
from ..ops.trust import trusted_fn
from .functional import det_col_sums, det_row_sums
from .grad_digits import contribute_grad, digit_mode, note_forward_use

__all__ = ["DetLayerNorm", "DetRMSNorm"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _row_mean(a: torch.Tensor, b: Optional[torch.Tensor], width: torch.Tensor) -> torch.Tensor:
    """round(exact sum_j a*b) / W as an (R, 1) fp32 column; ``width`` is an fp32 tensor."""
    return (det_finalize(det_row_sums(a, b)) / width).unsqueeze(1)


def _rstd(var: torch.Tensor, eps: float) -> torch.Tensor:
    t = (var + torch.full_like(var, eps)).double()
    # fp64 sqrt and division are correctly rounded everywhere (vectorized or not), then one
    # rounding to fp32: a fixed function of var.
    return (torch.ones_like(t) / torch.sqrt(t)).float()


def _grad_or_digits(module, param, acc, digits: bool):
    dtype = param.dtype if param.dtype in _FLOATS else torch.float32
    if digits:
        contribute_grad(module, param, lambda: acc, lambda: det_finalize(acc, dtype).reshape(param.shape))
        return None
    return det_finalize(acc, dtype)


class _DetNormFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, weight, bias, module, width, eps, rms):
        x2 = x.reshape(-1, width).float()
        wt = torch.full((x2.shape[0],), float(width), dtype=torch.float32, device=x.device)
        d = x2 if rms else x2 - _row_mean(x2, None, wt)
        rstd = _rstd(_row_mean(d, d, wt), eps)
        xhat = d * rstd
        y = xhat
        if weight is not None:
            y = y * weight.reshape(1, width).float()
        if bias is not None:
            y = y + bias.reshape(1, width).float()
        ctx.save_for_backward(xhat, rstd, weight, bias)
        ctx.module, ctx.width, ctx.rms, ctx.x_shape, ctx.x_dtype = module, width, rms, x.shape, x.dtype
        return y.to(x.dtype).reshape(x.shape)

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        xhat, rstd, weight, bias = ctx.saved_tensors
        width = ctx.width
        gy2 = gy.reshape(-1, width).float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            wt = torch.full((gy2.shape[0],), float(width), dtype=torch.float32, device=gy.device)
            g = gy2 * weight.reshape(1, width).float() if weight is not None else gy2
            t = xhat * _row_mean(g, xhat, wt)
            if not ctx.rms:
                g = g - _row_mean(g, None, wt)
            gx = ((g - t) * rstd).to(ctx.x_dtype).reshape(ctx.x_shape)
        digits = digit_mode(ctx.module)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = _grad_or_digits(ctx.module, weight, det_col_sums(gy2, xhat), digits)
            gw = None if gw is None else gw.reshape(weight.shape)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = _grad_or_digits(ctx.module, bias, det_col_sums(gy2), digits)
            gb = None if gb is None else gb.reshape(bias.shape)
        return gx, gw, gb, None, None, None, None


def _check_input(module, x: torch.Tensor) -> None:
    shape = tuple(module.normalized_shape)
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"input: expected a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        raise ValueError(f"input: expected trailing dimensions {shape} (normalized_shape), got shape {tuple(x.shape)}")


class DetLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` with a batch-invariant, device-independent forward and exact param grads.

    Args: as ``nn.LayerNorm`` (same parameters and ``state_dict`` keys).

    Shapes: input (..., *normalized_shape), float32/bfloat16/float16; output of the same shape
    and dtype. Row r's output bytes depend only on row r (any width, odd ones included) and are
    the same on CPU and CUDA. dweight/dbias are exact sums over all rows rounded once (or left as
    digits in digit mode). See :mod:`lightning_det.nn.norm` for the arithmetic.
    """

    supports_grad_digits = True

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm) -> "DetLayerNorm":
        """Turns an ``nn.LayerNorm`` into a DetLayerNorm in place, keeping its Parameters."""
        return swap_class(ln, nn.LayerNorm, cls, "ln")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _check_input(self, input)
        width = math.prod(self.normalized_shape)
        note_forward_use(self, self.weight, self.bias)
        return _DetNormFn.apply(input, self.weight, self.bias, self, width, float(self.eps), False)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"


class DetRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with a batch-invariant, device-independent forward and exact weight grads.

    Args: as ``nn.RMSNorm``; ``eps=None`` means ``torch.finfo(input.dtype).eps`` as in PyTorch.

    Shapes: input (..., *normalized_shape), float32/bfloat16/float16; output of the same shape
    and dtype. Same guarantees as :class:`DetLayerNorm`.
    """

    supports_grad_digits = True

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm) -> "DetRMSNorm":
        """Turns an ``nn.RMSNorm`` into a DetRMSNorm in place, keeping its Parameters."""
        return swap_class(norm, nn.RMSNorm, cls, "norm")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _check_input(self, input)
        width = math.prod(self.normalized_shape)
        eps = torch.finfo(input.dtype).eps if self.eps is None else float(self.eps)
        note_forward_use(self, self.weight)
        return _DetNormFn.apply(input, self.weight, None, self, width, eps, True)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"
