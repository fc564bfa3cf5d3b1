"""The digit all-reduces are exact: full and windowed against det_combine and a Python-integer sum.

The multi-process test runs tests/helpers/all_reduce_check.py over 3 gloo processes. The
single-process tests drive the windowed packing (lightning_det.ops.digit_window) by hand: they
take the MAX of the ranks' agreements and the SUM of their payloads themselves, which reaches
world sizes up to MAX_WORLD_SIZE and data chosen to sit on every bound.
"""
import random
import re
import sys

import pytest
import torch

from conftest import run_cmd
from helpers.all_reduce_check import exact_sum_reference
from lightning_det.ops import det_normalize, to_digits
from lightning_det.ops import digit_window as dw
from lightning_det.ops.distributed import MAX_WORLD_SIZE
from lightning_det.profile import WORDS
from lightning_det.reference.longacc_ref import ExactSum, digits_of, value_of_digits


def acc_of(values) -> torch.Tensor:
    """Canonical LongAcc words (n, 19) of Python integers (units of 2^-298), by the reference."""
    rows = []
    for v in values:
        s = ExactSum()
        s.n = v
        rows.append(digits_of(s))
    return torch.tensor(rows, dtype=torch.int64)


def simulate(accs, counts=None, block=16):
    """The windowed reduce with the collectives done here: ``counts[i]`` ranks hold ``accs[i]``.

    Returns:
        (canonical sum (n, 19), plan, the largest limb any rank sent). Asserts that every limb is
        in [0, 2^L) and that the int64 SUM did not overflow (the limbs are non-negative, so an
        overflow would wrap negative).
    """
    counts = counts or [1] * len(accs)
    agreed = torch.stack([dw.block_agreement(a, block) for a in accs]).amax(0)
    plan = dw.plan_windows(agreed, accs[0].shape[0], sum(counts), block)
    payloads = [dw.pack(a, plan) for a in accs]
    peak = 0
    for p in payloads:
        limbs = p[: plan.fast_words]
        assert bool((limbs >= 0).all()) and bool((limbs >> plan.limb_bits == 0).all())
        peak = max(peak, int(limbs.max()) if limbs.numel() else 0)
    summed = sum(p * c for p, c in zip(payloads, counts))
    assert bool((summed[: plan.fast_words] >= 0).all()), "int64 SUM overflowed"
    return dw.unpack(summed, plan), plan, peak


def reference(accs, counts=None) -> torch.Tensor:
    """exact_sum_reference with multiplicities (world sizes too large to list)."""
    counts = counts or [1] * len(accs)
    if all(c == 1 for c in counts):
        return exact_sum_reference(accs)
    rows = []
    for per_rank in zip(*[a.tolist() for a in accs]):
        s = ExactSum()
        s.n = sum(c * value_of_digits(w) for w, c in zip(per_rank, counts))
        rows.append(digits_of(s))
    return torch.tensor(rows, dtype=torch.int64)


def edge_values(rng: random.Random, block: int = 16) -> list:
    """Blocks whose elements sit on their window's bounds: v in {2^(B-1) - 1, -2^(B-1)} * 2^lo and
    random values inside, for window widths and offsets around every 32-bit and limb boundary."""
    values = []
    for lo in (0, 1, 31, 32, 33, 63, 64, 250, 400):
        for width in (1, 2, 31, 32, 33, 61, 62, 63, 64, 65, 124, 125, 190, 230):
            if lo + width - 1 + 3 > dw.TOP_BIT:
                continue
            top, bottom = (1 << (width - 1)) - 1, -(1 << (width - 1))
            inside = [rng.randrange(bottom, top + 1) for _ in range(block - 4)]
            values += [v << lo for v in [top, bottom, bottom | 1 if width > 1 else bottom, 0, *inside]]
    return values


def test_element_bounds_match_python_integers():
    rng = random.Random(0)
    # 1 << 584: past TOP_BIT, still inside the format's range (top digit below 2^41)
    values = [0, 1, -1, 2, -2, 3, -3, (1 << 575) - 1, -(1 << 575), 1 << 584, -(1 << 584) + 1]
    for _ in range(600):
        bits, shift = rng.randrange(1, 300), rng.randrange(0, 280)
        values.append(rng.choice((1, -1)) * (rng.getrandbits(bits) | 1) << shift)
        values.append(-(1 << rng.randrange(0, 570)))
    acc = acc_of(values)
    assert torch.equal(det_normalize(acc), acc)
    lo, top, special = dw.element_bounds(acc)
    for i, v in enumerate(values):
        want_lo = (v & -v).bit_length() - 1 if v else dw._NONE
        want_top = v.bit_length() if v >= 0 else (-v - 1).bit_length()  # -2^t <= v < 2^t
        assert (int(lo[i]), int(top[i])) == (want_lo, want_top), (i, v)
    assert not bool(special.any())
    assert bool(dw.element_bounds(to_digits(torch.tensor([float("nan"), 1.0])))[2][0])


