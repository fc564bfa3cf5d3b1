"""det_gemm / det_gemm_partial against the independent Python-integer reference."""
import math

import pytest
import torch
from conftest import assert_bitwise

import gen
from lightning_det.ops import det_finalize, det_gemm, det_gemm_partial
from lightning_det.reference import longacc_ref as R

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_against_reference(x, w, bias=None, what=""):
    got_acc = det_gemm_partial(x, w, bias)
    ref_acc = R.gemm_digits(x, w, bias)
    assert torch.equal(got_acc, ref_acc), f"{what}: digits differ from the Python-integer reference"
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert_bitwise(det_finalize(got_acc, dt), R.gemm_rounded(x, w, bias, dt), f"{what} finalize {dt}")
    assert_bitwise(det_gemm(x, w, bias), R.gemm_rounded(x, w, bias), f"{what} det_gemm")


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_normal_odd_shape(dtype):
    x, w = gen.normal((5, 123), dtype, 1), gen.normal((7, 123), dtype, 2)
    check_against_reference(x, w, gen.normal((7,), dtype, 3), f"normal {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_exponent_range(dtype):
    lo, hi = (-60, 60) if dtype == torch.float32 else (-60, 60)
    x, w = gen.wide_exponents((4, 97), lo, hi, dtype, 4), gen.wide_exponents((5, 97), lo, hi, dtype, 5)
    check_against_reference(x, w, what=f"wide {dtype}")


def test_full_fp32_range_extremes():
    x = gen.wide_exponents((3, 64), -149, 127, torch.float32, 6)
    w = gen.wide_exponents((4, 64), -149, 127, torch.float32, 7)
    x[0, :4] = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max, 1e-45, -1e-45])
    check_against_reference(x, w, what="full range")


def test_subnormals():
    x, w = gen.subnormals((4, 80), torch.float32, 8), gen.normal((3, 80), torch.float32, 9)
    check_against_reference(x, w, what="subnormal x normal")
    x2 = gen.wide_exponents((3, 40), -25, -1, torch.float32, 10)
    check_against_reference(gen.subnormals((2, 40), seed=11), x2, what="subnormal x small")


def test_subnormal_results_round_exactly():
    # Results landing in fp32's subnormal range, including a tie at the smallest subnormal.
    t = 2.0 ** -149
    x = torch.tensor([[t, t], [3 * t, 0.0], [t, -t]], dtype=torch.float32)
    w = torch.tensor([[0.5, 0.25], [0.5, 0.0]], dtype=torch.float32)
    check_against_reference(x, w, what="subnormal results")


def test_massive_cancellation():
    for seed in range(4):
        x, w = gen.cancellation(seed=seed)
        check_against_reference(x, w, what=f"cancellation {seed}")
        # the control: an fp64 accumulation gets these wrong
        fp64 = (x.double() @ w.double().T).float()
        assert not torch.equal(fp64, det_gemm(x, w)), "control: fp64 accumulation should fail here"


def test_ties_and_just_above_ties():
    one = 1.0
    cases = [
        ([one, 2.0 ** -24], "tie rounds to even (down)"),
        ([one + 2.0 ** -23, 2.0 ** -24], "tie rounds to even (up)"),
        ([one, 2.0 ** -24, 2.0 ** -80], "just above a tie"),
        ([one, 2.0 ** -24, -(2.0 ** -80)], "just below a tie"),
        ([-one, -(2.0 ** -24), -(2.0 ** -90)], "negative just above a tie"),
    ]
    for terms, what in cases:
        x = torch.tensor([terms], dtype=torch.float32)
        w = torch.ones(1, len(terms), dtype=torch.float32)
        check_against_reference(x, w, what=what)
    # fp64 accumulation then a cast to fp32 double-rounds the "just above" case
    x = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -80]])
    w = torch.ones(1, 3)
    wrong = (x.double() @ w.double().T).float()
    right = det_gemm(x, w)
    assert right.item() == 1.0 + 2.0 ** -23 and wrong.item() == 1.0


