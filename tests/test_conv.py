"""DetConv1d / DetConv2d: exact forward, dX, dW, db, batch invariance, digit-mode accumulation.

Exact references: dyadic data (a few significant bits, exponents in a narrow range) whose every
sum fp64 holds exactly, so PyTorch's fp64 convolution and its autograd give the exact sums and
``.float()`` rounds them once, as the exact kernel must. Random data: within the rounding bound of
an fp64 reference.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from torch import nn

from lightning_det.nn import DetConv1d, DetConv2d, StepState, det_conv1d, det_conv2d, det_transform
from lightning_det.nn import finalize_grad_digits, set_grad_digits


def dyadic(shape, seed, bits=10, exp=3):
    """Values m * 2^e, |m| < 2^bits, e in [-exp, exp]: products and their sums stay exact in fp64."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-(2 ** bits) + 1, 2 ** bits, shape, generator=g).double()
    e = torch.randint(-exp, exp + 1, shape, generator=g).double()
    return (m * torch.pow(2.0, e - bits)).float()


# (B, C, H, W, O, kernel, stride, padding, dilation, groups, bias)
CASES = [
    (2, 5, 7, 9, 4, (3, 3), 2, 1, 2, 1, True),      # odd sizes, stride 2, padding 1, dilation 2
    (3, 5, 7, 9, 5, (3, 2), 1, "same", 1, 5, True),  # depthwise, even kernel width, 'same'
    (2, 4, 6, 5, 8, (2, 3), (2, 1), (0, 2), 1, 2, False),  # groups 2, channel multiplier 4, no bias
    (2, 3, 5, 5, 4, (1, 1), 1, "valid", 1, 1, True),  # pointwise
    (1, 2, 4, 4, 3, (3, 3), 3, 4, 1, 1, True),       # padding wider than the kernel reach
]


def _run(fn, x, w, b, gy, args):
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_()
    bs = None if b is None else b.clone().requires_grad_()
    y = fn(xs, ws, bs, *args)
    y.backward(gy.to(y.dtype))
    return y.detach(), xs.grad, ws.grad, None if b is None else bs.grad


@pytest.mark.parametrize("case", CASES)
def test_conv2d_exact_on_dyadic_data(case):
    B, C, H, W, O, k, stride, padding, dilation, groups, bias = case
    x, w = dyadic((B, C, H, W), 1), dyadic((O, C // groups, *k), 2)
    b = dyadic((O,), 3) if bias else None
    args = (stride, padding, dilation, groups)
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), *args)
    gy = dyadic(y.shape, 4)
    ref = _run(F.conv2d, x.double(), w.double(), None if b is None else b.double(), gy.double(), args)
    got = _run(det_conv2d, x, w, b, gy, args)
    for name, g, r in zip(("y", "dX", "dW", "db"), got, ref):
        if r is not None:
            assert_bitwise(g, r.float(), f"{name} {case}")


def test_conv2d_exact_rounding_is_really_exercised():
    # the dyadic outputs are not all representable in fp32: the test above checks a rounding
    x, w = dyadic((2, 5, 7, 9), 1), dyadic((4, 5, 3, 3), 2)
    y = F.conv2d(x.double(), w.double(), None, 2, 1, 2)
    assert (y.float().double() != y).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv2d_random_within_rounding_bound(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 7, 9, generator=g).to(dtype)
    w = torch.randn(6, 5, 3, 3, generator=g).to(dtype)
    b = torch.randn(6, generator=g).to(dtype)
    args = (2, 1, 1, 1)
    y = F.conv2d(x.double(), w.double(), b.double(), *args)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    ref = _run(F.conv2d, x.double(), w.double(), b.double(), gy.double(), args)
    got = _run(det_conv2d, x, w, b, gy, args)
    ulp = torch.finfo(dtype).eps
    for name, gt, r in zip(("y", "dX", "dW", "db"), got, ref):
        # one rounding: within half an ulp of the fp64 value (plus fp64's own error)
        err = (gt.double() - r).abs()
        assert (err <= r.abs() * ulp / 2 * (1 + 1e-6) + 1e-30).all(), f"{name}: max err {err.max()}"


