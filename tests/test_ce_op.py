"""The fused cross-entropy row ops ``ldet::ce_forward`` / ``ldet::ce_backward`` (the arithmetic of
det_cross_entropy, one op each) against the plain reference lightning_det/reference/ce_ref.py:
the same bytes on every dtype and odd width, ignored rows +0.0, NaN/inf kept to their rows, a
valid row's out-of-range target read as NaN (never memory outside the row), argument checks that
name the argument, CUDA == CPU. The control shows PyTorch's own cross-entropy gives other bytes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_bitwise, assert_bitwise_nans, cuda
from lightning_det import _build
from lightning_det.reference.ce_ref import ce_backward_ref, ce_forward_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ops():
    _build.load()
    return torch.ops.ldet


def _case(n: int, c: int, dtype, seed: int = 0, specials: bool = False):
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 8.0, 0.01, 30.0])[torch.arange(n) % 4].unsqueeze(1)
    x = torch.randn(n, c, generator=g) * scale
    if specials and n >= 6:
        x[3, c // 2] = float("nan")
        x[4, 0] = float("inf")
        x[5, :] = float("-inf")
    target = torch.randint(0, c, (n,), generator=g)
    valid = torch.ones(n, dtype=torch.bool)
    valid[n // 2] = False  # an ignored row: loss and gradient +0.0
    grad = torch.randn(n, generator=g)
    return x.to(dtype), target, valid, grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [1, 5, 33, 123])
def test_forward_and_backward_match_reference(dtype, c):
    x, t, v, grad = _case(9, c, dtype, seed=c, specials=True)
    loss, e, s = _ops().ce_forward(x, t, v)
    rloss, re, rs = ce_forward_ref(x, t, v)
    assert_bitwise_nans(loss, rloss, "loss")
    assert_bitwise_nans(e, re, "e")
    assert_bitwise_nans(s, rs, "S")
    gx = _ops().ce_backward(re, rs, t, v, grad, dtype)
    assert_bitwise_nans(gx, ce_backward_ref(re, rs, t, v, grad, dtype), "gx")
    assert loss[v.logical_not()].eq(0).all() and not torch.signbit(loss[v.logical_not()]).any()


def test_rows_are_batch_invariant_and_torch_differs():
    x, t, v, grad = _case(64, 77, torch.float32, seed=3)
    loss, e, s = _ops().ce_forward(x, t, v)
    gx = _ops().ce_backward(e, s, t, v, grad, torch.float32)
    for k in (1, 7, 40):
        lk, ek, sk = _ops().ce_forward(x[-k:], t[-k:], v[-k:])
        assert_bitwise(lk, loss[-k:], f"loss rows {k}")
        assert_bitwise(_ops().ce_backward(ek, sk, t[-k:], v[-k:], grad[-k:], torch.float32), gx[-k:], f"gx rows {k}")
    # the control: PyTorch's own per-row losses are other bytes on this data
    plain = F.cross_entropy(x, torch.where(v, t, -100), reduction="none", ignore_index=-100)
    assert not torch.equal(plain[v], loss[v])


def test_out_of_range_target_of_a_valid_row_reads_nan_only_there():
    x, t, v, _ = _case(6, 10, torch.float32, seed=5)
    bad = t.clone()
    bad[1], bad[2] = 10, -1
    loss, e, s = _ops().ce_forward(x, bad, v)
    ref, _, _ = _ops().ce_forward(x, t, v)
    assert loss[1].isnan() and loss[2].isnan()
    keep = torch.tensor([True, False, False, True, True, True])
    assert_bitwise(loss[keep], ref[keep], "other rows")


def test_argument_errors_name_the_argument():
    x, t, v, grad = _case(4, 5, torch.float32)
    ops = _ops()
    bad_forward = [
        ((x[0], t, v), "x"), ((x[:, :0], t, v), "x"), ((x.double(), t, v), "x"),
        ((x, t.int(), v), "target"), ((x, t[:3], v), "target"),
        ((x, t, v.int()), "valid"), ((x, t, v[:2]), "valid"),
    ]
    for args, name in bad_forward:
        with pytest.raises(RuntimeError, match=rf"^{name}: expected"):
            ops.ce_forward(*args)
    _, e, s = ops.ce_forward(x, t, v)
    bad_backward = [
        ((e.double(), s, t, v, grad), "e"), ((e, s[:2], t, v, grad), "s"), ((e, s, t[:2], v, grad), "target"),
        ((e, s, t, v.float(), grad), "valid"), ((e, s, t, v, grad[:3]), "grad"), ((e, s, t, v, grad.long()), "grad"),
    ]
    for args, name in bad_backward:
        with pytest.raises(RuntimeError, match=rf"^{name}: expected"):
            ops.ce_backward(*args, torch.float32)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.ce_backward(e, s, t, v, grad, torch.int32)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 5), (9, 123), (4096, 512), (37, 50257)])
def test_cuda_matches_cpu(dtype, shape):
    x, t, v, grad = _case(*shape, dtype, seed=shape[1], specials=True)
    cpu = _ops().ce_forward(x, t, v)
    dev = _ops().ce_forward(x.cuda(), t.cuda(), v.cuda())
    for a, b, what in zip(cpu, dev, ("loss", "e", "S")):
        assert_bitwise_nans(a, b.cpu(), f"cuda {what}")
    gx = _ops().ce_backward(cpu[1], cpu[2], t, v, grad, dtype)
    gd = _ops().ce_backward(cpu[1].cuda(), cpu[2].cuda(), t.cuda(), v.cuda(), grad.cuda(), dtype)
    assert_bitwise_nans(gx, gd.cpu(), "cuda gx")
