"""The verified op set matches the truth on the CPU: every op added to it on the strength of a test
gives each row the same bytes whatever rows sit beside it (1, 7, 33, 64 of 97, from the front and
from the back, so at other flat offsets), at odd widths, and with 1 or 2 threads. PyTorch's vector
kernels compute a body and a scalar tail; where the two round differently (F.silu, add with
alpha in bf16, pow with exponent 2.5) the same method finds it: the controls below."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise, at_thread_counts

from lightning_det.parallel import OpAudit
from lightning_det.parallel.audit import CPU_EQ_CUDA, ONE_DEVICE, PROJECT_OPS, VERIFIED_OPS

ROWS, WIDTHS, SUBSETS = 97, (33, 127), (1, 7, 33, 64)
HALVES = (torch.bfloat16, torch.float16)


def _pos(x):
    return x.abs() + 0.125


# op -> (function of (x, other), dtypes it is verified for, whether its backward is checked too)
ELEMENTWISE = {
    "aten.cos": (lambda x, o: torch.cos(x), None),
    "aten.sin": (lambda x, o: torch.sin(x), None),
    "aten.pow": (lambda x, o: x.pow(3.0) + x.pow(2) + x.pow(1), None),  # exponents 1, 2, 3: the audit flags others
    "aten.rsqrt": (lambda x, o: torch.rsqrt(_pos(x)), (torch.float32,)),
    "aten.exp": (lambda x, o: torch.exp(x), None),
    "aten.log": (lambda x, o: torch.log(_pos(x)), None),
    "aten.tanh": (lambda x, o: torch.tanh(x), None),
    "aten.erf": (lambda x, o: torch.erf(x), None),
}
IN_PLACE = {
    "aten.add_": lambda x, o: x.add_(o),
    "aten.sub_": lambda x, o: x.sub_(o),
    "aten.mul_": lambda x, o: x.mul_(o),
    "aten.div_": lambda x, o: x.div_(o),
    "aten.neg_": lambda x, o: x.neg_(),
    "aten.relu_": lambda x, o: x.relu_(),
    "aten.clamp_": lambda x, o: x.clamp_(-0.5, 0.5),
    "aten.masked_fill_": lambda x, o: x.masked_fill_(o > 0, 0.25),
    "aten.fill_": lambda x, o: x.fill_(0.5),
    "aten.zero_": lambda x, o: x.zero_(),
}
# data movement whose backward or forward allocates and copies: checked through the gradient
MOVEMENT = {
    "aten.slice_backward": lambda x, o: x[:, 1:-2] * o[:, 1:-2],
    "aten.select_backward": lambda x, o: x[:, 3] * o[:, 3],
    "aten.constant_pad_nd": lambda x, o: F.pad(x, (1, 2)) * F.pad(o, (1, 2)),
}


def _data(width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(ROWS, width, generator=g) * 2).to(dtype)
    o = (torch.randn(ROWS, width, generator=g) + 3).to(dtype)  # no zeros: div_ and pow stay finite
    return x, o


def _forward_and_grad(f, x, o):
    xr = x.clone().requires_grad_()
    y = f(xr, o)
    y.backward(torch.ones_like(y) * 0.75)
    return y.detach(), xr.grad


def _assert_rows_invariant(run, x, o, what):
    """run(x, o) -> tuple of row-aligned tensors; rows must not depend on the rows beside them."""
    full = run(x, o)
    for m in SUBSETS:
        for rows in (slice(0, m), slice(ROWS - m, ROWS)):
            for got, want in zip(run(x[rows], o[rows]), full):
                assert_bitwise(got, want[rows], f"{what} rows {rows.start}:{rows.stop}")


def _assert_thread_invariant(run, x, o, what):
    """The same elements in one big tensor with 1 and with 2 threads (chunks with their own tails)."""
    big_x, big_o = x.repeat(4, 1)[:, :-2], o.repeat(4, 1)[:, :-2]  # > 32768 elements, odd width
    one, two = at_thread_counts(lambda: run(big_x, big_o))
    for a, b in zip(one, two):
        assert_bitwise(a, b, f"{what} threads")


def _assert_dispatches(op, run, x, o):
    with OpAudit() as audit:
        run(x, o)
    assert op in {name for name, _ in audit.records}, f"the test of {op} never ran it"


@pytest.mark.parametrize("op", sorted(ELEMENTWISE))
@pytest.mark.parametrize("dtype", (torch.float32,) + HALVES)
def test_elementwise_ops_are_row_position_and_thread_invariant(op, dtype):
    f, dtypes = ELEMENTWISE[op]
    if dtypes is not None and dtype not in dtypes:
        pytest.skip(f"{op} is verified for {dtypes} only (the audit flags other dtypes)")
    run = lambda x, o: _forward_and_grad(f, x, o)  # noqa: E731
    for width in WIDTHS:
        x, o = _data(width, dtype, width)
        _assert_rows_invariant(run, x, o, f"{op} {dtype} width {width}")
    _assert_thread_invariant(run, x, o, f"{op} {dtype}")
    _assert_dispatches(op, run, x, o)
    assert VERIFIED_OPS[op].level == ONE_DEVICE


@pytest.mark.parametrize("op", sorted(IN_PLACE))
@pytest.mark.parametrize("dtype", (torch.float32,) + HALVES)
def test_in_place_ops_are_row_position_and_thread_invariant(op, dtype):
    f = IN_PLACE[op]
    run = lambda x, o: (f(x.clone(), o),)  # noqa: E731
    for width in WIDTHS:
        x, o = _data(width, dtype, width + 1)
        _assert_rows_invariant(run, x, o, f"{op} {dtype} width {width}")
    _assert_thread_invariant(run, x, o, f"{op} {dtype}")
    _assert_dispatches(op, run, x, o)
    assert op in VERIFIED_OPS


@pytest.mark.parametrize("op", sorted(MOVEMENT))
def test_data_movement_backward_ops_are_row_invariant(op):
    run = lambda x, o: _forward_and_grad(MOVEMENT[op], x, o)  # noqa: E731
    for width in WIDTHS:
        x, o = _data(width, torch.float32, width + 2)
        _assert_rows_invariant(run, x, o, f"{op} width {width}")
    _assert_dispatches(op, run, x, o)
    assert op in VERIFIED_OPS


def test_controls_position_dependent_kernels_are_caught_and_flagged():
    # F.silu (not in the set) and add with alpha in bf16 (flagged by the audit) change a row's
    # bits with the rows beside it: the method above has teeth.
    for f, dtype in ((F.silu, torch.float32), (lambda x: torch.add(x, x * 0.5, alpha=0.3), torch.bfloat16),
                     (lambda x: x.abs().pow(2.5), torch.float32)):
        x, _ = _data(127, dtype, 3)
        full = f(x)
        assert any(not torch.equal(f(x[:m]), full[:m]) for m in SUBSETS)
    assert "aten.silu" not in VERIFIED_OPS
    x = torch.randn(4, 5).bfloat16()
    with OpAudit() as audit:
        torch.add(x, x, alpha=0.5)
        torch.rsqrt(x.abs() + 1)
        torch.add(x, x)
        x.float().pow(2.5)
        x.float().pow(2)
    assert [op for op, _, _ in audit.violations()] == [
        "aten.add(alpha, torch.bfloat16)", "aten.rsqrt(torch.bfloat16)", "aten.pow(exponent)"]


def test_levels_are_data():
    assert {v.level for v in VERIFIED_OPS.values()} == {ONE_DEVICE}
    assert PROJECT_OPS["ldet.*"].level == CPU_EQ_CUDA
