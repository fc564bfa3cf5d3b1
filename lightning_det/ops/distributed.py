"""Cross-rank reduction of long accumulators: one int64 SUM all-reduce, then normalize."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .longacc import LongAcc, check_acc, det_normalize

__all__ = ["det_all_reduce", "MAX_WORLD_SIZE"]

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
