"""The headroom bounds of csrc/longacc.h, each at its edge and one past it.

Every bound is where a word-wise int64 sum of digits would wrap or carry into a neighbouring
field. Each test shows the naive word sum going wrong just past the bound (the control) and
the library's result equal to an exact Python-integer reference, or to the IEEE result the
format defines once the exact value leaves its range (an overflow to +-inf, never a wrapped
sign). The cross-rank sums are checked in tests/test_rank_agreement.py.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import assert_bitwise, cuda

from lightning_det.ops import det_combine, det_finalize, det_normalize, to_digits
from lightning_det.ops.distributed import MAX_WORLD_SIZE
from lightning_det.profile import COMBINE_MAX, NDIGITS, STATUS_BITS, TOP_BITS, WORDS
from lightning_det.reference.longacc_ref import ExactSum, digits_of, value_of_digits

TOP = NDIGITS - 1
INT64_MAX, INT64_MIN = (1 << 63) - 1, -(1 << 63)
_MASK = (1 << STATUS_BITS) - 1


def canonical_ref(words) -> list:
    """Canonical words of any int64 words, by Python integers: the exact value, the status
    counters read as flags, and the format's range rule (reference.longacc_ref.digits_of)."""
    s = ExactSum()
    s.n = value_of_digits(words)
    st = int(words[NDIGITS])
    s.nan = bool(st & _MASK)
    s.pinf = bool((st >> STATUS_BITS) & _MASK)
    s.ninf = bool((st >> 2 * STATUS_BITS) & _MASK)
    return digits_of(s)


def acc_with_top(top: int, low: int = 0) -> torch.Tensor:
    """A LongAcc whose digit 17 is ``top`` and digits 0..16 are ``low``."""
    a = torch.full((WORDS,), low, dtype=torch.int64)
    a[TOP] = top
    a[NDIGITS] = 0
    return a


def test_bounds_are_written_once_and_match_the_compiled_core():
    layout = list(torch.ops.ldet.layout())
    assert layout[5:7] == [TOP_BITS, COMBINE_MAX]
    assert COMBINE_MAX == (1 << STATUS_BITS) - 1 and MAX_WORLD_SIZE == COMBINE_MAX
    # the top digit of a full group stays inside int64 with room for a carry
    assert COMBINE_MAX * ((1 << TOP_BITS) - 1) + (1 << 32) < INT64_MAX


@pytest.mark.parametrize("n", [COMBINE_MAX, COMBINE_MAX + 1])
def test_status_counters_at_the_combine_bound(n):
    specials = to_digits(torch.tensor([math.inf, -math.inf, math.nan]))  # (3, 19), counters at 1
    got = det_combine([specials] * n)
    assert torch.equal(got, specials), got[:, NDIGITS]
    assert torch.equal(det_finalize(got).isnan(), torch.tensor([False, False, True]))
    assert det_finalize(got)[:2].tolist() == [math.inf, -math.inf]
    if n > COMBINE_MAX:  # control: one sum of them all carries each counter into the next one
        naive = det_finalize(specials * n)
        assert naive[0].item() == -math.inf and naive[2].item() == math.inf


def test_finite_sums_at_the_combine_bound_are_exact():
    # The largest canonical digits everywhere: the heaviest load a group can put on each word.
    top = (1 << (TOP_BITS - 22)) - 1  # small enough that COMBINE_MAX + 1 copies stay in range
    a = acc_with_top(top, low=(1 << 32) - 1)
    for n in (COMBINE_MAX, COMBINE_MAX + 1):
        s = ExactSum()
        s.n = n * value_of_digits(a.tolist())
        assert det_combine([a] * n).tolist() == digits_of(s)


