"""DetGroupNorm: ``nn.GroupNorm`` with per-sample exact statistics and exact weight/bias sums.

GroupNorm's statistics stay inside one sample: the (C / groups) * spatial values of each
(sample, group) are one row of the exact LayerNorm kernel (``ldet::norm_forward``, csrc/norm.h,
:mod:`lightning_det.nn.norm`), so a row's bytes depend on that row alone:

    rows  = x.reshape(B * groups, C / groups * spatial)
    xhat  = the LayerNorm kernel's xhat of each row (exact row sums, IEEE elementwise, fp32)
    y     = xhat * weight[c] + bias[c]          (fp32, then rounded to x's dtype)

Backward: g = dy * weight[c] (fp32), dx = the LayerNorm kernel's input gradient of g (exact row
sums); dweight[c], dbias[c] = exact sums over samples and positions of dy * xhat and dy, rounded
once or handed to the step state as digits.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.norm import norm_backward, norm_forward
from ..ops.trust import trusted_fn
from .batch_norm import _channel_sums, _param_grad
from .step_state import StepState

__all__ = ["DetGroupNorm"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _DetGroupNormFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, weight, bias, state, groups, eps):
        B, C, S = x.shape
        y_rows, xhat, rstd = norm_forward(x.reshape(B * groups, -1), None, None, eps, False)
        if weight is None:
            y = y_rows.view(B, C, S)
        else:
            y = xhat.view(B, C, S) * weight.float().view(1, C, 1)
            if bias is not None:
                y = y + bias.float().view(1, C, 1)
            y = y.to(x.dtype) if x.dtype != torch.float32 else y
        ctx.save_for_backward(xhat, rstd)
        ctx.params = (weight, bias)  # the state keys gradients by the Parameter objects
        ctx.state, ctx.groups, ctx.x_dtype = state, groups, x.dtype
        return y

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        xhat, rstd = ctx.saved_tensors
        weight, bias = ctx.params
        B, C, S = gy.shape
        gyf = gy.float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            g = gyf if weight is None else gyf * weight.float().view(1, C, 1)
            gx = norm_backward(g.reshape(B * ctx.groups, -1), xhat, rstd, None, False, ctx.x_dtype).view(B, C, S)
        x3 = xhat.view(B, C, S)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = _param_grad(ctx.state, weight, _channel_sums(gyf, x3))
        if bias is not None and ctx.needs_input_grad[2]:
            gb = _param_grad(ctx.state, bias, _channel_sums(gyf, None))
        return gx, gw, gb, None, None, None


class DetGroupNorm(nn.GroupNorm):
    """``nn.GroupNorm`` with batch-invariant forward and exact weight/bias gradients.

    Args: as ``nn.GroupNorm`` (same parameters and ``state_dict`` keys). Input (B, C, *),
    float32/bfloat16/float16; output of the same shape and dtype. Each sample's output depends
    only on that sample.
    """

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS:
            raise TypeError(f"input: expected a float32/bfloat16/float16 tensor, got {getattr(input, 'dtype', type(input))}")
        if input.dim() < 2 or input.shape[1] != self.num_channels:
            raise ValueError(f"input: expected shape (batch, {self.num_channels}, *), got {tuple(input.shape)}")
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        state = self.step_state
        if state is not None:
            state.note_forward_use(weight, bias)
        x3 = input.reshape(input.shape[0], self.num_channels, -1)
        y = _DetGroupNormFn.apply(x3, weight, bias, state, self.num_groups, float(self.eps))
        return y.reshape(input.shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"
