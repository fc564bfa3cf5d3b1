"""Unrounded gradients: how a step's owner rounds each gradient exactly once.

Normally a det module's backward writes ``param.grad`` already rounded. Bound to a
:class:`~lightning_det.nn.step_state.StepState` (``set_grad_digits(model, state)``, digit mode),
it instead adds the exact, unrounded dW and db into the state's digits for that parameter (a
LongAcc of shape ``(*param.shape, 19)``) and leaves ``.grad`` alone. Further backward passes
(micro-batches) keep adding into the same digits, exactly. Whoever owns the step then calls
:func:`finalize_grad_digits`, optionally with a reduction such as
:func:`lightning_det.ops.det_all_reduce`, which rounds once into ``.grad``.

    state = StepState()
    set_grad_digits(model, state)
    for micro_batch in batches:
        loss_fn(model(micro_batch)).backward()      # digits accumulate, .grad untouched
    finalize_grad_digits(state, model.parameters(), reduce=det_all_reduce)
    optimizer.step()

``set_grad_digits(model, None)`` goes back to ordinary rounded gradients. Eager rounding
(``with state.eager_rounding():``) is described in :mod:`lightning_det.nn.step_state`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..ops import LongAcc, det_finalize
from .step_state import StepState

__all__ = ["set_grad_digits", "finalize_grad_digits"]


def set_grad_digits(module: nn.Module, state: Optional[StepState]) -> None:
    """Binds every det module in ``module``'s tree that supports it to ``state`` (digit mode and
    the state's GEMM plans), or unbinds them (None: ordinary rounded gradients)."""
    if state is not None and not isinstance(state, StepState):
        raise TypeError(f"state: expected a StepState or None, got {type(state).__name__}")
    for m in module.modules():
        if getattr(m, "supports_grad_digits", False):
            m.step_state = state


def finalize_grad_digits(
    state: StepState, params: Iterable[torch.Tensor], reduce: Optional[Callable[[LongAcc], LongAcc]] = None
) -> int:
    """Rounds every pending digit gradient of ``state`` once into ``param.grad`` (of the param's dtype).

    Args:
        state: the step's state, whose digits the det modules' backward filled.
        params: parameters to look at; those without pending digits are left alone.
        reduce: optional function applied to the digits first (e.g. a cross-rank
            ``det_all_reduce``); it must return a canonical LongAcc of the same shape.

    Returns:
        The number of parameters finalized. A param that already had a ``.grad`` from a
        non-digit path gets an error: mixing the two would round twice.
    """
    if not isinstance(state, StepState):
        raise TypeError(f"state: expected a StepState, got {type(state).__name__}")
    n = 0
    for p in params:
        eager = state.rounded_grad(p)
        if eager is not None:
            if reduce is not None or p.grad is not None:
                raise RuntimeError(
                    "param: holds an eagerly rounded gradient, which cannot take a reduction or be "
                    "added to an existing .grad; use eager_rounding only in one process, once per step"
                )
            p.grad = state.take_rounded_grad(p)
            n += 1
            continue
        acc = state.grad_digits(p)
        if acc is None:
            continue
        if p.grad is not None:
            raise RuntimeError(
                "param: has both a rounded .grad and pending gradient digits; zero the grad "
                "(set_to_none=True) before accumulating in digit mode"
            )
        if reduce is not None:
            acc = reduce(acc)
        p.grad = det_finalize(acc, p.dtype if p.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32)
        state.pop_grad_digits(p)
        n += 1
    state.clear_forward_uses()
    return n
