"""Exact, device-invariant cross-entropy: ``det_cross_entropy`` for (N, C) logits.

PyTorch's ``F.cross_entropy`` is row-invariant on CPU but computes exp/log differently on CPU
and CUDA, and its float sums depend on the column order. Here, per row i of x (N, C) (fp32;
bf16/fp16 are widened exactly), with t the target class:

    m   = max_j x[i, j]                              (exact)
    e_j = det_exp(x[i, j] - m)                       (fp32 subtract, csrc/detmath.h exp, rounded once)
    S   = round(exact sum_j e_j)                     (long accumulator, one rounding; for the gradient)
    T   = round(exact (sum_j e_j) - 1)               (e of the max is exactly 1, so T >= 0; rounding
                                                      S - 1 rather than S keeps small losses accurate)
    l_i = fp32( (m - x[i, t]) + log1p(T) )           (fp64, log1p from IEEE + - * / only: csrc/detmath.h)

Reductions: 'none' returns l rounded to x's dtype; 'sum' and 'mean' add the fp32 l_i exactly
(digits) and round once to x's dtype; 'mean' divides the exact sum by the count of non-ignored
rows inside that one rounding (on the device for a power-of-two count, else in Python integers),
as ``lightning_det.global_mean`` does.

Backward, with g_i the gradient of l_i (the output gradient, times round(1/count) for 'mean'):

    dx[i, j] = (e_j / S - [j == t]) * g_i            (fp32 IEEE division, subtract, multiply)

rounded to x's dtype. Every step is an elementwise IEEE operation, an exact selection or an
exact long-accumulator sum, so a row's bytes depend only on that row (not on the other rows,
the column order, the thread count or the device). Rows whose target is ``ignore_index`` get
loss +0.0 and gradient +0.0 and do not count in the mean.

Under ``det_ddp``, ``det_function_mode`` sends ``F.cross_entropy`` / ``nn.CrossEntropyLoss``
here, and reductions 'mean' / 'sum' run over the global batch (every rank's rows), see
:func:`lightning_det.nn.function_mode.det_function_mode`.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch

from ..ops import det_finalize, det_normalize, to_digits
from ..ops.cross_entropy import ce_backward, ce_forward
from ..ops.deferred_checks import DeferredChecks, check_now_or_later
from ..ops.exact_scalar import mean_of_acc, pow2_scale_exp, reciprocal
from ..ops.trust import trusted, trusted_fn
from .step_state import current_step_state

__all__ = ["det_cross_entropy", "det_cross_entropy_checked", "exact_loss_reduce", "cross_entropy_unsupported"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")

class _CrossEntropyRows(torch.autograd.Function):
    """Per-row fp32 losses l (N,) of logits x (N, C) and targets t (N,) (int64, ignored rows masked).

    Forward and backward are one compiled op each (``ldet::ce_forward`` / ``ldet::ce_backward``,
    csrc/cross_entropy.h): the steps of the module docstring, which as eager PyTorch ops around
    the exact sums were ~27 ops a step in a det_ddp step bound by its host time.
    """

    @staticmethod
    @trusted_fn
    def forward(ctx, x, target, valid):
        # x (N, C) float32/bf16/fp16; target (N,) int64 in [0, C) where valid; valid (N,) bool
        loss, e, s = ce_forward(x, target, valid)
        ctx.save_for_backward(e, s, target, valid)
        ctx.x_dtype = x.dtype
        return loss

    @staticmethod
    @trusted_fn
    def backward(ctx, grad):
        e, s, target, valid = ctx.saved_tensors
        return ce_backward(e, s, target, valid, grad, ctx.x_dtype), None, None


Combine = Callable[[torch.Tensor, int], Tuple[torch.Tensor, int]]


class _ExactReduce(torch.autograd.Function):
    """Exact sum or mean of every element of ``values`` (optionally masked), rounded once."""

    @staticmethod
    @trusted_fn
    def forward(ctx, values, mask, count, mean, out_dtype, combine):
        v = values.detach().reshape(-1)
        if v.dtype not in _FLOATS:
            v = v.float()
        if mask is not None:
            v = torch.where(mask.reshape(-1), v, torch.zeros_like(v))  # excluded elements add +0
        # integer digit sums: exact and order-free (parallel on any device)
        total = det_normalize(to_digits(v).sum(0, keepdim=True))
        if combine is not None:
            total, count = combine(total, count)
        ctx.scale = None
        scale_exp = pow2_scale_exp(count) if mean else None
        if scale_exp is not None:
            # dividing by 2^k inside the one rounding is exact: rounded on the device, no host sync
            out = det_finalize(total[0], out_dtype, scale_exp=scale_exp)  # 0-dim, not a view
            ctx.scale = reciprocal(count)
        elif mean:
            value = math.nan if count == 0 else mean_of_acc(total[0].tolist(), count, out_dtype)
            out = torch.tensor(value, dtype=torch.float32, device=values.device).to(out_dtype)  # exact cast
            # 1/count rounded once: the same number whatever the split (0 rows: torch's nan loss, zero grads)
            ctx.scale = reciprocal(count) if count else 0.0
        else:
            out = det_finalize(total[0], out_dtype)
        ctx.save_for_backward(mask)
        ctx.shape = values.shape
        return out

    @staticmethod
    @trusted_fn
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        g = grad.float()
        if ctx.scale is not None:
            g = g * ctx.scale  # one correctly rounded fp32 multiply (the scale is an fp32 value)
        g = g.expand(ctx.shape)
        if mask is not None:
            g = torch.where(mask.reshape(ctx.shape), g, torch.zeros_like(g))
        return g.contiguous(), None, None, None, None, None


def exact_loss_reduce(
    values: torch.Tensor,
    reduction: str,
    mask: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
    count: Optional[int] = None,
    combine: Optional[Combine] = None,
) -> torch.Tensor:
    """Exact 'sum' or 'mean' of ``values`` (any shape, float), rounded once to ``out_dtype``.

    Args:
        values: float32/bf16/fp16 tensor (other floats are cast to fp32 first).
        reduction: 'sum' or 'mean'.
        mask: optional bool tensor of ``values``' shape; False elements are left out of the sum
            and the count, and get gradient +0.0.
        out_dtype: float32, bfloat16 or float16.
        count: the number of included elements when the caller already knows it (saves a sync).
        combine: ``(digits (1, 19), count) -> (digits, count)`` applied before rounding: the
            cross-rank sum of :func:`lightning_det.parallel.loss.global_mean` (None: this process).

    Returns:
        A 0-dim ``out_dtype`` tensor. Gradient: the output gradient (times round(1/count) for
        'mean', an fp32 multiply) for each included element.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction: expected 'sum' or 'mean', got {reduction!r}")
    if out_dtype not in _FLOATS:
        raise TypeError(f"out_dtype: expected float32, bfloat16 or float16, got {out_dtype}")
    if count is None:
        with trusted():
            count = values.numel() if mask is None else int(mask.sum())
    return _ExactReduce.apply(values, mask, count, reduction == "mean", out_dtype, combine)