def test_overflow_to_inf_and_back():
    big = torch.finfo(torch.float32).max
    x = torch.tensor([[big, big], [big, -big], [big, big]], dtype=torch.float32)
    w = torch.tensor([[1.0, 1.0], [1.0, 0.5]], dtype=torch.float32)
    check_against_reference(x, w, what="overflow")
    # an intermediate far beyond fp32 range that cancels back into range is exact
    x2 = torch.tensor([[big, 3.0, -big]])
    w2 = torch.tensor([[big, 1.0, big]])
    assert det_gemm(x2, w2).item() == 3.0


def test_nan_and_inf_inputs():
    inf, nan = math.inf, math.nan
    x = torch.tensor(
        [[inf, 1.0, 2.0], [inf, 1.0, 0.0], [nan, 1.0, 1.0], [inf, -inf, 1.0], [1.0, 2.0, 3.0], [-inf, 1.0, 1.0]],
        dtype=torch.float32,
    )
    w = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [2.0, 1.0, inf]], dtype=torch.float32)
    check_against_reference(x, w, what="specials")
    y = det_gemm(x, w)
    assert math.isnan(y[1, 1].item()), "inf x 0 gives NaN"
    assert y[0, 0].item() == math.inf and y[5, 0].item() == -math.inf
    assert math.isnan(y[3, 0].item()), "+inf + -inf gives NaN"


def test_bias_is_added_before_the_single_rounding():
    x = torch.tensor([[1.0, 2.0 ** -24]])
    w = torch.ones(1, 2)
    b = torch.tensor([2.0 ** -70])
    # exact: 1 + 2^-24 + 2^-70 -> rounds up; rounding before adding the bias would give 1.0
    assert det_gemm(x, w, b).item() == 1.0 + 2.0 ** -23
    check_against_reference(gen.normal((3, 33), seed=1), gen.normal((4, 33), seed=2), gen.wide_exponents((4,), -30, 30, seed=3), "bias")


def test_large_k_beyond_2_19():
    K = (1 << 20) + 7
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, K, generator=g)
    w = (torch.randn(1, K, generator=g) * 1e-3).to(torch.bfloat16)
    got = det_gemm(x, w)
    # reference without Python loops over K-by-output: exact integer dot via scaled ints
    for i in range(2):
        s = R.ExactSum()
        for a, b in zip(x[i].double().tolist(), w[0].double().tolist()):
            s.add_product(a, b)
        assert got[i, 0].item() == R.round_sum(s), f"row {i}"


@pytest.mark.parametrize("K", [31, 33, 100])
def test_fp32_split_segment_edges(K):
    # fp32 inputs run as four piece segments of K columns each (csrc/split.h). The kernels
    # move the running sum into the digits where a segment ends, which for these K falls inside a
    # 32-wide K-block; M, N give full 4 x 8 CPU tiles and ragged ones.
    x, w = gen.normal((9, K), torch.float32, 50 + K), gen.normal((10, K), torch.float32, 60 + K)
    x[2] *= 2.0 ** 20  # one row far larger, so the later segments' bits sit well below it
    check_against_reference(x, w, what=f"fp32 split K={K}")
    assert torch.equal(det_gemm_partial(x, w, _norm_interval=1), R.gemm_digits(x, w)), "normalize every add"