@pytest.mark.parametrize("sign", [1, -1])
def test_top_digit_at_the_edge_of_the_range(sign):
    limit = 1 << TOP_BITS
    inside = acc_with_top(sign * (limit - 1))
    assert torch.equal(det_normalize(inside), inside)  # canonical, kept exactly
    half = acc_with_top(sign * (limit // 2))
    just_in = det_combine([half, acc_with_top(sign * (limit // 2 - 1))])
    assert just_in.tolist() == canonical_ref((half + acc_with_top(sign * (limit // 2 - 1))).tolist())
    assert just_in[TOP].item() == sign * (limit - 1)
    past = det_combine([half, half])  # one unit of digit 17 past the range: an overflow
    inf = to_digits(torch.tensor(sign * math.inf))
    assert torch.equal(past, inf) and past.tolist() == canonical_ref((half + half).tolist())
    # overflow is sticky as in IEEE arithmetic: inf + finite = inf, inf - inf = NaN (the exact
    # sum of these four would be 0)
    assert det_finalize(det_combine([past, acc_with_top(-sign * (limit // 2))])).item() == sign * math.inf
    opposite = det_combine([acc_with_top(-sign * (limit // 2))] * 2)
    assert math.isnan(det_finalize(det_combine([past, opposite])).item())


@pytest.mark.parametrize("sign", [1, -1])
def test_top_digits_at_2_62_do_not_wrap(sign):
    a = acc_with_top(sign * ((1 << 62) + 1))  # the sum of two is one past int64 either way
    expected = sign * math.inf
    naive = det_finalize(a + a)  # control: the int64 sum wraps to the other sign
    assert naive.item() == -expected
    assert det_finalize(a).item() == expected
    assert det_finalize(det_combine([a, a])).item() == expected
    assert det_finalize(det_combine([a, a]), torch.bfloat16).item() == expected


def test_every_word_at_int64_max():
    words = torch.full((WORDS,), INT64_MAX, dtype=torch.int64)
    assert math.isnan(det_finalize(words).item())  # the NaN counter is not zero
    digits_only = words.clone()
    digits_only[NDIGITS] = 0
    assert det_finalize(digits_only).item() == math.inf
    assert det_finalize(torch.full((WORDS,), INT64_MIN, dtype=torch.int64).index_fill(0, torch.tensor([NDIGITS]), 0)).item() == -math.inf
    assert det_normalize(digits_only).tolist() == canonical_ref(digits_only.tolist())


def _any_words(seed: int) -> list:
    rng = random.Random(seed)
    edges = [0, 1, -1, (1 << 32) - 1, 1 << 32, INT64_MAX, INT64_MIN, INT64_MAX - (1 << 31), INT64_MIN + (1 << 31)]
    rows = []
    for _ in range(400):
        row = [rng.choice(edges) if rng.random() < 0.5 else rng.randint(INT64_MIN, INT64_MAX)
               for _ in range(NDIGITS)]
        if rng.random() < 0.5:  # tops near the range edge, the rest canonical or not
            row[TOP] = rng.choice([1, -1]) * ((1 << TOP_BITS) + rng.randint(-3, 3))
        row.append(rng.choice([0, 0, 0, 1, 1 << STATUS_BITS, 1 << 2 * STATUS_BITS]))
        rows.append(row)
    return rows


def test_normalize_of_any_int64_words_matches_python_integers():
    rows = _any_words(7)
    got = det_normalize(torch.tensor(rows, dtype=torch.int64))
    assert got.tolist() == [canonical_ref(r) for r in rows]


@cuda
def test_cuda_normalize_and_finalize_past_the_bounds_match_the_cpu():
    words = torch.tensor(_any_words(8), dtype=torch.int64)
    assert torch.equal(det_normalize(words.cuda()).cpu(), det_normalize(words))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_bitwise(det_finalize(words.cuda(), dtype).cpu(), det_finalize(words, dtype), f"finalize {dtype}")
    specials = to_digits(torch.tensor([math.inf, -math.inf, math.nan], device="cuda"))
    assert torch.equal(det_combine([specials] * (COMBINE_MAX + 1)).cpu(), specials.cpu())