def test_conv1d_matches_conv2d_and_reference():
    x, w, b = dyadic((3, 5, 11), 6), dyadic((4, 5, 4), 7), dyadic((4,), 8)
    gy_shape = F.conv1d(x, w, b, 1, "same", 2).shape
    gy = dyadic(gy_shape, 9)
    got = _run(det_conv1d, x, w, b, gy, (1, "same", 2, 1))
    ref = _run(F.conv1d, x.double(), w.double(), b.double(), gy.double(), (1, "same", 2, 1))
    for name, g, r in zip(("y", "dX", "dW", "db"), got, ref):
        assert_bitwise(g, r.float(), f"conv1d {name}")


def test_batch_invariance_of_output_and_input_gradient():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, 5, 7, 9, generator=g)
    w = torch.randn(7, 5, 3, 3, generator=g)
    gy = torch.randn(9, 7, 4, 5, generator=g)
    y, gx, _, _ = _run(det_conv2d, x, w, None, gy, (2, 1, 1, 1))
    for rows in (slice(0, 1), slice(2, 7), slice(8, 9)):
        ys, gxs, _, _ = _run(det_conv2d, x[rows], w, None, gy[rows], (2, 1, 1, 1))
        assert_bitwise(ys, y[rows], f"y rows {rows}")
        assert_bitwise(gxs, gx[rows], f"dX rows {rows}")


def test_weight_gradient_digits_accumulate_exactly_across_micro_batches():
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 6, 3, stride=2, padding=1)
    det = det_transform(nn.Sequential(nn.Conv2d(5, 6, 3, stride=2, padding=1)))[0]
    det.load_state_dict(conv.state_dict())
    x = torch.randn(8, 5, 7, 9)
    gy = torch.randn(8, 6, 4, 5)

    def grads(model, parts, state=None):
        model.zero_grad(set_to_none=True)
        if state is not None:
            set_grad_digits(model, state)
        for p in parts:
            model(x[p]).backward(gy[p])
        if state is not None:
            finalize_grad_digits(state, model.parameters())
            set_grad_digits(model, None)
        return model.weight.grad.clone(), model.bias.grad.clone()

    whole = grads(det, [slice(0, 8)])
    for split in ([slice(0, 3), slice(3, 8)], [slice(0, 1), slice(1, 5), slice(5, 8)]):
        got = grads(det, split, StepState())
        assert_bitwise(got[0], whole[0], "dW from micro-batches")
        assert_bitwise(got[1], whole[1], "db from micro-batches")
    # control: PyTorch's convolution accumulates rounded per-micro-batch gradients, which differ
    plain_whole = grads(conv, [slice(0, 8)])
    plain_split = grads(conv, [slice(0, 3), slice(3, 8)])
    assert not torch.equal(plain_whole[0], plain_split[0])


def test_det_transform_swaps_and_keeps_parameters():
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, groups=4, bias=False))
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    det_transform(model)
    assert isinstance(model[0], DetConv1d) and isinstance(model[1], DetConv2d)
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    x = torch.randn(2, 3, 5)
    assert model[0](x).shape == (2, 4, 5)
    assert model[0](x[0]).shape == (4, 5)  # unbatched input, as PyTorch allows


def test_unsupported_options_raise_clearly():
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        det_transform(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")))
    x, w = torch.randn(1, 4, 5, 5), torch.randn(4, 2, 3, 3)
    with pytest.raises(ValueError, match="groups"):
        det_conv2d(x, w, groups=3)
    with pytest.raises(ValueError, match="'same' is not supported for strided"):
        det_conv2d(x, torch.randn(4, 4, 3, 3), stride=2, padding="same")
    with pytest.raises(TypeError, match="weight: expected dtype"):
        det_conv2d(x, torch.randn(4, 4, 3, 3).bfloat16())
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        det_conv2d(x, torch.randn(4, 4, 3, 3), dilation=3)
    with pytest.raises(ValueError, match="input: expected a 4-D"):
        det_conv2d(x[0], torch.randn(4, 4, 3, 3))


def test_in_place_ops_on_the_output_work():
    conv = det_transform(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)))[0]
    x = torch.randn(2, 3, 5, 5, requires_grad=True)
    h = conv(x)
    h += x
    torch.relu_(h)
    h.sum().backward()
    assert x.grad is not None


