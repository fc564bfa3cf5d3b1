"""det_linear: the exact linear map ``x @ weight.T + bias`` with its one autograd formula.

DetLinear and ``det_gemm`` (through ``ldet::gemm``'s registered autograd) differentiate with the
same :func:`linear_backward`: dX, dW and db are each their own exact sum rounded once, db as
exact column sums of dY (no GEMM against a row of ones). With a ``grad_sink`` (the step's state
in digit mode, :class:`lightning_det.nn.step_state.StepState`) dW and db are not rounded here:
they go to the sink as unrounded digits, or rounded when the sink says this is the parameter's
only contribution.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from .longacc import LongAcc, _gemm_args, _ops, _plans_arg, det_finalize
from .trust import trusted_fn

__all__ = ["det_linear", "GradSink", "linear_backward"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class GradSink(Protocol):
    """Where digit-mode parameter gradients go (StepState is one)."""

    def note_forward_use(self, *params: Optional[torch.Tensor]) -> None: ...

    def contribute(self, param: torch.Tensor, digits: Callable[[], LongAcc],
                   rounded: Callable[[], torch.Tensor], *,
                   rows: Optional[Callable[[torch.Tensor], LongAcc]] = None) -> None: ...


def _col_sums(a: torch.Tensor) -> LongAcc:
    """Exact column sums of a 2-D float tensor as digits (W, 19)."""
    return _ops().dot_cols(a, None)


def linear_backward(gy2, x2, weight, bias, needs, plans, sink: Optional[GradSink] = None):
    """dX, dW, db of ``y = x2 @ weight.T + bias`` for the output gradient ``gy2`` (M, N).

    Args:
        gy2: (M, N); x2: (M, K) the forward's input; weight: (N, K); bias: (N,) or None.
        needs: which of (x2, weight, bias) want a gradient.
        plans: the checked ``plans`` list of the GEMMs (``_plans_arg``).
        sink: None (dW and db returned rounded), or where they go instead (returned as None).

    Returns:
        (gx (M, K) of x2's dtype or None, gw or None, gb or None).
    """
    gx = gw = gb = None
    if needs[0]:
        # dX[m, k] = sum_n dY[m, n] W[n, k]: exact, rounded once to x's dtype
        gx = _ops().gemm(gy2, weight.t(), None, x2.dtype, plans)
    want_w = needs[1]
    want_b = bias is not None and needs[2]
    g2t = gy2.t()
    w_dtype = weight.dtype if weight.dtype in _FLOATS else torch.float32
    b_dtype = None if bias is None else (bias.dtype if bias.dtype in _FLOATS else torch.float32)
    if sink is not None:
        # unrounded sums over every batch row, left for the owner of the step to round once
        # (or, when this is provably the only contribution, rounded here)
        if want_w:
            # rows: dW's digits of some rows only (a weight tied to an embedding, which then
            # touches a few rows: StepState.contribute)
            sink.contribute(weight, lambda: _ops().gemm_partial(g2t, x2.t(), None, 0, plans),
                            lambda: _ops().gemm(g2t, x2.t(), None, w_dtype, plans),
                            rows=lambda idx: _ops().gemm_partial(g2t.index_select(0, idx), x2.t(), None, 0, plans))
        if want_b:
            sink.contribute(bias, lambda: _col_sums(gy2), lambda: det_finalize(_col_sums(gy2), b_dtype))
        return gx, None, None
    if want_w:
        gw = _ops().gemm(g2t, x2.t(), None, w_dtype, plans)
    if want_b:
        gb = det_finalize(_col_sums(gy2), b_dtype)
    return gx, gw, gb


class _ExactLinear(torch.autograd.Function):
    # Forward takes and returns 2-D tensors: the output is a fresh tensor, never a view made in
    # here, so in-place ops on it (h += x, ReLU(inplace=True)) work as on nn.Linear's output.
    @staticmethod
    @trusted_fn
    def forward(ctx, x2, weight, bias, sink, plans):
        y = _ops().gemm(x2, weight, bias, x2.dtype, plans)  # bias inside the accumulator: one rounding
        ctx.save_for_backward(x2, weight, bias)
        ctx.sink, ctx.plans = sink, plans
        # the sink keys gradients by the Parameter objects themselves
        ctx.params = (weight, bias) if sink is not None else None
        return y

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        x2, weight, bias = ctx.saved_tensors
        if ctx.params is not None:
            weight, bias = ctx.params
        gx, gw, gb = linear_backward(gy, x2, weight, bias, ctx.needs_input_grad, ctx.plans, ctx.sink)
        return gx, gw, gb, None, None


def det_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               grad_sink: Optional[GradSink] = None, plans="default") -> torch.Tensor:
    """``F.linear`` exactly: ``x @ weight.T + bias``, the bias inside the accumulator, rounded once.

    Args:
        x: (..., K) float32 / bfloat16 / float16 (K may be 0: the output is then the bias).
        weight: (N, K) (N may be 0); bias: optional (N,).
        grad_sink: None, or where dW and db go unrounded (the step's state in digit mode, which
            counts this call as one forward use of weight and bias).
        plans: how the integer-slice route plans the GEMMs, as :func:`det_gemm`'s.

    Returns:
        (..., N) of x's dtype, a fresh tensor. Backward: :func:`linear_backward`.
    """
    x2, lead = _gemm_args(x, weight, bias)
    plans_list = _plans_arg(plans)
    if grad_sink is not None:
        grad_sink.note_forward_use(weight, bias)
    y = _ExactLinear.apply(x2, weight, bias, grad_sink, plans_list)
    return y if len(lead) == 1 else y.reshape(*lead, weight.shape[0])
