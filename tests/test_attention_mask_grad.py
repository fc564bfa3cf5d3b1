"""The gradient of a float attention mask that requires grad (det_scaled_dot_product_attention):
a relative position bias (Swin's table, T5's embedding) trains. It is the softmax gradient of the
fused kernels' own weights, per sample, summed exactly where the mask is shared; under
det_function_mode a mask shared by the batch hands its Parameter exact digits."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise, cuda
from helpers.attention_inputs import attention_dropout
from torch import nn

import gen
from lightning_det.nn import (BatchPosition, StepState, det_function_mode, det_scaled_dot_product_attention,
                              finalize_grad_digits)
from lightning_det.nn.broadcast_grads import BroadcastGradError
from lightning_det.ops.attention import attention_forward
from lightning_det.ops.dropout import dropout_multiplier
from lightning_det.reference.longacc_ref import ExactSum, round_sum


def _qkv(b, h, hkv, lq, lk, e, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, lq, e, generator=g), torch.randn(b, hkv, lk, e, generator=g),
            torch.randn(b, hkv, lk, e, generator=g), torch.randn(b, h, lq, e, generator=g))


def _mask_grad(q, k, v, go, mask, **kw):
    m = mask.detach().clone().requires_grad_()
    det_scaled_dot_product_attention(q, k, v, attn_mask=m, **kw).backward(go)
    return m.grad


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (1, 3, 7, 9), (2, 1, 1, 9), (7, 9)])
@pytest.mark.parametrize("gqa", [False, True])
def test_mask_grad_is_the_softmax_gradient(shape, gqa):
    q, k, v, go = _qkv(2, 3, 1 if gqa else 3, 7, 9, 8)
    mask = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = _mask_grad(q, k, v, go, mask, enable_gqa=gqa)
    assert got.shape == mask.shape and got.dtype == torch.float32
    m64 = mask.double().requires_grad_()
    kk, vv = (t.double().repeat_interleave(3, 1) if gqa else t.double() for t in (k, v))
    F.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=m64).backward(go.double())
    torch.testing.assert_close(got.double(), m64.grad, rtol=1e-5, atol=1e-6)


def test_a_per_sample_mask_grad_does_not_depend_on_the_batch():
    q, k, v, go = _qkv(6, 2, 2, 5, 11, 8, seed=2)
    mask = gen.wide_exponents((6, 2, 5, 11), -3, 3, torch.float32, seed=3)
    whole = _mask_grad(q, k, v, go, mask)
    for rows in (slice(0, 1), slice(2, 5), slice(5, 6)):
        assert_bitwise(_mask_grad(q[rows], k[rows], v[rows], go[rows], mask[rows]), whole[rows], f"rows {rows}")


def test_a_shared_mask_grad_is_the_exact_sum_rounded_once():
    q, k, v, go = _qkv(5, 2, 2, 4, 6, 8, seed=4)
    shared = torch.randn(1, 2, 4, 6, generator=torch.Generator().manual_seed(5))
    per_sample = _mask_grad(q, k, v, go, shared.expand(5, 2, 4, 6).contiguous())
    got = _mask_grad(q, k, v, go, shared)
    want = torch.empty(1, 2, 4, 6)
    for i in range(2 * 4 * 6):
        s = ExactSum()
        for b in range(5):
            s.add_value(float(per_sample[b].reshape(-1)[i]))
        want.view(-1)[i] = round_sum(s)
    assert_bitwise(got, want)


def test_mask_grad_with_dropout_uses_the_kernels_masks():
    q, k, v, go = _qkv(2, 2, 2, 6, 7, 8, seed=6)
    mask = torch.randn(2, 2, 6, 7, generator=torch.Generator().manual_seed(7))
    dropout = attention_dropout(True, 2)
    keep = dropout_multiplier(torch.ones(2, 2, 6, 7), dropout.p, dropout.key)
    # the reference in fp64: softmax, then the keyed multipliers, then the values
    m64 = mask.double().requires_grad_()
    w = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8 ** 0.5 + m64, -1) * keep.double()
    out64 = w @ v.double()
    out64.backward(go.double())
    # the multipliers are the kernel's own: its output agrees
    o, _ = attention_forward(q, k, v, mask, 8 ** -0.5, False, dropout)
    torch.testing.assert_close(o.double(), out64.detach(), rtol=1e-5, atol=1e-6)
    m = mask.clone().requires_grad_()
    from lightning_det.nn.attention import fused_attention

    out, _ = fused_attention(q, k, v, m, 8 ** -0.5, False, dropout)
    out.backward(go)
    torch.testing.assert_close(m.grad.double(), m64.grad, rtol=1e-5, atol=1e-6)


class _BiasAttention(nn.Module):
    """Attention whose mask is a Parameter bias table picked by a fixed index (Swin's pattern)."""

    def __init__(self, heads=2, n=5):
        super().__init__()
        self.table = nn.Parameter(torch.randn(2 * n - 1, heads))
        i = torch.arange(n)
        self.register_buffer("index", (i[:, None] - i[None, :] + n - 1).reshape(-1))
        self.heads, self.n = heads, n

    def forward(self, q, k, v):
        bias = self.table[self.index].view(self.n, self.n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


class _CausalBiasAttention(_BiasAttention):
    """T5's decoder pattern: the bias table goes through a causal ``where`` with a broadcast
    condition (a broadcasting op: the table is routed there already) before it becomes the mask."""

    def forward(self, q, k, v):
        bias = self.table[self.index].view(self.n, self.n, -1).permute(2, 0, 1).unsqueeze(0)
        causal = torch.ones(1, 1, self.n, self.n, dtype=torch.bool).tril()
        bias = torch.where(causal, bias, torch.tensor(-1e9)).clone()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def _table_grad(net, q, k, v, go, splits):
    state = StepState()
    net.table.grad = None
    total = q.shape[0]
    for a, b in splits:
        state.position = BatchPosition(0, a, b - a, total)
        with det_function_mode(state=state):
            out = net(q[a:b], k[a:b], v[a:b])
        out.backward(go[a:b])
    assert net.table.grad is None, "a float .grad: the bias went around the exact route"
    finalize_grad_digits(state, [net.table])
    return net.table.grad.clone()


@pytest.mark.parametrize("net_cls", [_BiasAttention, _CausalBiasAttention])
def test_a_shared_bias_table_gets_exact_digits_whatever_the_split(net_cls):
    torch.manual_seed(0)
    net = net_cls()
    q, k, v, _ = _qkv(8, 2, 2, 5, 5, 4, seed=8)
    go = gen.wide_exponents((8, 2, 5, 4), -20, 20, torch.float32, seed=9)
    whole = _table_grad(net, q, k, v, go, [(0, 8)])
    for splits in ([(0, 4), (4, 8)], [(i, i + 1) for i in range(8)]):
        assert_bitwise(_table_grad(net, q, k, v, go, splits), whole, f"micro-batches {splits}")
    # the values are the gradient; and plain autograd's float sums depend on the split
    plain = []
    for splits in ([(0, 8)], [(0, 4), (4, 8)]):
        net.table.grad = None
        for a, b in splits:
            net(q[a:b], k[a:b], v[a:b]).backward(go[a:b])
        plain.append(net.table.grad.clone())
    torch.testing.assert_close(whole, plain[0], rtol=1e-4, atol=1e-6 * plain[0].abs().max().item())
    assert not torch.equal(plain[0], plain[1])


def test_a_shared_mask_with_no_exact_destination_is_refused():
    net = _BiasAttention()
    q, k, v, go = _qkv(4, 2, 2, 5, 5, 4)
    mask = net.table[net.index].view(5, 5, -1).permute(2, 0, 1).unsqueeze(0) * 2  # arithmetic: no copy
    with pytest.raises(BroadcastGradError, match="across dimension 0"):
        with det_function_mode(state=StepState()):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@cuda
def test_cuda_gives_the_cpu_mask_grad():
    q, k, v, go = _qkv(3, 4, 2, 37, 41, 16, seed=10)
    mask = torch.randn(1, 4, 37, 41, generator=torch.Generator().manual_seed(11))
    cpu = _mask_grad(q, k, v, go, mask, enable_gqa=True)
    gpu = _mask_grad(q.cuda(), k.cuda(), v.cuda(), go.cuda(), mask.cuda(), enable_gqa=True)
    assert_bitwise(gpu.cpu(), cpu, "mask grad")