def test_adaptive_avg_pool_is_exact_region_sums():
    from lightning_det.nn import DetAdaptiveAvgPool2d
    from lightning_det.parallel import OpAudit

    x = dyadic((3, 5, 6, 4), 12)
    for size in (1, (3, 2), (None, 1)):
        pool = det_transform(nn.Sequential(nn.AdaptiveAvgPool2d(size)))[0]
        assert isinstance(pool, DetAdaptiveAvgPool2d)
        xs = x.clone().requires_grad_()
        y = pool(xs)
        ref = F.adaptive_avg_pool2d(x.double(), size)
        n = 24 // (ref.shape[2] * ref.shape[3])
        # round(exact sum) / n, the sum exact in fp64 on dyadic data
        assert_bitwise(y, ((ref * n).float() / n), f"pool {size}")
        assert_bitwise(y[1:2], pool(x[1:2]), f"pool {size} batch")
        y.backward(torch.ones_like(y))
        assert torch.equal(xs.grad, torch.full_like(x, 1.0 / n))
    # overlapping regions (6 rows into 4) run PyTorch's kernel, which the op audit reports
    with OpAudit() as audit:
        DetAdaptiveAvgPool2d((4, 1))(x)
    assert any("adaptive_avg_pool2d" in op for op, _, _ in audit.violations())


def test_adaptive_avg_pool_1d_is_exact_region_sums():
    from lightning_det.nn import DetAdaptiveAvgPool1d

    x = dyadic((3, 5, 12), 12)
    for size in (1, 4, None):
        pool = det_transform(nn.Sequential(nn.AdaptiveAvgPool1d(size)))[0]
        assert isinstance(pool, DetAdaptiveAvgPool1d)
        xs = x.clone().requires_grad_()
        y = pool(xs)
        ref = F.adaptive_avg_pool1d(x.double(), size or 12)
        n = 12 // ref.shape[2]
        assert_bitwise(y, ((ref * n).float() / n), f"pool {size}")
        assert_bitwise(y[1:2], pool(x[1:2]), f"pool {size} batch")
        assert_bitwise(pool(x[0]), y[0].detach(), f"pool {size} unbatched")
        y.backward(torch.ones_like(y))
        assert torch.equal(xs.grad, torch.full_like(x, 1.0 / n))


def test_max_pool_sums_overlapping_window_gradients_exactly():
    from lightning_det.nn import DetMaxPool2d
    from lightning_det.parallel import OpAudit

    # maxima on the odd rows and columns: a 3 x 3 stride-2 window holds up to four of them, and an
    # element can be the maximum of up to four windows
    g = torch.Generator().manual_seed(13)
    x = torch.full((3, 2, 7, 9), -1.0)
    x[:, :, 1::2, 1::2] = torch.rand(3, 2, 3, 4, generator=g) + 0.5
    pool = det_transform(nn.Sequential(nn.MaxPool2d(3, 2, 1)))[0]
    assert isinstance(pool, DetMaxPool2d)
    y_ref = F.max_pool2d(x, 3, 2, 1)
    gy = torch.randn(y_ref.shape, generator=g) * torch.pow(2.0, torch.randint(-20, 20, y_ref.shape, generator=g))
    xs, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    y = pool(xs)
    assert torch.equal(y, y_ref)
    y.backward(gy)
    F.max_pool2d(xr, 3, 2, 1).backward(gy.double())
    assert_bitwise(xs.grad, xr.grad.float(), "dX: exact sums rounded once")  # fp64 holds <= 4 terms here
    windows = torch.zeros_like(x).requires_grad_()
    F.max_pool2d(x + windows, 3, 2, 1).backward(torch.ones_like(y_ref))
    assert windows.grad.max() >= 3  # several windows' gradients meet in one element
    sub = x[1:2].clone().requires_grad_()
    pool(sub).backward(gy[1:2])
    assert_bitwise(sub.grad, xs.grad[1:2], "batch invariance")
    with OpAudit() as audit:
        xs2 = x.clone().requires_grad_()
        y2 = pool(xs2)
        y2.backward(torch.ones_like(y2))
    assert not audit.violations()
    # control: PyTorch's backward adds the windows' gradients in fp32, one rounding each
    xp = x.clone().requires_grad_()
    F.max_pool2d(xp, 3, 2, 1).backward(gy)
    assert not torch.equal(xp.grad, xs.grad)
    y2, idx = DetMaxPool2d(2, return_indices=True)(x)
    assert torch.equal(idx, F.max_pool2d(x, 2, return_indices=True)[1])
