"""Unrounded gradients: the hook that lets det_ddp round each gradient exactly once.

Normally a Det module's backward writes ``param.grad`` already rounded. With digit mode on
(``set_grad_digits(model, True)``), it instead adds the exact, unrounded dW and db into
``param.ldet_grad_digits`` (a LongAcc of shape ``(*param.shape, 19)``) and leaves ``.grad``
alone. Further backward passes (micro-batches) keep adding into the same digits, exactly.
Whoever owns the step then calls :func:`finalize_grad_digits`, optionally with a reduction such
as :func:`lightning_det.ops.det_all_reduce`, which rounds once into ``.grad``.

    set_grad_digits(model, True)
    for micro_batch in batches:
        loss_fn(model(micro_batch)).backward()      # digits accumulate, .grad untouched
    finalize_grad_digits(model.parameters(), reduce=det_all_reduce)
    optimizer.step()
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..ops import LongAcc, det_combine, det_finalize, det_normalize
from ..ops.longacc import check_acc

__all__ = ["DIGITS_ATTR", "set_grad_digits", "add_grad_digits", "grad_digits", "finalize_grad_digits"]

DIGITS_ATTR = "ldet_grad_digits"
_FLAG = "ldet_digit_mode"
_OWNED = "ldet_grad_digits_owned"  # the pending digits were made or handed over here: writable


def set_grad_digits(module: nn.Module, enabled: bool = True) -> None:
    """Turns digit mode on or off for every module in ``module``'s tree that supports it."""
    for m in module.modules():
        if getattr(m, "supports_grad_digits", False):
            setattr(m, _FLAG, bool(enabled))


def digit_mode(module: nn.Module) -> bool:
    return bool(getattr(module, _FLAG, False))


def add_grad_digits(param: torch.Tensor, acc: LongAcc, *, take: bool = False) -> None:
    """Adds an exact gradient contribution (LongAcc of shape ``(*param.shape, 19)``, canonical).

    Args:
        param: the parameter whose pending digits receive the contribution.
        acc: int64 ``(*param.shape, 19)`` on the parameter's pending digits' device.
        take: the caller hands ``acc`` over (it keeps no reference and will not read it
            again), so it may become the pending digits and later sums may go into it in place:
            one full copy of the digits fewer at the memory peak of gradient accumulation. The
            Det modules pass True for the tensors their backward just made; with False the
            caller's tensor is never written.
    """
    check_acc(acc, "acc")
    if acc.shape[:-1] != param.shape:
        raise ValueError(f"acc: expected shape {(*param.shape, 19)} for this parameter, got {tuple(acc.shape)}")
    prev = getattr(param, DIGITS_ATTR, None)
    if prev is None:
        setattr(param, DIGITS_ATTR, acc)
        setattr(param, _OWNED, take)
        return
    if getattr(param, _OWNED, False):
        if acc.device != prev.device:
            raise ValueError(f"acc: expected device {prev.device} like the pending digits, got {acc.device}")
        # Two canonical accumulators: the sum is far inside every digit's headroom (longacc.h).
        prev.add_(acc)
        total = det_normalize(prev)
    else:
        total = det_combine([prev, acc])
    del prev
    setattr(param, DIGITS_ATTR, total)
    setattr(param, _OWNED, True)  # made here: nobody else holds it


def grad_digits(param: torch.Tensor) -> Optional[LongAcc]:
    """The pending unrounded gradient of ``param``, or None."""
    return getattr(param, DIGITS_ATTR, None)


def finalize_grad_digits(
    params: Iterable[torch.Tensor], reduce: Optional[Callable[[LongAcc], LongAcc]] = None
) -> int:
    """Rounds every pending digit gradient once into ``param.grad`` (of the param's dtype).

    Args:
        params: parameters to look at; those without pending digits are left alone.
        reduce: optional function applied to the digits first (e.g. a cross-rank
            ``det_all_reduce``); it must return a canonical LongAcc of the same shape.

    Returns:
        The number of parameters finalized. A param that already had a ``.grad`` from a
        non-digit path gets an error: mixing the two would round twice.
    """
    n = 0
    for p in params:
        acc = getattr(p, DIGITS_ATTR, None)
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
        delattr(p, DIGITS_ATTR)
        n += 1
    return n