def test_fp32_epilogue_from_the_running_sum_edges():
    # When no digit was ever needed the CPU kernel rounds the fp64 running sum straight to fp32.
    # Sums that land on fp32 subnormals, on exact rounding ties, beyond the fp32 range, exactly on
    # zero (+0.0, never -0.0) and a negative subnormal must round exactly as the reference does.
    b = torch.bfloat16
    x = torch.zeros(8, 32, dtype=b)
    w = torch.zeros(8, 32, dtype=b)
    x[0, :3], w[0, :3] = torch.tensor([2.0 ** -70, 3 * 2.0 ** -72, 2.0 ** -75]), torch.tensor([2.0 ** -70, 2.0 ** -69, 1.0])
    x[1, :2], w[1, :2] = torch.tensor([1.0, 2.0 ** -24]), torch.tensor([1.0, 1.0])  # 1 + 2^-24: a tie
    x[2, :2], w[2, :2] = torch.tensor([1.0, 3 * 2.0 ** -25]), torch.tensor([1.0, 1.0])  # above the tie
    x[3, :2], w[3, :2] = torch.tensor([2.0 ** 100, 2.0 ** 100]), torch.tensor([2.0 ** 28, 2.0 ** 28])  # 2^129
    x[4, :2], w[4, :2] = torch.tensor([1.5, -1.5]), torch.tensor([2.0, 2.0])  # exact zero
    x[5, 0], w[5, 0] = -(2.0 ** -75), 2.0 ** -75  # -2^-150: rounds to -0.0 or the smallest subnormal
    x[6, 0], w[6, 0] = -(3 * 2.0 ** -76), 2.0 ** -74  # -3 * 2^-150
    x[7, 0], w[7, 0] = 2.0 ** 127, 1.5  # 1.5 * 2^127: finite, just inside the range
    check_against_reference(x, w, what="epilogue edges")
    got = det_gemm(x, w)
    assert not torch.signbit(got[4, 4]), "an exact zero must come out as +0.0"


@pytest.mark.parametrize("scale_exp", [0, -65, 126])
@pytest.mark.parametrize("tail", [1.0, -1.0])
def test_fp32_split_pair_rounding_near_ties(scale_exp, tail):
    # fp32 inputs run as four K-segments of pieces cut at 2^(E - 17), E the exponent of the
    # row block's largest value (csrc/split.h). Each segment's running sum stays
    # exact without the digits, but their total spans more than 53 bits, so the epilogue
    # adds them into an exact pair hi + lo and rounds that to fp32 directly unless hi sits on an
    # fp32 rounding tie (or the overflow edge). Here hi lands exactly on a tie while lo (from the
    # xh*wl, xl*wh and xl*wl segments, 2^-56 below) is non-zero either way: one row for each
    # base, once just above and once just below the tie. scale_exp 126 puts one base on the fp32
    # overflow threshold; -65 gives subnormal fp32 results.
    x, w = gen.fp32_pair_ties(scale_exp, tail)
    got = det_gemm(x, w)
    ref = R.gemm_rounded(x, w)
    assert_bitwise(got, ref, f"pair rounding near ties, scale 2^{scale_exp}, tail {tail}")
    check_against_reference(x, w, what="pair rounding near ties")
    # control: rounding the fp64 sum of the products once more to fp32 misses these ties
    if scale_exp == 0:
        twice = (x.double() @ w.double().T).float()
        assert not torch.equal(twice.diagonal(), got.diagonal())


def test_fp32_split_values_at_every_cut_offset():
    # The fp32 split cuts each value at 2^(E - 17), E the exponent of its row block's largest
    # value (csrc/split.h), with integer masks on the bit patterns. Values from 2 bits above the
    # cut to 26 below it (partly cut, wholly below, full 24-bit significands), blocks whose
    # largest value is subnormal, all-zero blocks and a K that ends inside a block: any wrong
    # mask (one reaching the exponent field, a sign lost) changes x = xh + xl and the sum.
    K = 32 * 3 + 7
    x = torch.zeros(4, K, dtype=torch.float32)
    g = torch.Generator().manual_seed(70)
    mant = 1 + torch.randint(0, 2 ** 23, (4, K), generator=g).double() * 2.0 ** -23  # full significands
    sign = torch.randint(0, 2, (4, K), generator=g).double() * 2 - 1
    for r, top in enumerate([0, 100, -126, -140]):  # normal blocks, a large one, subnormal maxima
        for j in range(K):
            i = j % 32  # i = 0: the block's largest value; i = 1..17 cut inside, 18..31 wholly below
            x[r, j] = float(sign[r, j] * mant[r, j] * 2.0 ** max(top - i, -149))
    x[2, 32:64] = 0.0  # an all-zero block
    assert torch.isfinite(x).all()
    w = gen.normal((3, K), torch.float32, 71)
    w[1] = x[3] * 2.0 ** 100  # both operands cut
    check_against_reference(x, w, what="fp32 split cut offsets")
    check_against_reference(w, x, what="fp32 split cut offsets, swapped")
