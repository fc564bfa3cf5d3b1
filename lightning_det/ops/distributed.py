"""Cross-rank reduction of long accumulators: one int64 SUM all-reduce, then normalize."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .longacc import LongAcc, check_acc, det_normalize

__all__ = ["det_all_reduce", "det_all_reduce_windowed", "MAX_WORLD_SIZE"]

# A canonical digit is < 2^32 and absorbs 2^31 - 2 additions; the status counters are 21 bits.
MAX_WORLD_SIZE = (1 << 21) - 1


def det_all_reduce(acc: LongAcc, group=None) -> LongAcc:
    """Exact sum of ``acc`` over the ranks of ``group``, canonical, identical on every rank.

    Args:
        acc: canonical LongAcc, int64 (..., 19), on the device the process group's backend uses
            (CPU for gloo, CUDA for NCCL).
        group: a torch.distributed process group; None means the default group.

    Returns:
        A new LongAcc of the same shape. The sum is integer addition, so it does not depend on
        the rank order or the backend's reduction algorithm. Without an initialized process
        group (a single process) the input is returned normalized.
    """
    check_acc(acc)
    if not (dist.is_available() and dist.is_initialized()):
        return det_normalize(acc)
    world = dist.get_world_size(group)
    if world > MAX_WORLD_SIZE:
        raise ValueError(f"group: world size {world} exceeds the digit headroom ({MAX_WORLD_SIZE})")
    buf = acc.contiguous().clone()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return det_normalize(buf)


def _signed_digits(acc: LongAcc) -> torch.Tensor:
    """Digits (n, 18) of canonical accs with negative values as negated magnitudes.

    Canonical negative values carry 0xFFFFFFFF in every digit above their leading one (two's
    complement style), which would make every digit "used". Negated magnitude digits are zero
    there, so the digits a tensor really uses form a short window. Sums stay exact: both forms
    hold the same integer.
    """
    digits = acc[:, :-1]
    neg = digits[:, -1] < 0
    if not bool(neg.any()):
        return digits.clone()
    mag = det_normalize(torch.cat([-digits, torch.zeros_like(acc[:, -1:])], dim=1))[:, :-1]
    return torch.where(neg[:, None], -mag, digits)


def det_all_reduce_windowed(acc: LongAcc, group=None) -> tuple[LongAcc, int]:
    """:func:`det_all_reduce` that sends only the digit window any rank uses. Exact.

    One tiny all-reduce agrees on the lowest and highest digit in use (and whether any NaN/inf is
    present) across ranks; the int64 SUM then moves ``width`` words per element instead of 19.

    Returns:
        (the canonical sum, identical on every rank; bytes moved per element by the big reduce).
    """
    check_acc(acc)
    shape = acc.shape
    flat = acc.reshape(-1, acc.shape[-1])
    if not (dist.is_available() and dist.is_initialized()):
        return det_normalize(acc), 0
    signed = _signed_digits(flat)
    used = (signed != 0).any(0)
    idx = used.nonzero().flatten()
    nd = signed.shape[1]
    lo, hi = (int(idx[0]), int(idx[-1])) if idx.numel() else (nd, -1)
    special = int(bool((flat[:, -1] != 0).any()))
    bounds = torch.tensor([-lo, hi, special], dtype=torch.int64, device=acc.device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
    lo, hi, special = -int(bounds[0]), int(bounds[1]), int(bounds[2])
    cols = list(range(lo, hi + 1)) if hi >= lo else []
    payload = signed[:, lo : hi + 1]
    if special:
        payload = torch.cat([payload, flat[:, -1:]], dim=1)
    payload = payload.contiguous()
    if payload.numel():
        dist.all_reduce(payload, op=dist.ReduceOp.SUM, group=group)
    out = torch.zeros_like(flat)
    if cols:
        out[:, lo : hi + 1] = payload[:, : len(cols)]
    if special:
        out[:, -1] = payload[:, -1]
    return det_normalize(out).reshape(shape), payload.shape[1] * 8
