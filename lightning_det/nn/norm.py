"""DetLayerNorm and DetRMSNorm: batch-invariant, CPU == CUDA forward; exact weight/bias sums.

The arithmetic, per row of width W (all in fp32; bf16/fp16 inputs are widened exactly):

    mean = round(exact sum_j x_j) / W            (LayerNorm only; true IEEE division)
    d    = x - mean                              (RMSNorm: d = x)
    var  = round(exact sum_j d_j * d_j) / W      (products exact, one rounding)
    rstd = fp32( 1 / sqrt_fp64(fp64(var + eps)) )
    xhat = d * rstd ;  y = xhat * weight + bias  (then rounded to x's dtype)

Row sums are exact (the long accumulator), so they do not depend on the width's vector/tail
split or on other rows; everything else is an elementwise IEEE +, -, *, / or sqrt, which are
correctly rounded on every CPU and GPU (never an approximate rsqrt, never a multiply by a
reciprocal in place of a division). Forward and input gradient are one compiled op each
(``ldet::norm_forward`` / ``ldet::norm_backward``, csrc/norm.h): the same steps as eager PyTorch
ops around ``det_row_sums`` were ~24 ops a forward and ~18 a backward, each with its dispatch,
allocation and launch, in a det_ddp step bound by its host time.
``lightning_det.reference.norm_ref`` is the plain-Python reference the tests hold them to.

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
from ..ops.norm import norm_backward, norm_forward
from ..ops.trust import trusted_fn
from .functional import det_col_sums
from .step_state import StepState

__all__ = ["DetLayerNorm", "DetRMSNorm"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _grad_or_digits(state: Optional[StepState], param, acc):
    dtype = param.dtype if param.dtype in _FLOATS else torch.float32
    if state is not None:
        state.contribute(param, lambda: acc, lambda: det_finalize(acc, dtype).reshape(param.shape))
        return None
    return det_finalize(acc, dtype)


def _kernel_weight(weight, width: int, offset: float):
    """The weight the kernels multiply by, fp32: ``weight`` or ``offset + weight`` (Gemma's RMSNorm
    scales by ``1 + weight``); d(offset + w)/dw = 1, so dweight is the same exact column sum."""
    if weight is None:
        return None
    w = weight.reshape(width).float()
    return w if offset == 0.0 else offset + w


class _DetNormFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, weight, bias, state, width, eps, rms, offset=0.0):
        w = _kernel_weight(weight, width, offset)
        b = None if bias is None else bias.reshape(width).float()
        # x (rows, width) and y 2-D: y is a fresh tensor, never a view made in here, so in-place
        # ops on the module's output work as on nn.LayerNorm's
        y, xhat, rstd = norm_forward(x, w, b, eps, rms)
        ctx.save_for_backward(xhat, rstd, weight, bias)
        # the state keys gradients by the Parameter objects themselves
        ctx.params = (weight, bias) if state is not None else None
        ctx.state, ctx.width, ctx.rms, ctx.x_shape, ctx.x_dtype = state, width, rms, x.shape, x.dtype
        ctx.offset = offset
        return y

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        xhat, rstd, weight, bias = ctx.saved_tensors
        if ctx.params is not None:
            weight, bias = ctx.params
        width = ctx.width
        gy2 = gy.reshape(-1, width)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            w = _kernel_weight(weight, width, ctx.offset)
            gx = norm_backward(gy2, xhat, rstd, w, ctx.rms, ctx.x_dtype).reshape(ctx.x_shape)
        want_w = weight is not None and ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        if want_w or want_b:
            gy2 = gy2.float()  # the column sums' operands, as the forward's xhat: fp32
        if want_w:
            gw = _grad_or_digits(ctx.state, weight, det_col_sums(gy2, xhat))
            gw = None if gw is None else gw.reshape(weight.shape)
        if want_b:
            gb = _grad_or_digits(ctx.state, bias, det_col_sums(gy2))
            gb = None if gb is None else gb.reshape(bias.shape)
        return gx, gw, gb, None, None, None, None, None


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
    step_state: Optional[StepState] = None  # set by set_grad_digits

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm) -> "DetLayerNorm":
        """Turns an ``nn.LayerNorm`` into a DetLayerNorm in place, keeping its Parameters."""
        return swap_class(ln, nn.LayerNorm, cls, "ln")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _check_input(self, input)
        width = math.prod(self.normalized_shape)
        state = self.step_state
        if state is not None:
            state.note_forward_use(self.weight, self.bias)
        y = _DetNormFn.apply(input.reshape(-1, width), self.weight, self.bias, state, width, float(self.eps), False)
        return y.reshape(input.shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"


class DetRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with a batch-invariant, device-independent forward and exact weight grads.

    Args: as ``nn.RMSNorm``; ``eps=None`` means ``torch.finfo(input.dtype).eps`` as in PyTorch.
    ``weight_offset`` (an attribute, default 0.0): the output is ``xhat * (weight_offset +
    weight)``, one fp32 add before the kernels; det_transform sets 1.0 for Gemma-style RMSNorms,
    whose parameter is stored as ``weight - 1``.

    Shapes: input (..., *normalized_shape), float32/bfloat16/float16; output of the same shape
    and dtype. Same guarantees as :class:`DetLayerNorm`.
    """

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits
    weight_offset = 0.0

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm) -> "DetRMSNorm":
        """Turns an ``nn.RMSNorm`` into a DetRMSNorm in place, keeping its Parameters."""
        return swap_class(norm, nn.RMSNorm, cls, "norm")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _check_input(self, input)
        width = math.prod(self.normalized_shape)
        eps = torch.finfo(input.dtype).eps if self.eps is None else float(self.eps)
        state = self.step_state
        if state is not None:
            state.note_forward_use(self.weight)
        y = _DetNormFn.apply(input.reshape(-1, width), self.weight, None, state, width, eps, True,
                             float(self.weight_offset))
        return y.reshape(input.shape)

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset else ""
        return super().extra_repr() + offset + ", exact=True"
