"""Run under torchrun: the windowed digit all-reduce against the full one and an exact sum computed alone.

Every rank builds every rank's input (deterministic seeds), so each can compute the exact sum by
itself twice: with det_combine and with Python integers (lightning_det.reference). Each case
prints one line from rank 0:

    case NAME: exact, bytes=B.BB per element, fallback_blocks=F of N, fast_blocks=K

and, first, one line for sync_gradients (the det_ddp gradient path) at three bucket sizes.
"""
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lightning_det.nn import StepState  # noqa: E402
from lightning_det.ops import det_all_reduce, det_combine, det_finalize, det_gemm_partial, to_digits  # noqa: E402
from lightning_det.parallel.grad_sync import sync_gradients  # noqa: E402
from lightning_det.ops.distributed import det_all_reduce_windowed  # noqa: E402
from lightning_det.profile import NDIGITS, STATUS_BITS, WORDS  # noqa: E402
from lightning_det.reference.longacc_ref import ExactSum, digits_of, value_of_digits  # noqa: E402


def exact_sum_reference(accs: list) -> torch.Tensor:
    """Canonical words (n, 19) of the elementwise sum of LongAccs (each (n, 19)), by Python integers.

    Independent of the compiled core and of the packing: each value is read as an integer, the
    integers are added, and the result is written back with the reference's digits_of.
    """
    mask = (1 << STATUS_BITS) - 1
    rows = [a.reshape(-1, WORDS).tolist() for a in accs]
    out = []
    for per_rank in zip(*rows):
        s = ExactSum()
        for words in per_rank:
            s.n += value_of_digits(words)
            st = words[NDIGITS]
            s.nan |= bool(st & mask)
            s.pinf |= bool((st >> STATUS_BITS) & mask)
            s.ninf |= bool((st >> 2 * STATUS_BITS) & mask)
        out.append(digits_of(s))
    return torch.tensor(out, dtype=torch.int64)


def _gen(rank: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * salt + rank)


def real_like(rank: int) -> torch.Tensor:
    """Gradient digits as a det_ddp step makes them: exact dW = g^T x and db = g^T 1 of one rank's batch."""
    g = _gen(rank, 1)
    x = torch.randn(48, 160, generator=g)  # activations
    go = torch.randn(48, 96, generator=g) * 2.0**-10  # output gradients of a mean loss
    dw = det_gemm_partial(go.t().contiguous(), x.t().contiguous())  # (96, 160, 19)
    db = det_gemm_partial(go.t().contiguous(), torch.ones(1, 48))  # (96, 1, 19)
    rounded = to_digits(torch.randn(700, generator=g) * 2.0**-12)  # a module outside digit mode
    return torch.cat([dw.reshape(-1, WORDS), db.reshape(-1, WORDS), rounded])


def wide_exponents(rank: int) -> torch.Tensor:
    """Real-like blocks, two of them with one outlier each (2^-140, 2^100), then blocks holding every
    fp32 exponent: those windows need more bits than a field may have, the rest still fit."""
    g = _gen(rank, 2)
    v = torch.randn(1280, generator=g) * 2.0**-10
    v[300 + rank] = 2.0**-140
    v[1000] = 2.0**100 * (rank - 1)
    spread = torch.randn(512, generator=g) * torch.pow(2.0, torch.randint(-149, 127, (512,), generator=g).float())
    return torch.cat([to_digits(v), to_digits(spread)])


def specials(rank: int) -> torch.Tensor:
    """Real-like data with NaN on rank 1, +inf on ranks 0 and 2, -inf on rank 2 (some in one element)."""
    v = torch.randn(1300, generator=_gen(rank, 3)) * 2.0**-8
    if rank == 1:
        v[7] = math.nan
    if rank in (0, 2):
        v[600] = math.inf
    if rank == 2:
        v[601] = -math.inf
        v[600 + 256] = -math.inf
    return to_digits(v)


def zeros(rank: int) -> torch.Tensor:
    return torch.zeros(1000, WORDS, dtype=torch.int64)


def one_rank_nonzero(rank: int) -> torch.Tensor:
    v = torch.randn(777, generator=_gen(0, 4)) if rank == 0 else torch.zeros(777)
    return to_digits(v)


