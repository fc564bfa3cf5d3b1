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

Eager rounding (``with eager_rounding(model):`` around the step's one backward, world size 1):
the digits of a parameter with exactly one contribution in that backward would be rounded
once anyway, so its module rounds it there and then (the ordinary exact GEMM with a rounded
output) and never allocates its 152 bytes per element of digits. "Exactly one" is proved per
parameter: each Det module's forward counts the uses of its parameters that require grad (in
any grad mode, so a forward that a reentrant checkpoint will recompute counts too), each
backward contribution takes one off, and a contribution rounds eagerly only when it is the
single counted use and no digits are pending.
Anything uncounted that arrives later (a second backward through a retained graph, a
checkpointed segment recomputed after the rounding) raises instead of rounding twice.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from ..ops import LongAcc, det_combine, det_finalize, det_normalize
from ..ops.longacc import check_acc

__all__ = [
    "DIGITS_ATTR", "ROUNDED_ATTR", "set_grad_digits", "add_grad_digits", "grad_digits", "finalize_grad_digits",
    "eager_rounding", "note_forward_use", "contribute_grad", "take_rounded_grad", "clear_forward_uses",
]

DIGITS_ATTR = "ldet_grad_digits"
ROUNDED_ATTR = "ldet_grad_rounded"  # an eagerly rounded gradient waiting for the step's owner
_FLAG = "ldet_digit_mode"
_EAGER = "ldet_eager_rounding"
_USES = "ldet_forward_uses"  # counted forward uses whose backward contribution has not come yet
_OWNED = "ldet_grad_digits_owned"  # the pending digits were made or handed over here: writable


def set_grad_digits(module: nn.Module, enabled: bool = True) -> None:
    """Turns digit mode on or off for every module in ``module``'s tree that supports it."""
    for m in module.modules():
        if getattr(m, "supports_grad_digits", False):
            setattr(m, _FLAG, bool(enabled))


def digit_mode(module: nn.Module) -> bool:
    return bool(getattr(module, _FLAG, False))


@contextmanager
def eager_rounding(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Lets the digit-mode modules in ``module``'s tree round single-contribution gradients at once.

    Must enclose the forward and the backward of the step's last (or only) micro-batch, and only
    where the pending digits would then be rounded with no reduction and no scale: one process
    (world size 1). Entering forgets earlier forward-use counts (their backward is done). The
    rounded gradients wait in the parameters (``take_rounded_grad``) for the step's owner.
    """
    mods = [m for m in module.modules() if getattr(m, "supports_grad_digits", False)] if enabled else []
    if enabled:
        clear_forward_uses(module.parameters())
    for m in mods:
        setattr(m, _EAGER, True)
    try:
        yield
    finally:
        for m in mods:
            setattr(m, _EAGER, False)


def note_forward_use(module: nn.Module, *params: Optional[torch.Tensor]) -> None:
    """Called by a Det module's forward in digit mode: each param expects one more backward
    contribution. Counted in any grad mode: a forward under no_grad may be recomputed with grad
    later (reentrant activation checkpointing), and over-counting (a forward whose output never
    reaches a loss) only keeps that parameter on the digit path. Under-counting is what would
    be unsafe, and a contribution arriving after an eager rounding raises."""
    if not digit_mode(module):
        return
    for p in params:
        if p is not None and p.requires_grad:
            setattr(p, _USES, getattr(p, _USES, 0) + 1)


def clear_forward_uses(params: Iterable[torch.Tensor]) -> None:
    """Forgets the counts (after the step's gradients are rounded: leftovers were over-counts)."""
    for p in params:
        if hasattr(p, _USES):
            delattr(p, _USES)


def contribute_grad(
    module: nn.Module, param: torch.Tensor, digits: Callable[[], LongAcc], rounded: Callable[[], torch.Tensor]
) -> None:
    """A Det module's backward hands over one exact contribution to ``param``'s gradient.

    Args:
        module: the module whose backward runs (its eager flag decides).
        param: the parameter receiving the contribution.
        digits: makes the contribution as a canonical LongAcc ``(*param.shape, 19)``, handed over.
        rounded: makes the same exact sum rounded once to the param's dtype, shape ``param.shape``.
            Called instead of ``digits`` only when this is provably the parameter's one
            contribution of a backward under :func:`eager_rounding`.
    """
    uses = getattr(param, _USES, 0)
    if uses > 0:
        setattr(param, _USES, uses - 1)
    if hasattr(param, ROUNDED_ATTR):
        raise RuntimeError(
            f"param: a gradient contribution (shape {tuple(param.shape)}) arrived after this parameter's "
            "gradient was already rounded as its only one (eager rounding); a second backward through a "
            "retained graph or a recomputed checkpoint segment does that. Construct the strategy with "
            "eager_rounding=False to keep every gradient as digits until the step."
        )
    if getattr(module, _EAGER, False) and uses == 1 and getattr(param, DIGITS_ATTR, None) is None:
        setattr(param, ROUNDED_ATTR, rounded())
        return
    add_grad_digits(param, digits(), take=True)


def take_rounded_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    """Removes and returns ``param``'s eagerly rounded gradient, or None."""
    g = getattr(param, ROUNDED_ATTR, None)
    if g is not None:
        delattr(param, ROUNDED_ATTR)
    return g


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
    params = list(params)
    n = 0
    for p in params:
        acc = getattr(p, DIGITS_ATTR, None)
        eager = getattr(p, ROUNDED_ATTR, None)
        if eager is not None:
            if reduce is not None or p.grad is not None:
                raise RuntimeError(
                    "param: holds an eagerly rounded gradient, which cannot take a reduction or be "
                    "added to an existing .grad; use eager_rounding only in one process, once per step"
                )
            p.grad = take_rounded_grad(p)
            n += 1
            continue
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
    clear_forward_uses(params)
    return n
