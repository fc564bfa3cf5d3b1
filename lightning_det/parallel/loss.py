"""global_mean / global_sum: losses whose value and gradient are the same at any world size and split.

Both are :func:`lightning_det.nn.loss.exact_loss_reduce` (exact digit sum, one rounding) with the
digits, and the count, summed over the ranks before the rounding. Their autograd node is marked
``global_loss``: the strategy that back-propagates a loss asks :func:`feeds_global_loss` and, when
a global loss feeds it, records that in its step state and skips its 1/N gradient scale.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..nn.loss import exact_loss_reduce
from ..ops import det_all_reduce
from ..ops.trust import trusted

__all__ = ["global_mean", "global_sum", "global_loss_reduce", "feeds_global_loss"]


def feeds_global_loss(loss: torch.Tensor) -> bool:
    """Whether a global loss (:func:`global_mean`, :func:`global_sum`) is part of ``loss``'s
    autograd graph, e.g. ``global_mean(l) / k``: the strategy calls it on the loss it
    back-propagates (only such a loss decides the gradient scale). Walks the graph from the loss
    until it meets a marked node (at once for the usual ``global_mean(...) / k``), each node once."""
    node = getattr(loss, "grad_fn", None)
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "global_loss", False):
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


def _world(group) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def _combine(group, masked: bool):
    """The cross-rank step of exact_loss_reduce: int64 SUM of the digits (and of the counts)."""

    def combine(total: torch.Tensor, count: int):
        world = _world(group)
        if world == 1:
            return total, count
        with trusted():
            total = det_all_reduce(total, group)
            if not masked:  # every rank holds the same number of elements
                return total, count * world
            counts = torch.tensor([count], dtype=torch.int64, device=total.device)
            dist.all_reduce(counts, group=group)  # integers: exact
            return total, int(counts.item())

    return combine


def _global(values, reduction, mask, group, out_dtype, count: Optional[int] = None) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"values: expected a floating-point tensor, got {type(values).__name__}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or mask.shape != values.shape):
        raise ValueError(f"mask: expected a bool tensor of shape {tuple(values.shape)} like values, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
    if mask is None and reduction == "mean" and values.numel() == 0:
        raise ValueError("values: expected at least one element on some rank, got none")
    combine = _combine(group, masked=mask is not None)
    out = exact_loss_reduce(values, reduction, mask=mask, out_dtype=out_dtype, count=count, combine=combine)
    if out.grad_fn is not None:
        out.grad_fn.global_loss = True  # the node of exact_loss_reduce's Function: its ctx (feeds_global_loss)
    return out


def global_mean(values: torch.Tensor, group: Optional[object] = None, mask: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
    """Mean of ``values`` over every element on every rank, exactly, rounded once.

    Args:
        values: per-sample (or per-token) losses of this rank, any shape, float32/bf16/fp16,
            e.g. ``F.cross_entropy(logits, target, reduction="none")``. Every rank must call it
            (it all-reduces) and should hold the same number of elements.
        group: process group; None = the default group.
        mask: optional bool tensor of ``values``' shape: False elements (padding, ignored
            tokens) are left out of the sum and of the count, which is then summed over the
            ranks too (one more int64 all-reduce), so ranks may hold different numbers of them.

    Returns:
        A float32 scalar. Its value is the exact global mean rounded once (identical on every
        rank and at every world size; nan when the mask leaves nothing); its gradient is
        ``1/count`` (rounded once) for each included element, so gradients do not depend on the
        split either, for any world size (3, 6, ...). Under Lightning's
        ``accumulate_grad_batches=k`` the loss is divided by k as usual: use a power of two k.
    """
    return _global(values, "mean", mask, group, torch.float32)


def global_sum(values: torch.Tensor, group: Optional[object] = None, mask: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """Sum of ``values`` over every element on every rank, exactly, rounded once to float32.

    As :func:`global_mean` without the division: gradient 1 for each included element. At
    world size N the result equals the world-size-1 sum of the whole batch.
    """
    return _global(values, "sum", mask, group, torch.float32)


def global_loss_reduce(values: torch.Tensor, mask: torch.Tensor, reduction: str, out_dtype: torch.dtype,
                       count: Optional[int] = None):
    """det_ddp's reduction for ``F.cross_entropy(..., reduction='mean' | 'sum')`` (the
    ``loss_reduce`` of :func:`lightning_det.nn.det_function_mode`): the global mean over the
    non-ignored rows of every rank, or the global sum, rounded once to the logits' dtype.
    At world size 1 it is bitwise ``det_cross_entropy``'s own reduction. ``count``: this rank's
    number of True mask elements when the caller knows it (saves reading it back)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction: expected 'mean' or 'sum', got {reduction!r}")
    return _global(values, reduction, mask, None, out_dtype, count)
