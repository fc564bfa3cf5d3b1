"""DetConv1D: Hugging Face's ``Conv1D`` (GPT-2's transposed Linear) with exact arithmetic.

HF's ``Conv1D(nf, nx)`` holds ``weight`` of shape (nx, nf) = (in, out) and computes
``y = x @ weight + bias``. DetConv1D keeps that layout (same Parameter objects, same
``state_dict`` keys and shapes, so HF checkpoints load unchanged) and computes every product
with the long accumulator, as :class:`lightning_det.nn.DetLinear` does:

    y  = det_gemm(x, weight.T, bias)     one rounding, bias inside the accumulator
    dx = det_gemm(dy, weight)            exact, rounded once to x's dtype
    dW = exact sum over rows of x^T dy   (nx, nf); db = exact column sums of dy

Bound to a step state (digit mode, :mod:`lightning_det.nn.grad_digits`), dW and db go to it
unrounded, like DetLinear's.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..ops import det_finalize, det_gemm, det_gemm_partial
from ..ops.trust import trusted_fn
from .functional import det_col_sums
from .step_state import StepState

__all__ = ["DetConv1D", "conv1d_to_det"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in _FLOATS else torch.float32


def _param_grad(state: Optional[StepState], param: torch.Tensor, digits: Callable, rounded: Callable):
    """The one place this module hands a parameter gradient to the step state: returns the
    rounded gradient for autograd, or None when it went to the step's owner as digits."""
    if state is not None:
        state.contribute(param, digits, rounded)
        return None
    return rounded()


class _DetConv1DFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, weight, bias, state):
        x2 = x.reshape(-1, x.shape[-1])
        plans = state.plans if state is not None else "default"
        y = det_gemm(x2, weight.t(), bias, out_dtype=_float_dtype(x.dtype), plans=plans)
        ctx.save_for_backward(x2, weight)
        ctx.state, ctx.has_bias, ctx.x_shape = state, bias is not None, x.shape
        ctx.params = (weight, bias)  # the state keys gradients by the Parameter objects
        ctx.plans = plans
        # a view as the output would make in-place ops on it (h += x) raise in autograd
        return y.view(*x.shape[:-1], weight.shape[1]).clone() if x.dim() != 2 else y

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        x2, weight = ctx.saved_tensors
        state = ctx.state
        _, bias = ctx.params
        g2 = gy.reshape(-1, weight.shape[1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = det_gemm(g2, weight, out_dtype=_float_dtype(x2.dtype), plans=ctx.plans).reshape(ctx.x_shape)
        xt, gt = x2.t(), g2.t()
        if ctx.needs_input_grad[1]:  # dW[i, o] = sum_m x[m, i] dy[m, o]
            gw = _param_grad(state, ctx.params[0], lambda: det_gemm_partial(xt, gt, plans=ctx.plans),
                             lambda: det_gemm(xt, gt, out_dtype=weight.dtype, plans=ctx.plans))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = _param_grad(state, bias, lambda: det_col_sums(g2),
                             lambda: det_finalize(det_col_sums(g2), _float_dtype(bias.dtype)))
        return gx, gw, gb, None


class DetConv1D(nn.Module):
    """HF ``Conv1D`` (``y = x @ weight + bias``, weight (nx, nf)) with exact arithmetic.

    Args:
        nf: output features. nx: input features. As HF's ``Conv1D(nf, nx)``.

    Shapes: input (..., nx) float32/bfloat16/float16; output (..., nf) of the input's dtype.
    Made by :func:`det_transform` from an HF ``Conv1D`` in place (:func:`conv1d_to_det`).
    """

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    def __init__(self, nf: int, nx: int, device=None, dtype=None):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS:
            raise TypeError(f"input: expected a float32/bfloat16/float16 tensor, got {getattr(input, 'dtype', type(input))}")
        if input.dim() == 0 or input.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"input: expected last dimension nx={self.weight.shape[0]}, got shape {tuple(input.shape)}")
        state = self.step_state
        if state is not None:
            state.note_forward_use(self.weight, self.bias)
        return _DetConv1DFn.apply(input, self.weight, self.bias, state)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, exact=True"


def conv1d_to_det(module: nn.Module) -> DetConv1D:
    """Turns an HF ``Conv1D`` (checked by :func:`det_transform`'s rule) into a DetConv1D in place."""
    module.__class__ = DetConv1D
    return module
