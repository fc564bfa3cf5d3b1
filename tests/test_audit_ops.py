"""The verified op set: row-wise ops really are row-count invariant, and the audit catches the rest."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from torch import nn

from lightning_det.nn import DetLinear
from lightning_det.parallel import OpAudit, UnverifiedOpError, VERIFIED_OPS
from lightning_det.parallel.audit import ROWWISE_OPS


@pytest.mark.parametrize("width", [5, 33, 123, 384])
def test_log_softmax_and_per_sample_nll_are_row_invariant(width):
    # The row-wise ops in ROWWISE_OPS: row i's bytes must not depend on the other rows.
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(70, width, generator=g) * 4).requires_grad_()
    y = torch.randint(0, width, (70,), generator=g)
    gy = torch.randn(70, generator=g)
    loss = F.cross_entropy(x, y, reduction="none")
    loss.backward(gy)
    full_loss, full_grad = loss.detach(), x.grad.clone()
    for m in (1, 2, 7, 31, 64):
        xm = x.detach()[:m].clone().requires_grad_()
        lm = F.cross_entropy(xm, y[:m], reduction="none")
        lm.backward(gy[:m])
        assert_bitwise(lm.detach(), full_loss[:m], f"loss m={m}")
        assert_bitwise(xm.grad, full_grad[:m], f"grad m={m}")


def test_audit_records_and_flags_unverified_ops():
    model = nn.Sequential(DetLinear(8, 4), nn.Linear(4, 3))
    x = torch.randn(5, 8)
    with OpAudit(model) as audit:
        model(x).sum().backward()
    bad = {(op, where) for op, where, _ in audit.violations()}
    assert ("aten.addmm", "'1' (Linear)") in bad, bad  # nn.Linear at index 1
    assert ("aten.sum", "code outside any module") in bad, bad  # the loss's .sum()
    assert ("aten.sum", "backward of AddmmBackward0") in bad, bad  # nn.Linear's bias gradient
    with pytest.raises(UnverifiedOpError, match=r"aten\.addmm x1 in '1' \(Linear\)"):
        audit.check(strict=True)
    with pytest.warns(UserWarning, match="outside lightning_det's verified set"):
        assert audit.check(strict=False) is False


def test_audit_accepts_det_modules_and_per_sample_losses():
    from lightning_det import global_mean
    from lightning_det.nn import det_transform

    model = det_transform(nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 4)))
    idx, tgt = torch.randint(0, 10, (7,)), torch.randint(0, 4, (7,))
    with OpAudit(model) as audit:
        global_mean(F.cross_entropy(model(idx), tgt, reduction="none")).backward()
    assert audit.violations() == [] and audit.check(strict=True)
    # the mean-reduced loss is a batch reduction: flagged
    with OpAudit(model) as audit:
        F.cross_entropy(model(idx), tgt).backward()
    assert any(op.startswith("aten.nll_loss") for op, _, _ in audit.violations())


def test_integer_arithmetic_is_verified_random_draws_and_float_sums_are_not():
    # HF's position ids: a cumsum of the attention mask, then integer arithmetic
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    with OpAudit() as audit:
        pos = (torch.cumsum(mask, dim=1) * mask - 1).long()
        (pos + 2).clamp_min(0)
    assert audit.violations() == [], audit.violations()
    assert ("aten.cumsum[integer]", "code outside any module") in audit.records
    with OpAudit() as audit:
        torch.cumsum(mask.float(), dim=1)  # a float sum: order-dependent
        torch.randint(0, 5, (3,))  # a draw from the per-rank generator
        torch.randperm(4)
        mask.random_(0, 2)  # integer tensors in and out, but a draw
    assert [op for op, _, _ in audit.violations()] == ["aten.cumsum", "aten.randint", "aten.randperm", "aten.random_"]


def test_verified_set_is_data():
    assert all(k.startswith("aten.") for k in VERIFIED_OPS) and "aten.mm" not in VERIFIED_OPS
    assert "aten.sum" not in VERIFIED_OPS and "aten._log_softmax" in ROWWISE_OPS


def test_message_lists_every_op_with_count_and_class():
    # more than 20 different unverified ops: none is left out, each with its count and where it ran
    class Many(nn.Module):
        def forward(self, x):
            ops = [torch.sigmoid, torch.sum, torch.mean, torch.cumsum, torch.logsumexp, torch.std, torch.var,
                   torch.prod, torch.norm, torch.softmax, torch.log_softmax, torch.cumprod, torch.logcumsumexp,
                   torch.nansum, torch.atan, torch.asin, torch.acos, torch.sinh, torch.cosh, torch.expm1,
                   torch.log1p, torch.log2, torch.log10, torch.trunc]
            out = []
            for f in ops:
                try:
                    out.append(f(x, -1))
                except TypeError:
                    out.append(f(x))
            return out

    model = nn.Sequential(Many())
    x = torch.rand(3, 4) * 0.5
    with OpAudit(model) as audit:
        model(x)
        torch.sigmoid(x)
        torch.sigmoid(x)
    bad = audit.violations()
    assert len(bad) > 20 and ("aten.sigmoid", "'0' (Many)", 1) in bad and ("aten.sigmoid", "code outside any module", 2) in bad
    with pytest.raises(UnverifiedOpError) as ei:
        audit.check(strict=True)
    msg = str(ei.value)
    assert f"{len(bad)} op(s)" in msg and ei.value.violations == bad
    for op, where, n in bad:
        assert f"  {op} x{n} in {where}\n" in msg, (op, where, msg)