@pytest.mark.parametrize("limb_bits", [62, 61, 42])
def test_carry_normalize_matches_python_integers(limb_bits):
    rng = random.Random(limb_bits)
    L, world = limb_bits, 1 << (63 - limb_bits)
    top = (1 << L) - 1

    def check(limbs):
        out = dw.carry_normalize(torch.tensor(limbs, dtype=torch.int64), L)
        want = sum(v << (L * i) for i, v in enumerate(limbs))
        got = out.tolist()
        assert all(0 <= g <= top for g in got) and sum(g << (L * i) for i, g in enumerate(got)) == want

    check([rng.randrange(0, world * top + 1) for _ in range(200)] + [0, 0])
    # long carry chains: a generating limb under runs of 2^L - 1 (after the first carry pass)
    check([world * top] + [top - (world - 1)] * 300 + [0, 0, 5] + [top] * 50 + [0])
    check([top + 1] + [top] * 400 + [0])
    with pytest.raises(RuntimeError, match="does not fit"):
        dw.carry_normalize(torch.tensor([top + 1] + [top] * 10, dtype=torch.int64), L)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_simulated_windowed_reduce_on_window_edges(world):
    rng = random.Random(world)
    base = edge_values(rng)
    # rank 0 holds the edge values themselves, so every field is at its bound on one rank at least;
    # the others hold them again or random values inside the same windows
    accs = [acc_of(base)]
    for r in range(1, world):
        accs.append(acc_of([v if r % 2 else (v >> 1) for v in base]))
    got, plan, peak = simulate(accs)
    assert plan.fast_blocks == plan.blocks, "every edge window fits the fast path"
    assert torch.equal(got, reference(accs))


def test_headroom_holds_at_max_world_size():
    """MAX_WORLD_SIZE ranks at their window's bounds: the int64 SUM must not overflow (L = 42)."""
    rng = random.Random(7)
    base = edge_values(rng)
    accs = [acc_of(base), acc_of([-v for v in base])]
    counts = [MAX_WORLD_SIZE - 1, 1]
    got, plan, peak = simulate(accs, counts)
    assert plan.limb_bits == 42 and plan.head == 21 and plan.fast_blocks == plan.blocks
    assert torch.equal(got, reference(accs, counts))
    # Teeth: limbs really reach 2^41, so MAX_WORLD_SIZE copies come within a factor 2 of 2^63; one
    # more bit per limb (L = 43) could overflow at this world size.
    assert peak >> 41 == 1 and peak * MAX_WORLD_SIZE >= 1 << 62


def test_wide_top_and_non_canonical_blocks_fall_back_exactly():
    block = 16
    fits = [(1 << 100) + 3] * block
    too_wide = [1 << (dw.FIELD_CAP_BITS + 5), 1] + [0] * (block - 2)  # window of FIELD_CAP + 6 bits
    too_high = [1 << 575] + [0] * (block - 1)  # its field would pass digit 17's low 32 bits
    accs = [acc_of(fits + too_wide + too_high), acc_of([-v for v in fits + too_wide + too_high])]
    odd = accs[0].clone()
    odd[0, 0] += 1 << 32  # a non-canonical digit: same value as digit 1 += 1
    accs.append(odd)
    got, plan, _ = simulate(accs, block=block)
    assert plan.fast_b.tolist() == [False, False, False]  # odd's block joined the fallback too
    assert torch.equal(got, reference(accs))
    got, plan, _ = simulate(accs[:2], block=block)
    assert plan.fast_b.tolist() == [True, False, False]
    assert torch.equal(got, reference(accs[:2]))


def test_digit_all_reduce_full_and_windowed_are_exact():
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                    "tests/helpers/all_reduce_check.py"], timeout=600)
    cases = {m[1]: (float(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in re.finditer(
        r"case (\w+): exact, bytes=([\d.]+) per element, fallback_blocks=(\d+) of (\d+), fast_blocks=(\d+)", proc.stdout)}
    expected = {"real_like", "wide_exponents", "specials", "zeros", "one_rank_nonzero", "mixed_magnitudes",
                "rank_magnitudes", "cancelling", "real_like_block7", "specials_block1"}
    assert set(cases) == expected, proc.stdout
    assert "sync_gradients: exact for bucket_elements 1, 400, 1048576" in proc.stdout, proc.stdout
    nbytes, fallback, blocks, fast = cases["real_like"]
    assert nbytes <= 16 and fallback == 0, proc.stdout  # the target: fp32 DDP moves 4, full digits 152
    nbytes, fallback, blocks, fast = cases["wide_exponents"]
    assert 0 < fallback and 0 < fast, proc.stdout  # the exact fallback ran, beside packed blocks
    assert cases["specials"][1] > 0 and cases["specials_block1"][1] == 4, proc.stdout
    assert cases["zeros"][0] < 0.1 and cases["zeros"][3] == 0, proc.stdout  # only the agreement moved
