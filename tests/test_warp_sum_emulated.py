"""The CUDA norms' row sums (warp_row_sum_fp32, csrc/cuda/warp_digits.cuh), run on the CPU under
the emulation of tests/csrc/cuda_emu.h: each row's result is its exact sum rounded once to fp32
(Python fractions), whether the fp64 sum and its error bound decided it or the digits did, in
every order of the warp's threads. The rows include sums that an fp64 sum rounds wrongly, so a
fast path that trusted it without its bound would fail here, and ties and bf16/fp16 sums that the
exact path decides, so a wrong exactness certificate would too. The hardware's own run is
tests/test_norm_op.py's CUDA tests (CPU == CUDA)."""
import pytest
import torch
from helpers.cuda_emu import load_warp_sum_emu
from helpers.exact_ref import exact_sum, round32

import gen


@pytest.fixture(scope="module")
def emu():
    return load_warp_sum_emu()


def _padded(width, *vals):
    r = torch.zeros(width, dtype=torch.float64)
    r[: len(vals)] = torch.tensor(vals, dtype=torch.float64)
    return r


def _rows(width: int) -> torch.Tensor:
    """fp64 terms of the kinds the norms form: fp32 values and exact products of two."""
    x = gen.normal((6, width), torch.float32, 1).double()
    y = gen.normal((6, width), torch.float32, 2).double()
    wide = gen.wide_exponents((4, width), -60, 60, seed=3).float().double()
    boundary = torch.stack([
        _padded(width, 1.0, 2.0**-24, 2.0**-60),       # just above a midpoint: fp64 loses 2^-60
        _padded(width, 1.0, 2.0**-24, -(2.0**-60)),    # just below it
        _padded(width, 1.0, 2.0**-24),                 # on it: ties to even (down)
        _padded(width, 1.0 + 2.0**-23, 2.0**-24),      # on one: ties to even (up)
        _padded(width, -1.0, -(2.0**-24)),             # a negative tie
        _padded(width, 2.0**52, 1.0, 2.0**-1),         # too wide for the exact path
        _padded(width, 3.0, -3.0),                     # an exact zero from nonzero terms
        _padded(width, 1.0, -1.0, 2.0**-140),          # cancels to an fp32 subnormal
        _padded(width, 2.0**100, 1.0, -(2.0**100), 2.0**-20),
        torch.full((width,), -0.0, dtype=torch.float64),
        torch.zeros(width, dtype=torch.float64),
    ])
    # sums of 16-bit values: many are ties or fp32 values, which the error bound cannot decide
    # (the exact path's rows)
    b16 = gen.normal((6, width), torch.bfloat16, 4).double()
    f16 = gen.normal((4, width), torch.float16, 5).double()
    return torch.cat([x, x * y, x * x, wide, boundary, b16, f16])


@pytest.mark.parametrize("width", [5, 33, 768, 1100])
@pytest.mark.parametrize("order", [0, 1, 2], ids=["ascending", "descending", "shuffled"])
def test_row_sums_are_the_exact_sums_rounded_once(emu, width, order):
    rows = _rows(width)
    got = emu.warp_row_sums(rows, order)
    want = torch.tensor([round32(exact_sum(r.tolist())) for r in rows], dtype=torch.float32)
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten().tolist()
    assert not bad, [(i, got[i].item(), want[i].item()) for i in bad]


def test_control_an_fp64_sum_rounded_to_fp32_is_wrong_on_the_boundary_rows():
    row = _padded(33, 1.0, 2.0**-24, 2.0**-60)
    assert float(torch.tensor(row.sum().item(), dtype=torch.float32)) != round32(exact_sum(row.tolist()))


def test_control_bf16_rows_hold_ties_that_no_error_bound_decides():
    """The exact path's rows exist: some bf16 sums of width 768 lie exactly halfway between two
    fp32 values, where any fp64 sum with a nonzero error bound straddles the boundary."""
    import math
    from fractions import Fraction

    rows = gen.normal((64, 768), torch.bfloat16, 4).double()
    ties = 0
    for r in rows:
        s = exact_sum(r.tolist())
        f = Fraction(round32(s))
        ulp = Fraction(2) ** (math.frexp(float(f))[1] - 24) if f else Fraction(0)
        ties += abs(Fraction(s) - f) * 2 == ulp and ulp != 0
    assert ties > 0
