"""Gradient reduction as long-accumulator digits: world-size and accumulation invariant."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..nn.grad_digits import DIGITS_ATTR, grad_digits
from ..ops import det_finalize, det_normalize, to_digits
from ..ops.distributed import det_all_reduce_windowed
from ..profile import WORDS

__all__ = ["sync_gradients", "grad_scale_exp"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def grad_scale_exp(world_size: int, loss_is_global: bool) -> int:
    """The power-of-two scale that turns summed per-rank-mean gradients into the global mean.

    Each rank's loss is a mean over its own b samples, so the digit sum over N ranks carries a
    factor N too many. Dividing by N inside the one rounding is exact only for N = 2^k. Losses
    from :func:`lightning_det.global_mean` already divide by the global count: no scale.
    """
    if loss_is_global or world_size == 1:
        return 0
    if world_size & (world_size - 1):
        raise ValueError(
            f"world_size: {world_size} is not a power of two, so the per-rank mean loss cannot be turned "
            "into the global mean without a second rounding. Compute the loss with "
            "lightning_det.global_mean(per_sample_losses) (e.g. F.cross_entropy(..., reduction='none')), "
            "which divides by the global sample count."
        )
    return -(world_size.bit_length() - 1)


def sync_gradients(
    params: Iterable[torch.Tensor], group: Optional[object] = None, scale_exp: int = 0
) -> dict:
    """Sums every gradient exactly over the ranks and rounds it once into ``param.grad``.

    Args:
        params: parameters in a fixed order (the same on every rank).
        group: process group; None = the default group (or a single process when none exists).
        scale_exp: power-of-two scale applied inside the rounding (see :func:`grad_scale_exp`).

    Parameters with pending digits (``DetLinear`` and friends in digit mode) contribute their
    unrounded sums: the result is the same at any world size and micro-batching. Parameters
    that only have a rounded ``.grad`` (uncovered modules) are summed exactly too, which makes
    them independent of rank order but not of the world size: the caller labels the run
    unverified. Every rank takes part in one windowed reduce of one flat buffer (a small MAX
    all-reduce agreeing on bit windows, then one int64 SUM all-reduce).

    Returns:
        {"exact": n, "rounded_only": n, "elements": n, "bytes": n, "fallback_elements": n} for
        logging and benchmarks; "bytes" is what the all-reduces moved together (the window
        agreement and the packed SUM, 0 in a single process), "fallback_elements" how many
        gradient elements went as full digits (NaN/inf or windows too wide to pack).
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        return {"exact": 0, "rounded_only": 0, "elements": 0, "bytes": 0, "fallback_elements": 0}
    parts, exact, rounded = [], 0, 0
    for p in params:
        acc = grad_digits(p)
        if acc is not None:
            exact += 1
        elif p.grad is not None:
            rounded += 1
            acc = to_digits(p.grad)
        else:
            acc = torch.zeros((*p.shape, WORDS), dtype=torch.int64, device=p.device)
        parts.append(acc.reshape(-1, WORDS))
    flat = torch.cat(parts)
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    # each block of elements travels in the bit window it uses (exact; see det_all_reduce_windowed)
    sync: dict = {}
    if multi:
        flat, _ = det_all_reduce_windowed(flat, group, stats=sync)
    else:
        flat = det_normalize(flat)
    offset = 0
    for p in params:
        n = p.numel()
        acc = flat[offset : offset + n].reshape(*p.shape, WORDS)
        offset += n
        dtype = p.dtype if p.dtype in _FLOATS else torch.float32
        p.grad = det_finalize(acc, dtype, scale_exp=scale_exp)
        if hasattr(p, DIGITS_ATTR):
            delattr(p, DIGITS_ATTR)
    return {"exact": exact, "rounded_only": rounded, "elements": flat.shape[0], "bytes": sync.get("bytes", 0),
            "fallback_elements": sync.get("fallback_elements", 0)}