def cross_entropy_unsupported(input, target, weight=None, size_average=None, reduce=None,
                              label_smoothing: float = 0.0) -> Optional[str]:
    """Why det_cross_entropy cannot take these arguments (a message naming the argument), or None.

    These are the PyTorch options outside the det version; :func:`det_function_mode` leaves such
    calls to PyTorch in non-strict mode. Malformed arguments (bad target dtype, shape, device,
    reduction) are not listed here: det_cross_entropy raises for them.
    """
    if weight is not None:
        return "weight: det_cross_entropy supports only weight=None (class weights are not implemented)"
    if size_average is not None or reduce is not None:
        return "size_average/reduce: deprecated arguments are not supported by det_cross_entropy; use reduction="
    if label_smoothing != 0.0:
        return f"label_smoothing: det_cross_entropy supports only label_smoothing=0.0, got {label_smoothing}"
    if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS:
        return (f"input: det_cross_entropy expects float32, bfloat16 or float16 logits, got "
                f"{getattr(input, 'dtype', type(input).__name__)}")
    if input.dim() != 2:
        return (f"input: det_cross_entropy expects 2-D (N, C) logits, got shape {tuple(input.shape)}; for "
                "(N, C, d1, ...) move the class dimension last and flatten to (N * d1 * ..., C)")
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        return "target: class-probability (floating-point) targets are not supported by det_cross_entropy"
    return None


