"""DetGroupNorm: fp64 agreement, per-sample (batch) invariance, exact weight/bias digit sums."""
import pytest
import torch
from conftest import assert_bitwise
from torch import nn

from lightning_det.nn import DetGroupNorm, StepState, det_transform, finalize_grad_digits, set_grad_digits


def _pair(groups=2, channels=6, affine=True, seed=0):
    torch.manual_seed(seed)
    ref = nn.GroupNorm(groups, channels, affine=affine)
    if affine:
        with torch.no_grad():
            ref.weight.normal_()
            ref.bias.normal_()
    det = det_transform(nn.Sequential(nn.GroupNorm(groups, channels, affine=affine)))[0]
    det.load_state_dict(ref.state_dict())
    return det, ref.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,groups", [((4, 6, 7, 9), 2), ((3, 6, 11), 3), ((5, 6), 6)])
def test_close_to_pytorch_fp64(shape, groups, dtype):
    det, ref = _pair(groups)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 2 + 1).to(dtype)
    gy = torch.randn(shape, generator=g).to(dtype)
    xd, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    y, yr = det(xd), ref(xr)
    assert y.dtype == dtype
    y.backward(gy)
    yr.backward(gy.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.double(), yr.detach(), **tol)
    torch.testing.assert_close(xd.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(det.weight.grad.double(), ref.weight.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(det.bias.grad.double(), ref.bias.grad, rtol=1e-5, atol=1e-4)


def test_samples_do_not_depend_on_the_batch():
    det, _ = _pair(3, affine=True)
    g = torch.Generator().manual_seed(2)
    x, gy = torch.randn(9, 6, 7, 9, generator=g), torch.randn(9, 6, 7, 9, generator=g)

    def run(rows):
        xs = x[rows].clone().requires_grad_()
        y = det(xs)
        y.backward(gy[rows])
        return y.detach(), xs.grad

    y, gx = run(slice(0, 9))
    for rows in (slice(0, 1), slice(4, 9)):
        ys, gxs = run(rows)
        assert_bitwise(ys, y[rows], f"y rows {rows}")
        assert_bitwise(gxs, gx[rows], f"dX rows {rows}")


def test_weight_gradient_digits_equal_the_whole_batch():
    det, ref = _pair(2)
    g = torch.Generator().manual_seed(3)
    x, gy = torch.randn(8, 6, 5, 5, generator=g), torch.randn(8, 6, 5, 5, generator=g)
    det(x).backward(gy)
    whole = det.weight.grad.clone(), det.bias.grad.clone()
    det.zero_grad(set_to_none=True)
    state = StepState()
    set_grad_digits(det, state)
    for rows in (slice(0, 3), slice(3, 8)):
        det(x[rows]).backward(gy[rows])
    finalize_grad_digits(state, det.parameters())
    assert_bitwise(det.weight.grad, whole[0], "dW")
    assert_bitwise(det.bias.grad, whole[1], "db")
    # control: PyTorch's GroupNorm accumulates rounded per-micro-batch gradients
    r = nn.GroupNorm(2, 6)
    r.load_state_dict(det.state_dict())
    r(x).backward(gy)
    plain = r.weight.grad.clone()
    r.zero_grad()
    for rows in (slice(0, 3), slice(3, 8)):
        r(x[rows]).backward(gy[rows])
    assert not torch.equal(plain, r.weight.grad)


def test_bad_input_is_named():
    det, _ = _pair(2)
    with pytest.raises(ValueError, match=r"input: expected shape \(batch, 6, \*\)"):
        det(torch.randn(2, 4, 3))
    with pytest.raises(TypeError, match="input: expected a float32"):
        det(torch.ones(2, 6, dtype=torch.int64))
