"""The digit format itself: to_digits, normalization, headroom bounds, specials, rounding."""
import math
import random

import pytest
import torch
from conftest import assert_bitwise

import gen
from lightning_det.ops import det_combine, det_finalize, det_gemm_partial, det_normalize, to_digits
from lightning_det.profile import NDIGITS, WORDS
from lightning_det.reference import longacc_ref as R

# The headroom bound written in csrc/longacc.h.
HEADROOM_ADDS = (1 << 31) - 2
LIMB_MAX = (1 << 32) - 1
INT64_MAX = (1 << 63) - 1


def canonical_from_int(n):
    s = R.ExactSum()
    s.n = n
    return R.digits_of(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_to_digits_exact(dtype):
    vals = torch.cat([gen.normal((50,), torch.float32, 1), gen.wide_exponents((50,), -149, 127, seed=2),
                      torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 2.0 ** -149, -(2.0 ** -149)])]).to(dtype)
    got = to_digits(vals)
    ref = []
    for v in vals.double().tolist():
        s = R.ExactSum()
        s.add_value(v)
        ref.append(R.digits_of(s))
    assert torch.equal(got, torch.tensor(ref, dtype=torch.int64))
    assert_bitwise(det_finalize(got, dtype), vals.masked_fill(vals == 0, 0.0).masked_fill(vals.isnan(), math.nan), "round trip")


def test_normalize_matches_python_and_is_canonical():
    rng = random.Random(0)
    for _ in range(200):
        # the top digit inside the format's range (tests/test_digit_bounds.py goes past it)
        words = [rng.randint(-(1 << 62), 1 << 62) for _ in range(NDIGITS - 1)]
        words += [rng.randint(-(1 << 40), 1 << 40), 0]
        n = R.value_of_digits(words)
        got = det_normalize(torch.tensor([words], dtype=torch.int64))[0].tolist()
        assert got == canonical_from_int(n)
        assert R.value_of_digits(got) == n


def test_headroom_bound_edge():
    # From canonical form, HEADROOM_ADDS limbs of the largest magnitude keep every digit in int64,
    # and normalization of that extreme state is still exact ...
    top = LIMB_MAX + HEADROOM_ADDS * LIMB_MAX
    bottom = 0 - HEADROOM_ADDS * LIMB_MAX
    assert top <= INT64_MAX - (1 << 32) and bottom >= -INT64_MAX + (1 << 32)
    # ... while two more such additions would overflow: the bound is tight, not generous.
    assert LIMB_MAX + (HEADROOM_ADDS + 2) * LIMB_MAX > INT64_MAX
    # Digits 0..16 at the extremes; the top digit stays inside the format's range, which
    # tests/test_digit_bounds.py checks at its own edge.
    for fill in (top, bottom):
        words = [fill] * (NDIGITS - 1) + [0, 0]
        n = R.value_of_digits(words)
        got = det_normalize(torch.tensor([words], dtype=torch.int64))[0].tolist()
        assert got == canonical_from_int(n), f"normalize at the edge ({fill})"
    # Alternating extremes, the worst case for carries in both directions.
    words = [top if i % 2 else bottom for i in range(NDIGITS - 1)] + [0, 0]
    got = det_normalize(torch.tensor([words], dtype=torch.int64))[0].tolist()
    assert got == canonical_from_int(R.value_of_digits(words))


@pytest.mark.parametrize("interval", [1, 2, 3, 7])
def test_in_kernel_normalization_does_not_change_results(interval):
    # fp32 data with a wide spread sends many rounding errors into the digits, so a tiny
    # normalization interval exercises the mid-accumulation carry path over and over.
    x, w = gen.wide_exponents((6, 300), -90, 90, seed=3), gen.wide_exponents((5, 300), -90, 90, seed=4)
    base = det_gemm_partial(x, w)
    assert torch.equal(det_gemm_partial(x, w, _norm_interval=interval), base)
    assert torch.equal(base, R.gemm_digits(x, w))


def test_combine_many_and_specials_counters():
    accs = [to_digits(gen.wide_exponents((4,), -100, 100, seed=i)) for i in range(300)]
    total = R.ExactSum()
    comb = det_combine(accs)
    for i in range(4):
        s = R.ExactSum()
        for a in accs:
            s.n += R.value_of_digits(a[i].tolist())
        assert comb[i].tolist() == R.digits_of(s)
    # status words are counters: +inf from one part, -inf from another gives NaN
    p = to_digits(torch.tensor([math.inf, 1.0]))
    n = to_digits(torch.tensor([-math.inf, math.inf]))
    out = det_finalize(det_combine([p, n]))
    assert math.isnan(out[0].item()) and out[1].item() == math.inf


def test_signed_zero_and_underflow_rules():
    zero = det_finalize(det_combine([to_digits(torch.tensor([1.5])), to_digits(torch.tensor([-1.5]))]))
    assert zero.item() == 0.0 and not math.copysign(1.0, zero.item()) < 0, "exact zero is +0.0"
    # a negative value below half the smallest subnormal rounds to -0.0 (IEEE), not to +0.0
    x = torch.tensor([[-(2.0 ** -149)]])
    w = torch.tensor([[2.0 ** -10]])
    tiny = det_finalize(det_gemm_partial(x, w))
    assert tiny.item() == 0.0 and math.copysign(1.0, tiny.item()) < 0


def test_equal_values_have_equal_bytes():
    # 3 = 1 + 2 built three different ways gives the same canonical words
    a = det_combine([to_digits(torch.tensor([1.0])), to_digits(torch.tensor([2.0]))])
    b = det_gemm_partial(torch.tensor([[1.5, 0.75]]), torch.tensor([[1.0, 2.0]]))[0]
    c = det_combine([to_digits(torch.tensor([5.0])), to_digits(torch.tensor([-2.0]))])
    assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finalize_with_power_of_two_scale_rounds_once(dtype):
    accs = det_combine([to_digits(gen.wide_exponents((64,), -149, 127, seed=s)) for s in range(5)])
    # include values whose halving lands on fp32 ties and subnormals
    edge = to_digits(torch.tensor([2.0 ** -148 * 3, 1.0 + 2.0 ** -23, 2.0 ** -149, -(2.0 ** -147) * 5]))
    for acc in (accs, edge):
        for k in (0, 1, 2, 5, 40):
            got = det_finalize(acc, dtype, scale_exp=-k)
            ref = R.tensor_of([R.round_scaled(R.value_of_digits(a.tolist()), dtype, k) for a in acc], dtype, got.shape)
            assert_bitwise(got, ref, f"scale 2^-{k}")
    with pytest.raises(ValueError, match=r"^scale_exp: expected an integer in \[-64, 0\]"):
        det_finalize(accs, scale_exp=1)