def _check(input, target, ignore_index, reduction) -> None:
    if input.shape[1] == 0:
        raise ValueError(f"input: expected at least one class (C >= 1), got shape {tuple(input.shape)}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target: expected a torch.Tensor, got {type(target).__name__}")
    if target.dtype != torch.int64:
        raise TypeError(f"target: expected int64 class indices, got {target.dtype}")
    if tuple(target.shape) != (input.shape[0],):
        raise ValueError(f"target: expected shape ({input.shape[0]},) for input {tuple(input.shape)}, "
                         f"got {tuple(target.shape)}")
    if target.device != input.device:
        raise ValueError(f"target: expected device {input.device} like input, got {target.device}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")


def cross_entropy_rows(input: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                       need_count: bool = True, checks: Optional[DeferredChecks] = None):
    """Per-row fp32 losses and the row mask: ``(l (N,) float32, valid (N,) bool, n_valid)``.

    The building block of det_cross_entropy and of det_ddp's global reduction; arguments must
    already pass ``cross_entropy_unsupported`` (None) and are checked here. The target range
    check and the count take one host sync. With ``need_count=False`` and ``checks`` (det_ddp's
    step state's), the check is recorded there for later instead (no sync), ``n_valid`` is None and rows whose target is
    out of range get loss NaN (and gradient 0) until the owner resolves the check and raises.
    """
    _check(input, target, ignore_index, "none")
    with trusted():
        n, c = input.shape
        valid = target != ignore_index
        bad = valid & ((target < 0) | (target >= c))
        if not need_count and checks is not None:
            lo, hi = torch.aminmax(torch.where(bad, target, torch.zeros_like(target)))
            check_now_or_later(torch.stack([bad.sum(), lo, hi]), _target_verdict(c, ignore_index), checks)
            rows = _CrossEntropyRows.apply(input, target, valid & ~bad)
            return rows.masked_fill(bad, math.nan), valid, None
        n_bad, n_valid = (int(v) for v in torch.stack([bad.sum(), valid.sum()]).tolist())
        if n_bad:
            first = int(target[bad][0])
            raise ValueError(f"target: {n_bad} value(s) outside [0, {c}) (and not ignore_index={ignore_index}), "
                             f"e.g. {first}")
    return _CrossEntropyRows.apply(input, target, valid), valid, n_valid


def _target_verdict(c: int, ignore_index: int):
    """The deferred target check's verdict on [count of bad targets, min, max of them (0 elsewhere)]."""

    def verdict(stats):
        n_bad, lo, hi = stats
        if not n_bad:
            return None
        return ValueError(f"target: {n_bad} value(s) outside [0, {c}) (and not ignore_index={ignore_index}), "
                          f"e.g. {hi if hi >= c else lo} (found when det_ddp resolved the step's checks, "
                          "before its optimizer step)")

    return verdict


def det_cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    size_average=None,
    ignore_index: int = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Exact, row- and device-invariant ``F.cross_entropy`` (see the module docstring).

    Args:
        input: (N, C) logits, float32, bfloat16 or float16.
        target: (N,) int64 class indices in [0, C), or ``ignore_index``; on input's device.
        weight, size_average, reduce: must be None (not supported).
        ignore_index: target value whose rows get loss 0, gradient 0 and are left out of the mean.
        reduction: 'mean' (over non-ignored rows; nan if there are none, as PyTorch), 'sum' or 'none'.
        label_smoothing: must be 0.0.

    Returns:
        'none': (N,) losses of input's dtype; 'mean' / 'sum': a 0-dim tensor of input's dtype.
        bf16/fp16 per-row losses are rounded via fp32 (two fixed roundings); reduced values are
        rounded once from the exact sum of the fp32 per-row losses.
    """
    reason = cross_entropy_unsupported(input, target, weight, size_average, reduce, label_smoothing)
    if reason is not None:
        raise ValueError(reason)
    # inside a step that defers its checks (det_ddp), found before the trusted region sets its mode aside
    state = current_step_state()
    return det_cross_entropy_checked(input, target, ignore_index, reduction, None if state is None else state.checks)


def det_cross_entropy_checked(input: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                              checks: Optional[DeferredChecks]) -> torch.Tensor:
    """:func:`det_cross_entropy` past its unsupported-option check, with the value checks of
    reduction 'none' deferred to ``checks`` when given (None: decided at once)."""
    _check(input, target, ignore_index, reduction)
    rows, valid, n_valid = cross_entropy_rows(input, target, ignore_index, need_count=reduction != "none",
                                              checks=checks)
    if reduction == "none":
        with trusted():
            return rows.to(input.dtype)
    return exact_loss_reduce(rows, reduction, mask=valid, out_dtype=input.dtype, count=n_valid)
