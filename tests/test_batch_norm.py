"""DetBatchNorm1d / DetBatchNorm2d: the documented exact arithmetic, ghost groups, running stats.

World size 1 vs 2 (and accumulation with ghost groups) under det_ddp: tests/test_conv_bn_ddp.py.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from torch import nn

from lightning_det.nn import BatchPosition, DetBatchNorm1d, DetBatchNorm2d, StepState, det_transform
from lightning_det.nn import finalize_grad_digits, set_grad_digits
from lightning_det.nn.batch_norm import _group_sums, batch_norm_layout


def dyadic(shape, seed, bits=8, exp=2):
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(-(2 ** bits) + 1, 2 ** bits, shape, generator=g).double()
    e = torch.randint(-exp, exp + 1, shape, generator=g).double()
    return (m * torch.pow(2.0, e - bits)).float()


def scheme_reference(x, weight, bias, eps, group):
    """The module docstring's arithmetic with fp64 sums, exact on dyadic data (fp64 holds them)."""
    B, C = x.shape[:2]
    x3 = x.reshape(B, C, -1)
    out = torch.empty_like(x3)
    for s in range(0, B, group):
        xs = x3[s:s + group].double()
        M = xs.shape[0] * xs.shape[2]
        mean = xs.sum((0, 2)).float() / M
        d = x3[s:s + group] - mean.view(1, C, 1)
        var = (d.double() * d.double()).sum((0, 2)).float() / M
        rstd = (1.0 / torch.sqrt((var + eps).double())).float()
        out[s:s + group] = d * rstd.view(1, C, 1) * weight.view(1, C, 1) + bias.view(1, C, 1)
    return out.reshape(x.shape)


def _bn(cls, c, seed=0):
    torch.manual_seed(seed)
    m = cls(c)
    with torch.no_grad():
        m.weight.copy_(dyadic((c,), 50))
        m.bias.copy_(dyadic((c,), 51))
    return m


def _state(offset, size, global_size, group=None):
    st = StepState()
    st.position = BatchPosition(step=0, offset=offset, size=size, global_size=global_size)
    st.batch_norm_group_size = group
    return st


def test_forward_follows_the_documented_arithmetic_exactly():
    x = dyadic((6, 5, 7, 9), 1) * 3 + 0.5
    bn = _bn(DetBatchNorm2d, 5)
    assert_bitwise(bn(x), scheme_reference(x, bn.weight.detach(), bn.bias.detach(), bn.eps, 6), "whole batch")
    bn.step_state = _state(0, 6, 6, group=2)
    assert_bitwise(bn(x), scheme_reference(x, bn.weight.detach(), bn.bias.detach(), bn.eps, 2), "ghost groups of 2")


