"""det_sum / det_mean (lightning_det.nn.reductions): per-sample float reductions, exact and
rounded once, routed by det_function_mode; div_by_count, the division every device rounds alike."""
from fractions import Fraction

import pytest
import torch
from conftest import assert_bitwise, cuda
from helpers.exact_ref import exact_sum as _exact_sum, gen as _g, round32 as _round32, wide as _wide

from lightning_det.nn import det_function_mode
from lightning_det.nn.functional import div_by_count
from lightning_det.nn.reductions import det_cumsum, det_mean, det_sum
from lightning_det.parallel import OpAudit


def test_sum_and_mean_are_the_exact_value_rounded_once():
    x = _wide((3, 4, 37), 1)
    s, m = det_sum(x, (1, 2)), det_mean(x, [-1, -2])
    for b in range(3):
        exact = _exact_sum(x[b].flatten())
        assert s[b].item() == _round32(exact)
        assert m[b].item() == (torch.tensor(_round32(exact)) / 148).item()  # round(exact sum) / n, IEEE
    # the control: PyTorch's own sums of these values are not all the exactly rounded ones
    assert not torch.equal(x.sum((1, 2)), s) or not torch.equal(x.double().sum((1, 2)).float(), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_the_batch_and_grads_broadcast(dtype):
    x = _wide((6, 5, 33), 2).to(dtype)
    for fn, dims, keepdim in ((det_sum, 2, False), (det_mean, (1, 2), True), (det_mean, 1, False)):
        full = fn(x, dims, keepdim)
        assert full.dtype == dtype
        for rows in (slice(0, 1), slice(2, 5)):
            assert_bitwise(fn(x[rows], dims, keepdim), full[rows], f"{fn.__name__} {dims} rows {rows}")
        xr = x.clone().requires_grad_()
        y = fn(xr, dims, keepdim)
        g = torch.randn(y.shape, generator=_g(3)).to(dtype)
        y.backward(g)
        ref = x.clone().requires_grad_()
        getattr(ref, "sum" if fn is det_sum else "mean")(dims, keepdim).backward(g)
        assert_bitwise(xr.grad, ref.grad, f"{fn.__name__} gradient")


def test_the_function_mode_routes_per_sample_reductions_only():
    x = torch.randn(4, 3, 7, generator=_g(4))
    with OpAudit() as audit, det_function_mode():
        got = [torch.sum(x, 2), x.sum(dim=(1, 2), keepdim=True), torch.mean(x, [-1]), x.mean(1, dtype=torch.float32)]
    assert audit.violations() == [], audit.violations()
    want = [det_sum(x, 2), det_sum(x, (1, 2), True), det_mean(x, -1), det_mean(x, 1)]
    for a, b in zip(got, want):
        assert_bitwise(a, b)
    # across the batch, or over everything: PyTorch's, and the audit names them
    with OpAudit() as audit, det_function_mode():
        x.sum(0)
        x.mean()
        x.sum()
        torch.sum(x.long(), 1)  # integers: exact anyway
    assert [(op, n) for op, _, n in audit.violations()] == [("aten.sum", 2), ("aten.mean", 1)], audit.violations()


def test_cumsum_rounds_each_exact_prefix_once():
    x = _wide((3, 41), 8)
    xr = x.clone().requires_grad_()
    y = det_cumsum(xr, 1)
    for b in range(3):
        for j in (0, 7, 40):
            assert y[b, j].item() == _round32(_exact_sum(x[b, :j + 1]))
    # the control: PyTorch's running sum (fp64 on the CPU) loses the 1 that the exact prefix keeps
    spread = torch.tensor([[2.0 ** 60, 1.0, -2.0 ** 60]])
    assert det_cumsum(spread, 1)[0, -1].item() == 1.0 and torch.cumsum(spread, 1)[0, -1].item() == 0.0
    assert_bitwise(det_cumsum(x[1:], 1), y[1:].detach(), "rows")
    g = _wide((3, 41), 9)
    y.backward(g)
    for b in range(3):
        assert xr.grad[b, 5].item() == _round32(_exact_sum(g[b, 5:]))  # the reversed prefix
    # routed: OPT's position ids from a float mask; a cumsum along dimension 0 is not
    mask = torch.tensor([[0.0, 1, 1, 1], [1, 1, 1, 0]])
    with OpAudit() as audit, det_function_mode():
        pos = (torch.cumsum(mask, dim=1) * mask - 1).long()
        mask.cumsum(0)
    assert pos.tolist() == [[-1, 0, 1, 2], [0, 1, 2, -1]]
    assert [op for op, _, _ in audit.violations()] == ["aten.cumsum"], audit.violations()
    with pytest.raises(ValueError, match="det_cumsum: expected"):
        det_cumsum(x, 0)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="det_sum: expected .* dims leaving dimension 0"):
        det_sum(torch.ones(3, 4), 0)
    with pytest.raises(ValueError, match="det_mean: expected a float tensor"):
        det_mean(torch.ones(3, 4, dtype=torch.long), 1)


def test_div_by_count_is_an_ieee_division():
    x = _wide((1000,), 5)
    for n in (3, 7, 49, 196, 1000):
        got = div_by_count(x, n)
        for i in range(0, 1000, 97):
            assert got[i].item() == _round32(Fraction(x[i].item()) / n)


@cuda
def test_cuda_divisions_by_a_count_give_the_cpu_bytes():
    x = _wide((1 << 16,), 6)
    for n in (3, 7, 49):
        assert_bitwise(div_by_count(x.cuda(), n).cpu(), div_by_count(x, n), f"n = {n}")
    # the control: a division by a Python number is a multiply by the reciprocal on CUDA
    assert not torch.equal((x.cuda() / 7).cpu(), x / 7)
    for dims in ((1,), (1, 2)):
        y = _wide((8, 9, 11), 7)
        assert_bitwise(det_mean(y.cuda(), dims).cpu(), det_mean(y, dims), f"det_mean {dims}")
    y = _wide((4, 300), 8)
    assert_bitwise(det_cumsum(y.cuda(), 1).cpu(), det_cumsum(y, 1), "det_cumsum")
