"""Run under torchrun (2 gloo ranks): collectives whose ranks disagree raise on every rank, and
cross-rank digit sums at the top digit's bound give the IEEE result, never a wrapped sign.

Every rank prints one line per case, ``rank R case NAME: ...``; tests/test_rank_agreement.py
reads them. A case that let a collective run with mismatched shapes would abort gloo (SIGABRT)
or hang, so reaching the final "done" line on both ranks is part of the check.
"""
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lightning_det.ops import det_all_reduce, det_finalize  # noqa: E402
from lightning_det.ops.distributed import det_all_reduce_windowed  # noqa: E402
from lightning_det.nn import StepState  # noqa: E402
from lightning_det.parallel.grad_sync import sync_gradients  # noqa: E402
from lightning_det.profile import NDIGITS, TOP_BITS, WORDS  # noqa: E402


def say(line: str) -> None:
    # one write per line: the two ranks share stdout, and a line must not be split by the other's
    os.write(1, (line + "\n").encode())


def expect_raise(rank: int, name: str, fn) -> None:
    try:
        fn()
    except RuntimeError as e:
        say(f"rank {rank} case {name}: raised: {' '.join(str(e).split())}")
    else:
        say(f"rank {rank} case {name}: did not raise")


def params_with_grads(shapes, dtype=torch.float32) -> list:
    out = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = torch.full(shape, 0.25 * (i + 1), dtype=dtype)
        out.append(p)
    return out


def top_acc(top: int) -> torch.Tensor:
    a = torch.zeros(1, WORDS, dtype=torch.int64)
    a[0, NDIGITS - 1] = top
    return a


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = 4 + rank  # rank 0 brings 4 elements, rank 1 brings 5
    acc = torch.zeros(n, WORDS, dtype=torch.int64)
    expect_raise(rank, "all_reduce_shape", lambda: det_all_reduce(acc))
    expect_raise(rank, "windowed_shape", lambda: det_all_reduce_windowed(acc))
    expect_raise(rank, "windowed_block", lambda: det_all_reduce_windowed(torch.zeros(4, WORDS, dtype=torch.int64),
                                                                         block=16 + rank))
    shapes = [(3, 4), (7,), (2, 2 + rank)]
    expect_raise(rank, "sync_shape", lambda: sync_gradients(params_with_grads(shapes), StepState()))
    expect_raise(rank, "sync_count", lambda: sync_gradients(params_with_grads(shapes[: 2 + rank]), StepState()))
    expect_raise(rank, "sync_dtype", lambda: sync_gradients(
        params_with_grads([(3,)], torch.bfloat16 if rank == 1 else torch.float32), StepState()))

    # The process group is still usable, and agreeing ranks still get the exact sum.
    same = sync_gradients(params_with_grads([(3, 4), (7,)]), StepState())
    say(f"rank {rank} case sync_agree: ok exact={same['exact'] + same['rounded_only']}")

    # Top digits that wrap int64 when summed word-wise: the sum is +-inf, never the other sign.
    big = 1 << 62
    for sign, label in ((1, "pos"), (-1, "neg")):
        full = det_finalize(det_all_reduce(top_acc(sign * big))).item()
        win = det_finalize(det_all_reduce_windowed(top_acc(sign * big))[0]).item()
        say(f"rank {rank} case top62_{label}: full={full} windowed={win}")
    # At the range edge: (2^40) + (2^40 - rank) stays in range when rank = 1, not for 2^40 + 2^40.
    half = 1 << (TOP_BITS - 1)
    edge = det_all_reduce(top_acc(half - rank))[0, NDIGITS - 1].item()
    past = det_finalize(det_all_reduce(top_acc(half))).item()
    say(f"rank {rank} case top_edge: edge={edge} expected={2 * half - 1} past={past}")
    dist.barrier()
    say(f"rank {rank} done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