@pytest.mark.parametrize("cls,shape", [(DetBatchNorm2d, (8, 5, 7, 9)), (DetBatchNorm1d, (8, 5, 11)), (DetBatchNorm1d, (8, 5))])
def test_close_to_pytorch_fp64(cls, shape):
    base = {DetBatchNorm2d: nn.BatchNorm2d, DetBatchNorm1d: nn.BatchNorm1d}[cls]
    ref = base(5).double()
    bn = _bn(cls, 5)
    ref.load_state_dict(bn.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 2 + 1
    gy = torch.randn(shape, generator=g)
    for step in range(2):
        xd, xr = x.clone().requires_grad_(), x.double().requires_grad_()
        y, yr = bn(xd), ref(xr)
        y.backward(gy)
        yr.backward(gy.double())
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.double(), yr.detach(), **tol)
        torch.testing.assert_close(xd.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(bn.weight.grad.double(), ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.bias.grad.double(), ref.bias.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bn.running_mean.double(), ref.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-6, atol=1e-7)
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 2
    bn.eval()
    ref.eval()
    torch.testing.assert_close(bn(x).double(), ref(x.double()), rtol=1e-5, atol=1e-5)


def test_momentum_none_is_the_cumulative_average():
    bn, ref = DetBatchNorm1d(3, momentum=None), nn.BatchNorm1d(3, momentum=None).double()
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(6, 3, generator=g)
        bn(x), ref(x.double())
    torch.testing.assert_close(bn.running_mean.double(), ref.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-6, atol=1e-7)


def _train(bn, x, gy, parts, states):
    """Forward/backward over micro-batches ``parts`` with step states ``states``; returns outputs,
    input gradient, param grads (digit mode through one state) and running stats."""
    bn.zero_grad(set_to_none=True)
    owner = StepState()
    ys, gxs = [], []
    for p, st in zip(parts, states):
        owner.position, owner.batch_norm_group_size = st.position, st.batch_norm_group_size
        set_grad_digits(bn, owner)
        xs = x[p].clone().requires_grad_()
        y = bn(xs)
        y.backward(gy[p])
        ys.append(y.detach())
        gxs.append(xs.grad)
    finalize_grad_digits(owner, bn.parameters())
    set_grad_digits(bn, None)
    return (torch.cat(ys), torch.cat(gxs), bn.weight.grad, bn.bias.grad, bn.running_mean.clone(),
            bn.running_var.clone(), bn.num_batches_tracked.clone())


def test_ghost_groups_are_invariant_to_accumulation():
    # One micro-batch of 8 in groups of 4 = two micro-batches of 4 (accumulation 2): same
    # outputs, input gradients, exact weight/bias gradients, running statistics
    g = torch.Generator().manual_seed(8)
    x, gy = torch.randn(8, 5, 7, 9, generator=g) * 2 + 1, torch.randn(8, 5, 7, 9, generator=g)
    whole = _train(_bn(DetBatchNorm2d, 5), x, gy, [slice(0, 8)], [_state(0, 8, 8, 4)])
    split = _train(_bn(DetBatchNorm2d, 5), x, gy, [slice(0, 4), slice(4, 8)], [_state(0, 4, 4, 4), _state(4, 4, 4, 4)])
    for name, a, b in zip(("y", "dX", "dW", "db", "running_mean", "running_var", "num_batches_tracked"), split, whole):
        assert torch.equal(a, b), name
    # control: without ghost groups the normalization group is the global micro-batch, which
    # accumulation changes (8 samples at once, 4 + 4 in two micro-batches)
    one = _train(_bn(DetBatchNorm2d, 5), x, gy, [slice(0, 8)], [_state(0, 8, 8)])
    two = _train(_bn(DetBatchNorm2d, 5), x, gy, [slice(0, 4), slice(4, 8)], [_state(0, 4, 4), _state(4, 4, 4)])
    assert not torch.equal(one[0], two[0]) and not torch.equal(one[4], two[4])


def test_group_sums_of_uneven_pieces_equal_the_even_path():
    # a rank holding samples 2..8 of groups of 4 has uneven pieces (2, 4) of groups 0 and 1
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(6, 3, 5, generator=g), torch.randn(6, 3, 5, generator=g)
    uneven = batch_norm_layout(6, _state(2, 6, 12, 4))
    assert uneven.pieces == [(0, 0, 2), (1, 2, 6)] and uneven.n_groups == 3
    got = _group_sums(a, b, uneven)
    for j, s, e in uneven.pieces:
        want = _group_sums(a[s:e], b[s:e], batch_norm_layout(e - s, None))[0]
        assert torch.equal(got[j], want)
    assert not got[2].any()  # group 2 has no sample here: an exact zero, for the all-reduce


def test_eval_mode_is_batch_invariant():
    bn = _bn(DetBatchNorm2d, 5)
    g = torch.Generator().manual_seed(10)
    bn(torch.randn(8, 5, 3, 3, generator=g))
    bn.eval()
    x = torch.randn(9, 5, 7, 9, generator=g)
    full = bn(x)
    for rows in (slice(0, 1), slice(3, 8)):
        assert_bitwise(bn(x[rows]), full[rows], f"rows {rows}")


def test_det_transform_swaps_batch_norm_and_keeps_state():
    model = nn.Sequential(nn.BatchNorm1d(4), nn.BatchNorm2d(3, affine=False), nn.GroupNorm(2, 4))
    keys = list(model.state_dict())
    det_transform(model)
    assert isinstance(model[0], DetBatchNorm1d) and isinstance(model[1], DetBatchNorm2d)
    assert list(model.state_dict()) == keys
    y = model[1](torch.randn(4, 3, 2, 2))  # affine=False
    assert y.shape == (4, 3, 2, 2)


def test_errors_are_clear():
    bn = DetBatchNorm2d(3)
    bn.step_state = _state(0, 4, 12, group=5)
    with pytest.raises(ValueError, match="batch_norm_group_size: 5 does not divide the global micro-batch of 12"):
        bn(torch.randn(4, 3, 2, 2))
    bn.step_state = _state(0, 4, 8)
    with pytest.raises(ValueError, match="a batch of 3 samples, but the step's position says .* 4"):
        bn(torch.randn(3, 3, 2, 2))
    bn.step_state = None
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        DetBatchNorm1d(3)(torch.randn(1, 3))
    with pytest.raises(ValueError, match="expected 3 channels"):
        DetBatchNorm1d(3)(torch.randn(4, 5))
    from lightning_det.strategy import DeterministicStrategy

    with pytest.raises(ValueError, match="batch_norm_group_size: expected None or an integer >= 1"):
        DeterministicStrategy(batch_norm_group_size=0)


def _rank_run(bn, x, gy, state):
    set_grad_digits(bn, state)
    xs = x.clone().requires_grad_()
    y = bn(xs)
    y.backward(gy)
    digits = [state.grad_digits(p) for p in (bn.weight, bn.bias)]
    return y.detach(), xs.grad, digits, bn.running_mean.clone(), bn.running_var.clone()


@pytest.mark.parametrize("group", [None, 2])
def test_two_ranks_in_threads_equal_one_process(group):
    # Two "ranks" as threads, each with its half of the batch and a reduce_digits that adds both
    # ranks' digits (what det_all_reduce does): the same bytes as one process with the whole batch.
    # Groups of 2 over ranks of 3 samples give uneven pieces and a group that crosses the ranks.
    import threading

    from lightning_det.ops import det_combine, det_finalize

    g = torch.Generator().manual_seed(12)
    x, gy = torch.randn(6, 4, 3, 5, generator=g) * 2 + 1, torch.randn(6, 4, 3, 5, generator=g)
    whole = _rank_run(_bn(DetBatchNorm2d, 4), x, gy, _state(0, 6, 6, group))
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def rank(r):
        def reduce(acc):
            slots[r] = acc
            barrier.wait()
            total = det_combine(slots)
            barrier.wait()
            return total

        st = _state(3 * r, 3, 6, group)
        st.reduce_digits = reduce
        results[r] = _rank_run(_bn(DetBatchNorm2d, 4), x[3 * r:3 * r + 3], gy[3 * r:3 * r + 3], st)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    r0, r1 = results
    assert torch.equal(torch.cat([r0[0], r1[0]]), whole[0]), "y"
    assert torch.equal(torch.cat([r0[1], r1[1]]), whole[1]), "dX"
    for i, name in enumerate(("dW", "db")):
        assert torch.equal(det_finalize(det_combine([r0[2][i], r1[2][i]])), det_finalize(whole[2][i])), name
    for i in (3, 4):
        assert torch.equal(r0[i], whole[i]) and torch.equal(r1[i], whole[i]), "running statistics"
    # control: each rank normalizing its own 3 samples (no reduction) differs
    alone = _rank_run(_bn(DetBatchNorm2d, 4), x[:3], gy[:3], _state(0, 3, 3, None))
    if group is None:
        assert not torch.equal(alone[0], whole[0][:3])
