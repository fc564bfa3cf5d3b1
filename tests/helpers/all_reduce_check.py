"""Run under torchrun: windowed and full digit all-reduce against a local exact sum."""
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lightning_det.ops import det_all_reduce, det_combine, det_gemm_partial, to_digits  # noqa: E402
from lightning_det.ops.distributed import det_all_reduce_windowed  # noqa: E402


def inputs(rank: int, special: bool):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, 40, generator=g) * torch.pow(2.0, torch.randint(-30, 30, (6, 40), generator=g).float())
    w = torch.randn(5, 40, generator=g)
    acc = det_gemm_partial(x, w)
    if special and rank == 1:
        acc = det_combine([acc, to_digits(torch.full((6, 5), math.inf))])
    return acc


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for special in (False, True):
        local = det_combine([inputs(r, special) for r in range(world)])  # the exact sum, computed alone
        full = det_all_reduce(inputs(rank, special))
        windowed, nbytes = det_all_reduce_windowed(inputs(rank, special))
        assert torch.equal(full, local), "full all-reduce != local exact sum"
        assert torch.equal(windowed, local), "windowed all-reduce != local exact sum"
        assert nbytes < 19 * 8, nbytes
        if rank == 0:
            print(f"special={special}: windowed all-reduce exact, {nbytes} bytes per element (full: 152)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
