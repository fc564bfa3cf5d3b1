"""global_mean: a loss whose value and gradient are the same at any world size and split."""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from ..ops import det_all_reduce, det_normalize, to_digits
from ..ops.exact_scalar import mean_of_acc, reciprocal
from ..ops.trust import trusted

__all__ = ["global_mean", "consume_global_mean_flag"]

_state = threading.local()


def consume_global_mean_flag() -> bool:
    """True if global_mean ran since the last call (the strategy then skips its 1/N scale)."""
    used = getattr(_state, "used", False)
    _state.used = False
    return used


def _world(group) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


class _GlobalMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, group):
        with trusted():
            return _GlobalMean._forward(ctx, values, group)

    @staticmethod
    def _forward(ctx, values, group):
        v = values.detach().reshape(-1)
        if v.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            v = v.float()
        count = v.numel() * _world(group)
        if count == 0:
            raise ValueError("values: expected at least one element on some rank, got none")
        total = det_normalize(to_digits(v).sum(0, keepdim=True))  # exact: integer digit sums
        if _world(group) > 1:
            total = det_all_reduce(total, group)
        value = mean_of_acc(total[0].tolist(), count)
        ctx.scale = reciprocal(count)  # 1/count rounded once: the same number at every split
        ctx.shape = values.shape
        _state.used = True
        return torch.tensor(value, dtype=torch.float32, device=values.device)

    @staticmethod
    def backward(ctx, grad):
        # grad * (1/count): one correctly rounded multiply, elementwise (verified)
        return (grad * ctx.scale).expand(ctx.shape).contiguous(), None


def global_mean(values: torch.Tensor, group: Optional[object] = None) -> torch.Tensor:
    """Mean of ``values`` over every element on every rank, exactly, rounded once.

    Args:
        values: per-sample (or per-token) losses of this rank, any shape, float32/bf16/fp16,
            e.g. ``F.cross_entropy(logits, target, reduction="none")``. Every rank must call it
            (it all-reduces) and should hold the same number of elements.
        group: process group; None = the default group.

    Returns:
        A float32 scalar. Its value is the exact global mean rounded once (identical on every
        rank and at every world size); its gradient is ``1/count`` (rounded once) for each
        element, so gradients do not depend on the split either, for any world size (3, 6, ...).
        Under Lightning's ``accumulate_grad_batches=k`` the loss is divided by k as usual: use a
        power of two k.
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"values: expected a floating-point tensor, got {type(values).__name__}")
    return _GlobalMean.apply(values, group)
