"""The routes BLOOM's ALiBi attention needs under det_function_mode: ``torch.baddbmm`` (the scores
with their position bias) as an exact det_matmul plus separate IEEE operations, and ``torch.pow``
of a float tensor to an integer tensor (the ALiBi slopes) as ``det_pow_int``: fp64 binary
powering, one rounding, the same bytes at every position."""

import pytest
import torch
from conftest import assert_bitwise, cuda
from helpers.exact_ref import wide

from lightning_det.nn import det_function_mode
from lightning_det.nn.elementwise_routes import det_pow_int
from lightning_det.nn.matmul import det_matmul
from lightning_det.parallel import OpAudit


def _operands(seed=0, batch=6, m=5, k=37, n=7):
    """The bias and two activations (non-leaf, as the route takes: Parameters are left to PyTorch)."""
    g = torch.Generator().manual_seed(seed)
    b1 = wide((batch, m, k), seed).requires_grad_() * 1.0
    b2 = wide((batch, k, n), seed + 1).requires_grad_() * 1.0
    for b in (b1, b2):
        b.retain_grad()
    bias = torch.randn(batch, 1, n, generator=g)
    return bias, b1, b2


@pytest.mark.parametrize("beta,alpha", [(1.0, 0.125), (0.5, 1.0), (0.0, 2.0)])
def test_baddbmm_is_the_exact_product_then_ieee_ops(beta, alpha):
    bias, b1, b2 = _operands()
    if beta == 0:
        bias[0, 0, 0] = float("nan")  # ignored, as PyTorch ignores it
    with det_function_mode():
        got = torch.baddbmm(bias, b1, b2, beta=beta, alpha=alpha)
    prod = det_matmul(b1, b2) * alpha
    want = prod if beta == 0 else prod + (bias if beta == 1 else bias * beta)
    assert_bitwise(got, want, "baddbmm")
    # the same function of each sample, whatever the batch around it; PyTorch's own float sums of
    # these wide operands are not the exact ones
    with det_function_mode():
        part = bias[2:4].baddbmm(b1[2:4], b2[2:4], beta=beta, alpha=alpha)
    assert_bitwise(part, got[2:4], "batch subset")
    assert not torch.equal(torch.baddbmm(bias, b1, b2, beta=beta, alpha=alpha), got)


def test_baddbmm_backward_is_det_matmuls_and_the_audit_sees_no_bmm():
    bias, b1, b2 = _operands(seed=3)
    gy = torch.randn(6, 5, 7, generator=torch.Generator().manual_seed(4))
    with OpAudit() as audit:
        with det_function_mode():
            g1, g2 = torch.autograd.grad(torch.baddbmm(bias, b1, b2, alpha=0.25), (b1, b2), gy)
    assert not [v for v in audit.violations() if "bmm" in v[0]], audit.violations()
    with det_function_mode():  # the same GEMMs' backward, called directly
        w1, w2 = torch.autograd.grad(det_matmul(b1, b2) * 0.25, (b1, b2), gy)
    assert_bitwise(g1, w1, "d batch1")
    assert_bitwise(g2, w2, "d batch2")


def test_baddbmm_with_an_input_that_needs_a_gradient_is_left_to_torch():
    bias, b1, b2 = _operands()
    bias.requires_grad_()
    with det_function_mode():
        got = torch.baddbmm(bias, b1, b2)
    assert got.grad_fn.name() == "BaddbmmBackward0"


def _pow_ref(b: float, e: int, dtype) -> float:
    """The definition in Python floats (IEEE fp64): binary powering, 1 / p for e < 0, one rounding."""
    acc, sq, k = 1.0, b, abs(e)
    while k:
        if k & 1:
            acc *= sq
        k >>= 1
        if k:
            sq *= sq
    v = 1.0 / acc if e < 0 else acc
    return torch.tensor(v, dtype=torch.float64).to(dtype).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_pow_int_is_its_definition_at_every_position(dtype):
    base = (torch.rand(33, generator=torch.Generator().manual_seed(5)) * 3 + 0.1).to(dtype)
    exps = torch.arange(-6, 27, dtype=torch.int32)
    got = det_pow_int(base, exps)
    want = torch.tensor([_pow_ref(float(b), int(e), dtype) for b, e in zip(base, exps)], dtype=dtype)
    assert_bitwise(got, want, "pow")
    assert_bitwise(det_pow_int(base[5:6], exps[5:6]), got[5:6], "one element alone")
    # powers of two are exact, as any pow gives them: BLOOM's slopes for 2, 4, 8 ... heads
    two = torch.tensor(2.0**-4)
    assert_bitwise(det_pow_int(two, torch.arange(1, 9)), torch.pow(two, torch.arange(1, 9)), "2^-4k")


def test_pow_route_takes_integer_tensor_exponents_without_a_gradient():
    base, exps = torch.tensor(2.0**-0.5), torch.arange(1, 17, dtype=torch.int32)
    with OpAudit() as audit:
        with det_function_mode():
            slopes = torch.pow(base, exps)
    assert not [v for v in audit.violations() if "pow" in v[0]], audit.violations()
    assert_bitwise(slopes, det_pow_int(base, exps), "routed")
    x = torch.rand(4, requires_grad=True)
    with det_function_mode():  # a gradient, or a number as the exponent: PyTorch's own
        assert x.pow(torch.arange(4)).grad_fn.name() == "PowBackward1"
        assert x.pow(2).grad_fn.name() == "PowBackward0"


def test_pow_int_names_bad_arguments():
    with pytest.raises(TypeError, match="exponent: expected an integer tensor"):
        det_pow_int(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match="base: expected a float32"):
        det_pow_int(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64))


@cuda
def test_cuda_gives_the_cpu_bytes():
    bias, b1, b2 = (t.detach() for t in _operands(seed=7))
    b1, b2 = b1.requires_grad_() * 1.0, b2.requires_grad_() * 1.0
    with det_function_mode():
        cpu = torch.baddbmm(bias, b1, b2, alpha=0.125)
        gpu = torch.baddbmm(bias.cuda(), b1.cuda(), b2.cuda(), alpha=0.125)
    assert_bitwise(gpu.cpu(), cpu, "baddbmm")
    base, exps = torch.tensor(2.0**-0.5), torch.arange(-3, 17)
    assert_bitwise(det_pow_int(base.cuda(), exps.cuda()).cpu(), det_pow_int(base, exps), "pow")
