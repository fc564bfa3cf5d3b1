"""In-place ops on det outputs: ``h = lin(x); h += x`` and ``ReLU(inplace=True)`` after a det
module must work as on the PyTorch module's output, and give the bytes of the out-of-place
version, in plain autograd and bound to a step state (digit mode)."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from torch import nn

import gen
from lightning_det import global_mean
from lightning_det.nn import (
    DetEmbedding,
    DetGELU,
    DetLayerNorm,
    DetLinear,
    DetRMSNorm,
    DetSiLU,
    DetTanh,
    StepState,
    det_cross_entropy,
    det_scaled_dot_product_attention,
    finalize_grad_digits,
    set_grad_digits,
)

D = 12


class Block(nn.Module):
    """Every det module, each output modified in place (``inplace``) or not."""

    def __init__(self, inplace: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inplace = inplace
        self.emb = DetEmbedding(20, D)
        self.ln = DetLayerNorm(D)
        self.lin = DetLinear(D, D)
        self.relu = nn.ReLU(inplace=inplace)
        self.lin2 = DetLinear(D, D)
        self.rms = DetRMSNorm(D)
        self.acts = nn.ModuleList([DetGELU(), DetSiLU(), DetTanh()])

    def add(self, h, x):
        if self.inplace:
            h += x
            return h
        return h + x

    def forward(self, idx):
        x = self.emb(idx)
        x = self.add(self.emb(idx), x * 0.5)
        x = self.add(self.ln(x), x)
        h = self.relu(self.lin(x))
        x = self.add(self.lin2(h), x)  # h = lin(x); h += x
        x = self.add(self.rms(x), x)
        for act in self.acts:
            x = self.add(act(x), x)
        q = x.reshape(2, 5, 2, D // 2).transpose(1, 2)
        x = self.add(det_scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(2, 5, D), x)
        return x


def _grads(inplace: bool, digits: bool):
    net = Block(inplace)
    state = StepState() if digits else None
    set_grad_digits(net, state)
    idx = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    out = net(idx)
    rows = det_cross_entropy(out.reshape(10, D), idx.reshape(10) % D, reduction="none")
    loss = global_mean(net.add(rows, rows))
    if inplace:
        loss *= 3.0
    else:
        loss = loss * 3.0
    loss.backward()
    if digits:
        finalize_grad_digits(state, net.parameters())
    return [loss.detach()] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("digits", [False, True])
def test_inplace_on_every_det_output_gives_the_out_of_place_bytes(digits):
    want = _grads(False, digits)
    got = _grads(True, digits)
    assert len(got) == len(want) and all(g is not None for g in got)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_bitwise(g, w, f"tensor {i} (0: the loss, then the parameters' grads)")


def test_linear_then_inplace_relu_and_residual_plain_autograd():
    lin = DetLinear(7, 7)
    x = gen.normal((3, 4, 7), torch.float32, 2)
    grads = []
    for inplace in (False, True):
        xi = x.clone().requires_grad_()
        lin.zero_grad(set_to_none=True)
        h = lin(xi)
        if inplace:
            h += xi
            F.relu(h, inplace=True)
        else:
            h = F.relu(h + xi)
        h.sum().backward()
        grads.append([h.detach(), xi.grad, lin.weight.grad, lin.bias.grad])
    for g, w in zip(*grads):
        assert_bitwise(g, w, "in place vs out of place")


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Conv2d(4, 4, 3, padding=1), (2, 4, 1, 1)),  # a 1 x 1 output: contiguous() keeps the view
    (lambda: nn.Conv1d(4, 4, 1), (2, 4, 1)),
    (lambda: nn.AdaptiveAvgPool2d(1), (2, 4, 3, 3)),
    (lambda: nn.AdaptiveAvgPool1d(1), (2, 4, 6)),
])
def test_inplace_after_conv_and_pool_outputs(make, shape):
    from lightning_det.nn import det_transform

    m = det_transform(nn.Sequential(make()))
    x = gen.normal(shape, torch.float32, 3)
    outs = []
    for inplace in (False, True):
        xi = x.clone().requires_grad_()
        h = m(xi)
        h = F.relu(h, inplace=True) if inplace else F.relu(h)
        h.sum().backward()
        outs.append([h.detach(), xi.grad])
    for g, w in zip(*outs):
        assert_bitwise(g, w, "in place vs out of place")


def test_inplace_after_per_sample_reductions():
    from lightning_det.nn.reductions import det_mean, det_sum

    x = gen.normal((3, 4, 5), torch.float32, 4)
    for fn in (det_sum, det_mean):
        xi = x.clone().requires_grad_()
        h = fn(xi, (1, 2), True)
        h += 1
        h.sum().backward()
        assert torch.equal(xi.grad, torch.full_like(x, 1.0 if fn is det_sum else 1.0 / 20))


def test_control_a_function_returning_a_view_cannot_be_modified_in_place():
    # the failure the det Functions avoid: an output made as a view inside forward
    class ViewOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return (x * 2).reshape(x.shape)

        @staticmethod
        def backward(ctx, g):
            return g * 2

    h = ViewOut.apply(torch.ones(2, 3, requires_grad=True))
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        h += 1
