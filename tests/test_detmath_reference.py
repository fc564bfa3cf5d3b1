"""The erf-GELU kernels against an eager fp64 evaluation that divides (lightning_det/reference/gelu_ref.py).

The kernels' erf series replaces each division by a small odd integer with a multiply and two FMA
(csrc/detmath.h ``div_odd``; on AVX-512 CPUs eight lanes at a time, csrc/cpu/detmath_vector.h);
the proof there says the bits are the division's. These tests hold the kernels' fp64 values
(``ldet::act_fp64``: the fp32 outputs almost never show a last-bit change) and their fp32 bytes
to the reference on every term count of the series, both sides of each branch, and specials, on
the CPU and on CUDA. The control shows the inputs are sharp: the uncorrected quotient (the
multiply alone) gives other fp64 values on them.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import cuda
from lightning_det import _build
from lightning_det.reference import gelu_ref

GELU_ERF = 0  # csrc/detmath.h ActKind kActGeluErf


def _ops():
    _build.load()
    return torch.ops.ldet


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    r2 = math.sqrt(2.0)
    edges = torch.tensor([3 * r2, 4 * r2, 6 * r2, 40 * r2], dtype=torch.float64)  # the branches' |z| bounds
    near = torch.cat([edges, -edges]).float()
    steps = torch.arange(-64, 65, dtype=torch.float32)
    around = (near[:, None] + steps[None, :] * torch.finfo(torch.float32).eps * near.abs()[:, None]).flatten()
    return torch.cat([
        torch.linspace(-4.3, 4.3, 60001),  # |z| < 3: every term count of the series (1 to ~45)
        torch.randn(40000, generator=g) * 1.5,
        torch.linspace(-60.0, 60.0, 4001),  # the continued fraction's three lengths and the far tails
        around,
        torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1.4e-45, -1.4e-45, 1e-7, 3e38, -3e38,
                      math.inf, -math.inf, math.nan]),
    ])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32).cpu()


def _bits64(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64).cpu()


def _first_differences(what, got, ref, x, view):
    bad = (view(got) != view(ref)).nonzero().flatten()
    assert bad.numel() == 0, (f"{what}: {bad.numel()} of {x.numel()} elements differ, e.g. x={x[bad[:3]].tolist()} "
                              f"got {got.cpu()[bad[:3]].tolist()} want {ref[bad[:3]].tolist()}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_gelu_erf_fp64_values_equal_the_dividing_reference(device):
    # The fp64 values before the one rounding: here a changed last bit of any quotient shows.
    g = torch.Generator().manual_seed(9)
    x = torch.cat([_inputs().double(), torch.rand(40000, generator=g, dtype=torch.float64) * 8.6 - 4.3])
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    v = _ops().act_fp64(x.to(device), GELU_ERF)
    d = _ops().act_fp64(x.to(device), GELU_ERF, gy.to(device))
    _first_differences(f"forward fp64 on {device}", v, gelu_ref.gelu_erf_fp64(x), x, _bits64)
    _first_differences(f"backward fp64 on {device}", d, gy * gelu_ref.gelu_erf_grad_fp64(x), x, _bits64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_gelu_erf_fp32_bytes_are_the_fp64_values_rounded_once(device):
    x = _inputs()
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    y = _ops().act(x.to(device), GELU_ERF)
    g = _ops().act_backward(gy.to(device), x.to(device), GELU_ERF)
    x64 = x.double()
    _first_differences(f"forward on {device}", y, gelu_ref.gelu_erf_fp64(x64).float(), x, _bits)
    _first_differences(f"backward on {device}", g, (gy.double() * gelu_ref.gelu_erf_grad_fp64(x64)).float(), x, _bits)


def test_control_the_uncorrected_quotient_changes_fp64_values():
    # The reference with div_odd's correction left out (the multiply by RN(1/(2n+1)) alone) differs
    # from the kernels' fp64 values on many of these inputs: the comparison above can fail.
    x = _inputs().double()
    z = (x * gelu_ref._INV_SQRT2).abs()
    keep = z < 3.0
    x, z = x[keep], z[keep]
    z2 = 2.0 * z * z
    t, s = z.clone(), z.clone()
    live = torch.ones_like(z, dtype=torch.bool)
    for n in range(1, 60):
        t_new = t * z2 * (1.0 / float(2 * n + 1))
        s_new = s + t_new
        t, s = torch.where(live, t_new, t), torch.where(live, s_new, s)
        live = live & ~(t < s * 2.0**-56)
    erf_a = s * gelu_ref._exp_neg_sq(z) * gelu_ref._TWO_OVER_SQRT_PI
    uncorrected = x * torch.where(x >= 0, 0.5 * (1.0 + erf_a), 0.5 * (1.0 - erf_a))
    kernel = _ops().act_fp64(x, GELU_ERF)
    assert torch.equal(kernel, gelu_ref.gelu_erf_fp64(x))
    assert int((_bits64(uncorrected) != _bits64(kernel)).sum()) > x.numel() // 10


def test_act_fp64_rejects_other_dtypes():
    with pytest.raises(RuntimeError, match="x: expected float64"):
        _ops().act_fp64(torch.ones(3), GELU_ERF)
    with pytest.raises(RuntimeError, match="grad: expected shape"):
        _ops().act_fp64(torch.ones(3, dtype=torch.float64), GELU_ERF, torch.ones(2, dtype=torch.float64))
