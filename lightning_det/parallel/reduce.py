"""World-size invariant reduction of logged values (self.log(..., sync_dist=True), metrics)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..ops import det_all_reduce, det_finalize, det_normalize, to_digits
from ..ops.exact_scalar import mean_of_acc, pow2_scale_exp, round_ratio
from ..ops.trust import trusted

__all__ = ["exact_reduce"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def exact_reduce(tensor: torch.Tensor, group: Optional[object] = None, reduce_op: str = "mean") -> torch.Tensor:
    with trusted():
        return _exact_reduce(tensor, group, reduce_op)


def _exact_reduce(tensor: torch.Tensor, group: Optional[object], reduce_op: str) -> torch.Tensor:
    """Sum or mean of ``tensor`` over ranks: exact, then rounded once, identical on every rank.

    Args:
        tensor: any shape; float32/bf16/fp16 are reduced through digits; integer and bool
            tensors are summed with an int64 all-reduce (exact); float64 is refused.
        reduce_op: "sum" or "mean" ("avg"); "max"/"min" are exact anyway and passed through.

    The mean divides the exact sum by the world size with one rounding (Python integers), so
    reducing N identical values returns that value for any N.
    """
    op = str(reduce_op).lower().rsplit(".", 1)[-1]  # "mean", "ReduceOp.SUM", "RedOpType.SUM"
    multi = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if multi else 1
    if op in ("max", "min"):
        if multi and world > 1:
            out = tensor.clone()
            dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=group)
            return out
        return tensor
    if op not in ("sum", "mean", "avg"):
        raise ValueError(f"reduce_op: expected 'sum', 'mean', 'max' or 'min', got {reduce_op!r}")
    if not tensor.is_floating_point():
        out = tensor.to(torch.int64).clone()
        if multi and world > 1:
            dist.all_reduce(out, group=group)
        if op == "sum":
            return out
        return torch.tensor([round_ratio(int(v) << 298, world) for v in out.reshape(-1).tolist()],
                            dtype=torch.float32, device=tensor.device).reshape(tensor.shape)
    if tensor.dtype not in _FLOATS:
        raise TypeError(f"tensor: expected float32, bfloat16 or float16 for an exact reduction, got {tensor.dtype}")
    acc = to_digits(tensor.detach())
    acc = det_all_reduce(acc, group) if multi and world > 1 else det_normalize(acc)
    if op == "sum":
        return det_finalize(acc, tensor.dtype)
    scale_exp = pow2_scale_exp(world)
    if scale_exp is not None:
        return det_finalize(acc, tensor.dtype, scale_exp=scale_exp)
    flat = acc.reshape(-1, acc.shape[-1]).cpu().tolist()
    vals = [mean_of_acc(words, world, tensor.dtype) for words in flat]
    return torch.tensor(vals, dtype=torch.float32).to(tensor.dtype).to(tensor.device).reshape(tensor.shape)