def mixed_magnitudes(rank: int) -> torch.Tensor:
    """Runs of 300 elements at 2^-100, 1 and 2^100 (blocks straddle them), then per-element scales."""
    g = _gen(rank, 5)
    i = torch.arange(3000)
    runs = torch.pow(2.0, 100.0 * ((i // 300) % 3 - 1).float())
    each = torch.pow(2.0, 30.0 * (i % 5 - 2).float())
    return to_digits(torch.cat([torch.randn(3000, generator=g) * runs, torch.randn(3000, generator=g) * each]))


def rank_magnitudes(rank: int) -> torch.Tensor:
    """The same real-like gradients, scaled by 2^-80, 1 and 2^80 on ranks 0, 1, 2."""
    g = _gen(rank, 6)
    x = torch.randn(16, 64, generator=g) * 2.0 ** (80 * (rank - 1))
    w = torch.randn(40, 64, generator=g)
    return det_gemm_partial(x, w).reshape(-1, WORDS)


def cancelling(rank: int) -> torch.Tensor:
    """Rank 1 holds minus rank 0's values, rank 2 holds their tiny multiples: the sum is rank 2's."""
    v = torch.randn(1100, generator=_gen(0, 7)) * 2.0**-20
    scale = {0: 1.0, 1: -1.0}.get(rank, 2.0**-100)
    return to_digits(v * scale)


CASES = {
    "real_like": real_like,
    "wide_exponents": wide_exponents,
    "specials": specials,
    "zeros": zeros,
    "one_rank_nonzero": one_rank_nonzero,
    "mixed_magnitudes": mixed_magnitudes,
    "rank_magnitudes": rank_magnitudes,
    "cancelling": cancelling,
}


def check(name, make, rank: int, world: int, block=None) -> None:
    inputs = [make(r) for r in range(world)]
    reference = exact_sum_reference(inputs)
    local = det_combine(inputs)
    full = det_all_reduce(inputs[rank])
    stats = {}
    kwargs = {} if block is None else {"block": block}
    windowed, nbytes = det_all_reduce_windowed(inputs[rank], stats=stats, **kwargs)
    assert torch.equal(local, reference), f"{name}: det_combine != Python-integer exact sum"
    assert torch.equal(full, reference), f"{name}: full all-reduce != exact sum"
    if not torch.equal(windowed, reference):
        bad = (windowed != reference).any(1).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{name}: windowed all-reduce != exact sum at elements {bad}")
    # every rank got the same bytes, and the byte count is the real buffer sizes
    gathered = [None] * world
    dist.all_gather_object(gathered, (windowed.sum().item(), stats["bytes"]))
    assert len(set(gathered)) == 1, gathered
    assert abs(nbytes * reference.shape[0] - stats["bytes"]) < 1e-6 * stats["bytes"] + 1e-9
    if rank == 0:
        label = name if block is None else f"{name}_block{block}"
        print(f"case {label}: exact, bytes={nbytes:.2f} per element, fallback_blocks={stats['fallback_blocks']} "
              f"of {stats['blocks']}, fast_blocks={stats['fast_blocks']}", flush=True)


def grad_params(rank: int):
    """Parameters and their step state as a det_ddp step leaves them: digit gradients (a weight,
    a bias, one of NaN), one with only a rounded .grad (a module outside digit mode) and one that
    got no gradient."""
    shapes = [(96, 160), (96,), (300,), (5, 7), (33,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    state = StepState()
    d = real_like(rank)
    state.add_grad_digits(params[0], d[: 96 * 160].reshape(96, 160, WORDS).clone())
    state.add_grad_digits(params[1], d[96 * 160 : 96 * 161].reshape(96, WORDS).clone())
    state.add_grad_digits(params[2], specials(rank)[:300].clone())
    params[3].grad = torch.randn(5, 7, generator=_gen(rank, 8)) * 2.0 ** (-20 * rank)
    return params, state


def check_sync_buckets(rank: int, world: int) -> None:
    """sync_gradients gives the exact sum rounded once whatever its bucket size: one element per
    bucket (every parameter alone, the large one over the limit), a limit inside a parameter and
    one bucket for all; against det_finalize of the Python-integer sum of every rank's digits."""
    every = [grad_params(r) for r in range(world)]
    want = []
    for i, p in enumerate(every[0][0]):
        accs = [st.grad_digits(ps[i]) if st.grad_digits(ps[i]) is not None
                else to_digits(ps[i].grad) if ps[i].grad is not None
                else torch.zeros((*p.shape, WORDS), dtype=torch.int64) for ps, st in every]
        want.append(det_finalize(exact_sum_reference(accs).reshape(*p.shape, WORDS), torch.float32))
    for bucket in (1, 400, 1 << 20):
        params, state = grad_params(rank)
        stats = sync_gradients(params, state, bucket_elements=bucket)
        assert stats["exact"] == 3 and stats["rounded_only"] == 1, stats
        assert stats["elements"] == sum(p.numel() for p in params), stats
        for i, p in enumerate(params):
            assert state.grad_digits(p) is None, f"param {i}: digits kept after the sync"
            same = torch.equal(p.grad.view(torch.int32), want[i].view(torch.int32))  # bit patterns: NaN == NaN
            assert same, f"bucket_elements={bucket}: param {i} != exact sum rounded once"
    if rank == 0:
        print("sync_gradients: exact for bucket_elements 1, 400, 1048576", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    check_sync_buckets(rank, world)
    for name, make in CASES.items():
        check(name, make, rank, world)
    # odd block sizes: partial last blocks, one-element blocks
    check("real_like", real_like, rank, world, block=7)
    check("specials", specials, rank, world, block=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
