"""det_sin / det_cos (csrc/detmath.h): fp64 sin and cos from IEEE operations, rounded once. Checked
against the C library's sin and cos over the whole fp32 range (within one ulp; the fp64 values
within 4e-16 relative), elementwise (a value's bytes do not depend on its neighbours), with the
gradient rounded once, routed by det_function_mode, and the same bytes on CUDA, where PyTorch's own
sin and cos differ from its CPU ones."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bitwise, assert_bitwise_nans
from lightning_det.nn import det_function_mode
from lightning_det.nn.functional import det_cos, det_gelu, det_sigmoid, det_silu, det_sin, det_tanh
from lightning_det.parallel.audit import OpAudit
from lightning_det.ops.activation import act_fp64

FNS = [("sin", det_sin, math.sin), ("cos", det_cos, math.cos)]


def wide_fp32(n=4000, seed=0):
    """fp32 values with exponents uniform over [-30, 127], random signs, and the edge values."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-30, 128, (n,), generator=g).to(torch.float64)
    mant = 1 + torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    x = (sign * mant * torch.exp2(e)).clamp(-3.4e38, 3.4e38).float()
    edge = torch.tensor([0.0, -0.0, 1.0, 1.5707963705062866, 3.1415927410125732, 16777216.0, 16777218.0,
                         102940.0, 3.4028234663852886e38, -3.4028234663852886e38, 1e-30, -7.0])
    return torch.cat([x, edge])


def ulp_distance(a, b):
    """|a - b| in fp32 ulps (same-sign finite values; a sign change counts as far apart)."""
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    return torch.where((a < 0) == (b < 0), (ia - ib).abs(), torch.full_like(ia, 1 << 31))


@pytest.mark.parametrize("name,det,ref", FNS)
def test_within_one_ulp_of_libm_over_the_fp32_range(name, det, ref):
    x = wide_fp32()
    exact = torch.tensor([ref(v) for v in x.double().tolist()], dtype=torch.float64)
    v = act_fp64(x.double(), name)
    assert ((v - exact).abs() <= 4e-16 * exact.abs() + 1e-300).all()
    y = det(x)
    close = (ulp_distance(y, exact.float()) <= 1) | (y == exact.float())  # +0 == -0 where libm gives 0
    assert close.all(), x[~close]
    assert torch.equal(det(torch.tensor([-0.0])), torch.tensor([-0.0 if name == "sin" else 1.0]))


@pytest.mark.parametrize("name,det,ref", FNS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_round_once(name, det, ref, dtype):
    x = (wide_fp32(500, seed=1) / 1e30).to(dtype)  # finite in fp16 too (with zeros and subnormals)
    x = x[x.isfinite()]
    want = act_fp64(x.double(), name)
    assert torch.equal(det(x), want.to(dtype))  # fp64 -> 16-bit: one rounding
    assert torch.isnan(det(torch.tensor([float("inf"), float("nan")], dtype=dtype))).all()


@pytest.mark.parametrize("name,det,ref", FNS)
def test_elementwise_and_gradient_rounded_once(name, det, ref):
    x = wide_fp32(37, seed=2)
    whole = det(x)
    assert torch.equal(torch.cat([det(x[i:i + 1]) for i in range(len(x))]), whole)
    assert torch.equal(det(x[5:30].reshape(5, 5)).flatten(), whole[5:30])
    xr = x.clone().requires_grad_()
    g = torch.randn(len(x), generator=torch.Generator().manual_seed(3))
    det(xr).backward(g)
    assert torch.equal(xr.grad, act_fp64(x.double(), name, g.double()).float())


def test_det_function_mode_routes_sin_cos_tanh_sigmoid_gelu_silu():
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(4))
    with det_function_mode():
        got = [torch.sin(x), x.sin(), torch.cos(x), x.cos(), torch.cos(input=x), torch.tanh(x), F.tanh(x), x.tanh(),
               torch.sigmoid(x), F.sigmoid(x), x.sigmoid(), F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x)]
    want = ([det_sin(x), det_sin(x), det_cos(x), det_cos(x), det_cos(x)] + [det_tanh(x)] * 3 + [det_sigmoid(x)] * 3
            + [det_gelu(x), det_gelu(x, "tanh"), det_silu(x)])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with OpAudit() as audit, det_function_mode():
        F.silu(x.clone(), inplace=True)  # the in-place form stays PyTorch's, and the audit names it
    assert [op for op, _, _ in audit.violations()] == ["aten.silu_"]
    # the gradient of a routed tanh is detmath's, not PyTorch's tanh_backward (outside the verified set)
    xr = x.clone().requires_grad_()
    with det_function_mode():
        y = torch.tanh(xr)
    with OpAudit() as audit:
        y.backward(torch.ones_like(y))
    assert not audit.violations(), audit.violations()
    assert torch.equal(xr.grad, act_fp64(x.double(), "tanh", torch.ones_like(x).double()).float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,det,ref", FNS)
def test_cuda_gives_the_cpu_bytes_where_torch_differs(name, det, ref):
    x = wide_fp32(seed=5)
    assert_bitwise(det(x.cuda()).cpu(), det(x), f"{name} fp32")
    for dtype in (torch.bfloat16, torch.float16):
        h = (x / 1e30).to(dtype)  # fp16 overflows some to inf, whose sine is NaN
        assert_bitwise_nans(det(h.cuda()).cpu(), det(h), f"{name} {dtype}")
    # the control: PyTorch's CPU and CUDA kernels round some of these differently
    plain = getattr(torch, name)
    assert not torch.equal(plain(x.cuda()).cpu(), plain(x))
