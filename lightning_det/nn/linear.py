"""DetLinear: nn.Linear whose forward and backward are exact long-accumulator GEMMs."""
from __future__ import annotations

import torch
from torch import nn

from ._swap import swap_class

from ..ops import det_finalize, det_gemm, det_gemm_partial
from ..ops.trust import trusted
from .functional import det_col_sums
from .grad_digits import contribute_grad, digit_mode, note_forward_use

__all__ = ["DetLinear"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _out_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in _FLOATS else torch.float32


class _DetLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        with trusted():
            return _DetLinearFn._forward(ctx, x, weight, bias, module)

    @staticmethod
    def backward(ctx, gy):
        with trusted():
            return _DetLinearFn._backward(ctx, gy)

    @staticmethod
    def _forward(ctx, x, weight, bias, module):
        x2 = x.reshape(-1, x.shape[-1])
        # the bias enters the accumulator: one rounding for x @ W.T + b
        y = det_gemm(x2, weight, bias, out_dtype=_out_dtype(x))
        ctx.save_for_backward(x2, weight)
        ctx.module = module
        ctx.has_bias = bias is not None
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def _backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        g2 = gy.reshape(-1, weight.shape[0])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            # dX[m, k] = sum_n dY[m, n] W[n, k]: exact, rounded once to x's dtype
            gx = det_gemm(g2, weight.t(), out_dtype=_out_dtype(x2)).reshape(ctx.x_shape)
        want_w = ctx.needs_input_grad[1]
        want_b = ctx.has_bias and ctx.needs_input_grad[2]
        g2t = g2.t()
        # db[n] = sum_m dY[m, n]: exact column sums (no GEMM against a row of ones: that took the
        # slice route's plan, its host synchronization and an int8 GEMM 8 columns wide)
        if digit_mode(ctx.module):
            # unrounded sums over every batch row, left for the owner of the step to round once
            # (or, when this is provably the only contribution, rounded here: grad_digits)
            module = ctx.module
            if want_w:
                contribute_grad(module, module.weight, lambda: det_gemm_partial(g2t, x2.t()),
                                lambda: det_gemm(g2t, x2.t(), out_dtype=weight.dtype))
            if want_b:
                contribute_grad(module, module.bias, lambda: det_col_sums(g2),
                                lambda: det_finalize(det_col_sums(g2), module.bias.dtype))
            return gx, None, None, None
        if want_w:
            gw = det_gemm(g2t, x2.t(), out_dtype=weight.dtype)
        if want_b:
            gb = det_finalize(det_col_sums(g2), ctx.module.bias.dtype)
        return gx, gw, gb, None


class DetLinear(nn.Linear):
    """``nn.Linear`` with exact, batch- and split-invariant arithmetic.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear`` (same parameters,
            same ``state_dict`` keys, so checkpoints move freely between the two).

    Shapes: input (..., in_features) of float32/bfloat16/float16; output (..., out_features)
    of the input's dtype. Forward is ``x @ W.T + b`` with the bias added inside the long
    accumulator and a single rounding. Backward: dX exact and rounded once; dW and db exact sums
    over every leading (batch) dimension, rounded once, or, in digit mode (see
    :mod:`lightning_det.nn.grad_digits`), left unrounded for the strategy to reduce and round.
    """

    supports_grad_digits = True

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DetLinear":
        """Turns an ``nn.Linear`` into a DetLinear in place, keeping its Parameter objects."""
        return swap_class(linear, nn.Linear, cls, "linear")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.shape[-1] != self.in_features:
            raise ValueError(
                f"input: expected last dimension in_features={self.in_features}, got shape {tuple(input.shape)}"
            )
        note_forward_use(self, self.weight, self.bias)
        return _DetLinearFn.apply(input, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, exact=True"
