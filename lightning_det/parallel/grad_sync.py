"""Gradient reduction as long-accumulator digits: world-size and accumulation invariant."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from ..nn.step_state import StepState
from ..ops import det_finalize, to_digits
from ..ops.exact_scalar import pow2_scale_exp
from ..ops.args import as_index
from ..ops.distributed import check_rank_agreement, det_all_reduce_windowed
from ..profile import PROFILE, WORDS

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
    scale_exp = pow2_scale_exp(world_size)
    if scale_exp is None:
        raise ValueError(
            f"world_size: {world_size} is not a power of two, so the per-rank mean loss cannot be turned "
            "into the global mean without a second rounding. Compute the loss with "
            "lightning_det.global_mean(per_sample_losses) (e.g. F.cross_entropy(..., reduction='none')), "
            "which divides by the global sample count."
        )
    return scale_exp


def sync_gradients(
    params: Iterable[torch.Tensor], state: StepState, group: Optional[object] = None, scale_exp: int = 0,
    bucket_elements: int = 1 << 20,
) -> dict:
    """Sums every gradient exactly over the ranks and rounds it once into ``param.grad``.

    Args:
        params: parameters in a fixed order (the same on every rank).
        state: the step's state, holding the det modules' pending digits and eager gradients.
        group: process group; None = the default group (or a single process when none exists).
        scale_exp: power-of-two scale applied inside the rounding (see :func:`grad_scale_exp`).
        bucket_elements: gradient elements per windowed reduce (whole parameters; a larger
            parameter is a bucket of its own). Must be the same on every rank. Only memory and the
            number of collectives depend on it, never the result.

    Parameters with pending digits (``DetLinear`` and friends in digit mode) contribute their
    unrounded sums: the result is the same at any world size and micro-batching. Parameters
    that only have a rounded ``.grad`` (uncovered modules) are summed exactly too, which makes
    them independent of rank order but not of the world size: the caller labels the run
    unverified. With several ranks, each bucket of parameters takes part in one windowed reduce
    (a small MAX all-reduce agreeing on bit windows, then one int64 SUM all-reduce). In a single
    process the reduction is the identity and each parameter's digits are rounded on their own.
    Either way a parameter's digits are released as soon as its ``.grad`` is written, so beside
    the pending digits (152 bytes per element) at most about two buckets' worth is allocated,
    not two more copies of all of them. A gradient already rounded in the backward
    (``eager_rounding``, single process only) is moved into ``.grad`` as it is ("exact" too).
    A parameter with pending digits or an eager gradient and also an ordinary nonzero ``.grad``
    raises: the two cannot be combined with one rounding (an all-zero ``.grad`` is dropped).

    With several ranks, every rank must bring the same parameter shapes and dtypes in the
    same order (and the same ``scale_exp`` and ``bucket_elements``); otherwise every rank
    raises, naming the first parameter that differs and its two shapes.

    Returns:
        {"exact": n, "rounded_only": n, "elements": n, "bytes": n, "fallback_elements": n, "eager": n}
        for logging and benchmarks; "bytes" is what the all-reduces moved together (the window
        agreement and the packed SUM, 0 in a single process), "fallback_elements" how many
        gradient elements went as full digits (NaN/inf or windows too wide to pack), "eager"
        how many of the exact ones were already rounded in the backward.
    """
    if not isinstance(state, StepState):
        raise TypeError(f"state: expected a StepState, got {type(state).__name__}")
    if bucket_elements < 1:
        raise ValueError(f"bucket_elements: expected a positive element count, got {bucket_elements}")
    exp = as_index(scale_exp)  # a NumPy integer too; a plain int in the rank agreement's entries
    if exp is None or not -64 <= exp <= 0:
        raise ValueError(f"scale_exp: expected an integer in [-64, 0], got {scale_exp!r}")
    scale_exp = exp
    params = [p for p in params if p.requires_grad]
    stats = {"exact": 0, "rounded_only": 0, "elements": 0, "bytes": 0, "fallback_elements": 0, "eager": 0}
    if not params:
        return stats

    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    for p in params:
        has_digits = state.grad_digits(p) is not None
        has_eager = state.rounded_grad(p) is not None
        if (has_digits or has_eager) and p.grad is not None and bool(p.grad.any()):
            raise RuntimeError(
                f"params: a parameter of shape {tuple(p.shape)} has exact gradient "
                f"{'digits' if has_digits else '(eagerly rounded)'} from det modules and also an ordinary "
                "rounded .grad from another op; adding them would round twice. Run every use of the "
                "parameter through det modules (det_transform) and zero grads with set_to_none=True."
            )
        # (an all-zero .grad, zeroed with set_to_none=False, adds nothing and is overwritten below)
        if has_eager and (multi or scale_exp != 0):
            raise RuntimeError(
                f"params: a parameter of shape {tuple(p.shape)} was rounded eagerly in its backward, but this "
                "reduction has several ranks or a scale; eager_rounding is only for one process"
            )

    def digits_of(p: torch.Tensor) -> torch.Tensor:
        acc = state.grad_digits(p)
        if acc is not None:
            stats["exact"] += 1
        elif p.grad is not None:
            stats["rounded_only"] += 1
            acc = to_digits(p.grad)
        else:
            acc = torch.zeros((*p.shape, WORDS), dtype=torch.int64, device=p.device)
        stats["elements"] += p.numel()
        return acc

    def round_into_grad(p: torch.Tensor, acc: torch.Tensor) -> None:
        dtype = p.dtype if p.dtype in _FLOATS else torch.float32
        p.grad = det_finalize(acc.reshape(*p.shape, WORDS), dtype, scale_exp=scale_exp)  # normalizes first
        state.pop_grad_digits(p)

    if not multi:
        for p in params:
            eager = state.take_rounded_grad(p)
            if eager is not None:
                stats["exact"] += 1
                stats["eager"] += 1
                stats["elements"] += p.numel()
                p.grad = eager
            else:
                round_into_grad(p, digits_of(p))
        state.clear_forward_uses()
        return stats
    # One small all-reduce for the whole sync: the buckets and their windows follow from
    # these entries, so the per-bucket reduces skip their own check.
    check_rank_agreement(
        "sync_gradients",
        [("profile", PROFILE), ("scale_exp", scale_exp), ("bucket_elements", bucket_elements),
         ("number of parameters with requires_grad", len(params))]
        + [(f"params[{i}] (shape, dtype)", (tuple(p.shape), str(p.dtype))) for i, p in enumerate(params)],
        params[0].device, group)
    for bucket in _buckets(params, bucket_elements):
        parts = [digits_of(p).reshape(-1, WORDS) for p in bucket]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)
        del parts
        # each block of elements travels in the bit window it uses (exact; see det_all_reduce_windowed)
        sync: dict = {}
        flat, _ = det_all_reduce_windowed(flat, group, stats=sync, check=False)
        stats["bytes"] += sync.get("bytes", 0)
        stats["fallback_elements"] += sync.get("fallback_elements", 0)
        offset = 0
        for p in bucket:
            round_into_grad(p, flat[offset : offset + p.numel()])
            offset += p.numel()
    state.clear_forward_uses()
    return stats


def _buckets(params: list, bucket_elements: int) -> list:
    """Consecutive parameters grouped up to ``bucket_elements`` (a larger one stands alone)."""
    buckets, cur, n = [], [], 0
    for p in params:
        if cur and n + p.numel() > bucket_elements:
            buckets.append(cur)
            cur, n = [], 0
        cur.append(p)
        n += p.numel()
    if cur:
        buckets.append(cur)
    return buckets
