"""The one rounding of the fused norm, cross-entropy and activation kernels into bf16 / fp16
(round_double_fmt, csrc/detmath.h; the CPU and CUDA kernels compile the same source): equal, bit
for bit, to the long accumulator's rounding of the same value (the reference, an independent
way to the same rounding), on values that stress it: ties in the normal and subnormal ranges, the overflow
boundary, the smallest subnormals, signed zeros, specials and wide random exponents. And for fp32
values, equal to PyTorch's own ``.to(dtype)``."""
import math

import pytest
import torch
from helpers.cuda_emu import load_round_fmt_check

FMT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# (fraction bits, smallest normal exponent, largest finite value) of each 16-bit format
SPEC = {torch.bfloat16: (7, -126, float.fromhex("0x1.fep127")), torch.float16: (10, -14, 65504.0)}


@pytest.fixture(scope="module")
def ops():
    return load_round_fmt_check()


def _stress(dtype) -> torch.Tensor:
    frac, emin, largest = SPEC[dtype]
    g = torch.Generator().manual_seed(7)
    vals = []
    for e in range(emin - frac - 3, 130 if dtype == torch.bfloat16 else 17):
        q = 2.0 ** (max(e, emin) - frac)  # the format's quantum at 2^e
        for k in (0, 1, 2, 3, (1 << frac) - 1):
            base = 2.0 ** e + k * q if e >= emin else k * q
            for off in (0.0, 0.5, -0.5, 0.25, 0.75):  # on a value, on ties, between
                for tweak in (0.0, 2.0 ** -60, -(2.0 ** -60)):
                    v = base + off * q
                    v = v * (1 + tweak) if tweak else v
                    vals += [v, -v]
    vals += [largest, largest + 0.5 * (largest - math.nextafter(largest, 0) if dtype == torch.float16 else 2.0 ** 120),
             math.inf, -math.inf, 0.0, -0.0, 2.0 ** -160, -(2.0 ** -161), 2.0 ** 200, 1e300, 5e-324]
    mant = torch.rand(20000, generator=g, dtype=torch.float64) + 1.0
    exp = torch.randint(-170, 140, (20000,), generator=g).double()
    sign = torch.randint(0, 2, (20000,), generator=g).double() * 2 - 1
    return torch.cat([torch.tensor(vals, dtype=torch.float64), sign * mant * torch.pow(2.0, exp)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_equals_the_long_accumulators_rounding(ops, dtype):
    v = _stress(dtype)
    got = ops.round_fmt(v, FMT[dtype], False)
    want = ops.round_fmt(v, FMT[dtype], True)
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    assert bad.numel() == 0, [(v[i].item(), got[i].item(), want[i].item()) for i in bad[:10].tolist()]
    # every result is a value of the format (the rounding never leaves a wider value behind)
    assert torch.equal(got.to(dtype).float().view(torch.int32), got.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_values_round_as_pytorch_does(ops, dtype):
    v32 = _stress(dtype).float()
    v32 = v32[~v32.isnan()]
    got = ops.round_fmt(v32.double(), FMT[dtype], False)
    want = v32.to(dtype).float()
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()
    assert bad.numel() == 0, [(v32[i].item(), got[i].item(), want[i].item()) for i in bad[:10].tolist()]


def test_control_rounding_through_fp32_first_is_a_double_rounding(ops):
    # 1 + 2^-8 + 2^-30 lies just above a bf16 tie; an fp32 conversion first drops the 2^-30 and
    # lands on the tie, which then rounds down to even: a second rounding that the kernels avoid
    v = 1.0 + 2.0 ** -8 + 2.0 ** -30
    once = ops.round_fmt(torch.tensor([v], dtype=torch.float64), FMT[torch.bfloat16], False).item()
    twice = torch.tensor([v], dtype=torch.float64).float().to(torch.bfloat16).float().item()
    assert once == 1.0 + 2.0 ** -7 and twice == 1.0
