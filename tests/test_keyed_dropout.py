"""Keyed dropout: a sample's mask depends only on (seed, step, global sample, site, element).

Checked against an independent pure-Python Philox, split differently (world sizes, micro-batches,
batch dimension 0 or 1), statistically, through autograd and per call site. det_ddp runs with
dropout at several world sizes and with accumulation: tests/test_zoo.py.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from conftest import cuda

from lightning_det.nn import BatchPosition, StepState, det_function_mode, det_transform, set_grad_digits
from lightning_det.nn.attention import det_scaled_dot_product_attention
from lightning_det.nn.dropout import DetDropout
from lightning_det.ops.dropout import (
    DropoutKey,
    dropout_mask,
    dropout_multiplier,
    dropout_scale,
    keep_threshold,
    keyed_dropout,
    site_key,
)
from lightning_det.parallel.audit import OpAudit

M32 = 0xFFFFFFFF


def philox_ref(ctr, k0, k1):
    """Philox 4x32-10 (Salmon et al. 2011), written from the paper, Python integers."""
    c = list(ctr)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c[3] ^ k1) & M32, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


def kept_ref(seed, step, sample, site, e, p):
    """The layout of csrc/dropout.h, element by element."""
    s = site & ((1 << 64) - 1)
    key = philox_ref([s & M32, s >> 32, 0x706F7264, 0x6B736D64], seed & M32, seed >> 32)
    word = philox_ref([e >> 2, sample, step & M32, step >> 32], key[0], key[1])[e & 3]
    return word >= round(p * 2**32)


def key(offset=0, samples=4, step=3, seed=1234, site="net.2#0"):
    return DropoutKey(seed=seed, step=step, offset=offset, samples=samples, site=site_key(site))


def test_random123_known_answer():
    # Random123's kat_vectors for philox4x32_10: the reference itself is right
    assert philox_ref([0, 0, 0, 0], 0, 0) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox_ref([M32] * 4, M32, M32) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_mask_matches_the_python_reference_batch_dim_1():
    x = torch.empty(3, 5, 7)  # (L, B, D): samples in dim 1, 21 elements each
    k = key(offset=6, samples=5, step=2**33 + 5, seed=2**40 + 9, site="enc.layers.0.dropout1#1")
    got = dropout_mask(x, 0.3, k, batch_dim=1)
    for l in range(3):
        for b in range(5):
            for d in range(7):
                assert bool(got[l, b, d]) == kept_ref(k.seed, k.step, 6 + b, k.site, l * 7 + d, 0.3), (l, b, d)
    assert 0 < int(got.sum()) < got.numel()


def test_sample_mask_is_independent_of_the_split_and_the_layout():
    x = torch.empty(8, 3, 33)
    whole = dropout_mask(x, 0.4, key(samples=8))
    halves = torch.cat([dropout_mask(x[:4], 0.4, key(offset=0)), dropout_mask(x[4:], 0.4, key(offset=4))])
    assert torch.equal(whole, halves)
    # one sample alone at its global index, and the same samples sequence-first (batch_dim 1)
    assert torch.equal(dropout_mask(x[5:6], 0.4, key(offset=5, samples=1)), whole[5:6])
    seq_first = dropout_mask(x.transpose(0, 1).contiguous(), 0.4, key(samples=8), batch_dim=1)
    assert torch.equal(seq_first.transpose(0, 1), whole)
    # what does change the mask: step, seed, site
    for other in (key(samples=8, step=4), key(samples=8, seed=1235), key(samples=8, site="net.2#1")):
        assert not torch.equal(dropout_mask(x, 0.4, other), whole)


def test_keep_rate_is_one_minus_p():
    x = torch.empty(16, 25_000)
    n = x.numel()
    for p in (0.1, 0.5, 0.9):
        kept = int(dropout_mask(x, p, key(samples=16)).sum())
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(kept - n * (1 - p)) < 5 * sd, (p, kept)
    assert keep_threshold(0.0) == 0 and keep_threshold(1.0) == 2**32
    assert not dropout_mask(x[:, :10], 1.0, key(samples=16)).any()
    assert dropout_mask(x[:, :10], 0.0, key(samples=16)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_values_and_backward_use_one_mask(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 123, generator=g).to(dtype).requires_grad_()
    k = key()
    y = keyed_dropout(x, 0.3, k)
    keep = dropout_mask(x, 0.3, k)
    s = dropout_scale(0.3, dtype)
    assert s == torch.tensor(1 / 0.7, dtype=torch.float32).to(dtype).item()
    ref = x.detach() * torch.where(keep, torch.tensor(s, dtype=dtype), torch.tensor(0.0, dtype=dtype))
    assert torch.equal(y, ref)
    # exact reference: each kept element is x * s rounded once to the dtype
    exact = (x.detach().double() * s).to(dtype) * keep
    assert torch.equal(y, exact)
    gy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(gy)
    assert torch.equal(x.grad, gy * torch.where(keep, torch.tensor(s, dtype=dtype), torch.tensor(0.0, dtype=dtype)))


def test_opcheck():
    torch.library.opcheck(torch.ops.ldet.dropout_mask.default, (torch.empty(4, 6, 3), 1, 2**31, 5, 2, 3, -77))


@cuda
@pytest.mark.parametrize("shape,batch_dim,offset", [((8, 33), 0, 0), ((5, 3, 123), 1, 7), ((2, 3, 4, 5), 2, 2**31),
                                                    ((1, 1000003), 0, 11)])
def test_mask_cpu_equals_cuda(shape, batch_dim, offset):
    x = torch.empty(shape)
    k = key(offset=offset, samples=shape[batch_dim], step=2**35 + 3, seed=99)
    assert torch.equal(dropout_mask(x.cuda(), 0.37, k, batch_dim).cpu(), dropout_mask(x, 0.37, k, batch_dim))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dropout_and_attention_dropout_cpu_equal_cuda(dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 7, 33, generator=g).to(dtype)
    gy = torch.randn(6, 7, 33, generator=g).to(dtype)

    def run(dev):
        xx = x.detach().to(dev).requires_grad_()  # a leaf on each device
        y = keyed_dropout(xx, 0.2, key(samples=6))
        y.backward(gy.to(dev))
        return y.cpu(), xx.grad.cpu()

    for a, b in zip(run("cpu"), run("cuda")):
        assert torch.equal(a, b)
    q, k, v = (t.detach().to(dtype) for t in _qkv(3, seed=4))

    def attn(dev):
        qq, kk, vv = (t.detach().to(dev).requires_grad_() for t in (q, k, v))
        o = det_scaled_dot_product_attention(qq, kk, vv, dropout_p=0.3, dropout_key=key(samples=3))
        o.backward(torch.ones_like(o))
        return [t.cpu() for t in (o, qq.grad, kk.grad, vv.grad)]

    for a, b in zip(attn("cpu"), attn("cuda")):
        assert torch.equal(a, b)


def test_key_and_argument_errors():
    x = torch.empty(4, 6)
    with pytest.raises(ValueError, match=r"dimension 0 \(batch_dim\) to hold the 3 samples.*shape \(4, 6\)"):
        dropout_mask(x, 0.1, key(samples=3))
    with pytest.raises(ValueError, match="batch_dim"):
        dropout_mask(x, 0.1, key(), batch_dim=2)
    with pytest.raises(ValueError, match="between 0 and 1"):
        keyed_dropout(x, 1.5, key())
    with pytest.raises(ValueError, match="offset"):
        DropoutKey(seed=0, step=0, offset=2**32 - 1, samples=4, site=0)
    with pytest.raises(ValueError, match="seed"):
        DropoutKey(seed=-1, step=0, offset=0, samples=4, site=0)


# ---- modules, the step state and the function mode ----------------------------------------------

def _state(step=0, offset=0, size=4, seed=7):
    state = StepState()
    state.dropout_seed = seed
    state.position = BatchPosition(step=step, offset=offset, size=size, global_size=size)
    return state


def _mlp():
    torch.manual_seed(0)
    return det_transform(nn.Sequential(nn.Linear(9, 16), nn.Dropout(0.5), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)))


def test_det_transform_swaps_and_names_dropouts():
    m = _mlp()
    assert isinstance(m[1], DetDropout) and (m[1].site, m[3].site) == ("1", "3") and m[1].batch_dim == 0
    seq_first = det_transform(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1), strict=False)
    batch_first = det_transform(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True), strict=False)
    for name in ("dropout", "dropout1", "dropout2"):
        assert getattr(seq_first, name).batch_dim == 1 and getattr(batch_first, name).batch_dim == 0
    with pytest.raises(ValueError, match=r"0 \(Dropout2d\)"):
        det_transform(nn.Sequential(nn.Dropout2d(0.1)))


def test_two_sites_differ_and_the_key_is_the_global_sample():
    m = _mlp()
    state = _state(size=8)
    set_grad_digits(m, state)
    x = torch.ones(8, 16)
    a, b = m[1](x), m[3](x)
    assert not torch.equal(a, b)  # two modules: two sites
    assert not torch.equal(m[1](x), a)  # the same module's second call in the micro-batch
    # samples 4..7 alone at world size 2 (rank 1's micro-batch): the same rows as before
    state.position = BatchPosition(step=0, offset=4, size=4, global_size=8)
    assert torch.equal(m[1](x[4:]), a[4:]) and torch.equal(m[3](x[4:]), b[4:])
    # the same rows as the second micro-batch of an accumulation window at world size 1
    state.position = BatchPosition(step=0, offset=4, size=4, global_size=4)
    assert torch.equal(m[1](x[4:]), a[4:])
    # a plain nn.Dropout draws from the process RNG: the control differs
    torch.manual_seed(0)
    assert not torch.equal(nn.Dropout(0.5)(x)[4:], a[4:])


def test_drop_path_is_keyed_per_sample_and_swapped_from_the_library():
    transformers = pytest.importorskip("transformers")
    from transformers.models.convnext.modeling_convnext import ConvNextDropPath
    from transformers.models.swin.modeling_swin import SwinDropPath

    from lightning_det.nn import DetDropPath

    model = det_transform(nn.Sequential(ConvNextDropPath(0.5), SwinDropPath(0.5)))
    assert all(type(m) is DetDropPath for m in model) and (model[0].site, model[1].site) == ("0", "1")
    state = _state(size=8)
    set_grad_digits(model, state)
    x = torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    y = model[0](xr)
    kept = (y != 0).flatten(1).any(1)
    assert 0 < int(kept.sum()) < 8  # whole samples kept or dropped
    assert torch.equal(y[kept], x[kept].div(0.5)) and torch.equal(y[~kept], torch.zeros_like(y[~kept]))
    y.backward(torch.ones_like(y))
    assert torch.equal(xr.grad[kept], torch.full_like(x[kept], 2.0))
    # samples 4..7 as another rank's micro-batch: the same decisions
    state.position = BatchPosition(step=0, offset=4, size=4, global_size=8)
    assert torch.equal(model[0](x[4:]), y[4:].detach())
    assert model.eval()[0](x) is x  # eval: the identity
    # a changed drop path is not recognised: it keeps its class (its ops meet the step's audit)
    class Other(ConvNextDropPath):
        def forward(self, hidden_states):
            return hidden_states * torch.rand(hidden_states.shape[0], 1, 1)

    assert type(det_transform(nn.Sequential(Other(0.1)))[0]) is Other


def test_flattened_batch_dropout_is_refused_with_the_fix():
    with det_function_mode(strict=True, state=_state(size=4)), pytest.raises(ValueError, match="batch \\* seq"):
        F.dropout(torch.ones(12, 5), 0.5)  # (batch * seq, D): samples mixed in dimension 0


def test_eval_and_p0_are_the_identity_without_a_position():
    m = _mlp().eval()
    x = torch.randn(3, 16)
    assert m[1](x) is x
    assert DetDropout(0.0, site="d").train()(x) is x
    with det_function_mode():
        assert torch.equal(F.dropout(x, 0.5, training=False), x)


def test_missing_position_strict_raises_non_strict_warns():
    m = _mlp()
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match=r"DetDropout '1'.*needs a StepState.*BatchPosition"):
        m[1](x)
    set_grad_digits(m, StepState())
    with pytest.raises(RuntimeError, match=r"StepState.position \(it is None\)"):
        m[1](x)
    lax = det_transform(nn.Sequential(nn.Dropout(0.5)), strict=False)
    with pytest.warns(UserWarning, match="PyTorch's dropout runs instead"):
        lax(x)
    with det_function_mode(strict=True, state=StepState()), pytest.raises(RuntimeError, match="F.dropout"):
        F.dropout(x, 0.5)
    q = torch.randn(2, 1, 3, 4)
    with det_function_mode(strict=False), pytest.warns(UserWarning, match="dropout_p > 0"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)  # PyTorch's own: no ValueError
    with det_function_mode(strict=True), pytest.raises(RuntimeError, match="dropout_p > 0"):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


def test_wrong_batch_dim_raises_naming_the_shape():
    m = _mlp()
    set_grad_digits(m, _state(size=4))
    with pytest.raises(ValueError, match=r"samples of this micro-batch, got shape \(5, 4, 16\).*batch_dim"):
        m[1](torch.ones(5, 4, 16))  # sequence-first input to a batch_dim 0 module
    m[1].batch_dim = 1
    assert m[1](torch.ones(5, 4, 16)).shape == (5, 4, 16)
    # non-strict: a warning and PyTorch's dropout, no ValueError
    m[1].strict = False
    with pytest.warns(UserWarning, match=r"shape \(4, 5, 16\) has no batch dimension 1"):
        m[1](torch.ones(4, 5, 16))
    with det_function_mode(strict=False, state=_state(size=4)), pytest.warns(UserWarning, match="PyTorch's"):
        F.dropout(torch.ones(8, 3), 0.5)  # e.g. attention weights (B * heads, L, S)
        q = torch.randn(8, 1, 3, 4)
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


def test_functional_calls_are_counted_per_micro_batch():
    x = torch.ones(4, 50)
    state = _state()
    with det_function_mode(state=state):
        a, b = F.dropout(x, 0.5), F.dropout(x, 0.5)
        state.position = state.position  # a new micro-batch: counts start again
        a2 = F.dropout(x, 0.5)
    assert not torch.equal(a, b) and torch.equal(a, a2)


def test_activation_checkpointing_recomputes_the_same_mask():
    m = _mlp()
    x = torch.randn(4, 9)

    def grads(use_checkpoint, reentrant=False):
        set_grad_digits(m, _state())
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = checkpoint(m, xx, use_reentrant=reentrant) if use_checkpoint else m(xx)
        y.square().sum().backward()
        return xx.grad

    plain = grads(False)
    assert torch.equal(grads(True), plain) and torch.equal(grads(True, reentrant=True), plain)
    set_grad_digits(m, None)

    def twice(t):
        return m[1](m[1](t))

    set_grad_digits(m, _state())
    y = checkpoint(lambda t: twice(m[0](t)), x.clone().requires_grad_(), use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"recomputed inside the backward.*after 2 call\(s\)"):
        y.sum().backward()


def test_strict_audit_sees_no_rng_op():
    m = _mlp()
    set_grad_digits(m, _state())
    x, g = torch.randn(4, 9), torch.randn(4, 3)
    with OpAudit(m) as audit:
        m(x).backward(g)
    assert audit.violations() == [], audit.violations()
    # control: PyTorch's dropout draws with bernoulli_
    plain = nn.Sequential(nn.Dropout(0.5))
    with OpAudit(plain) as audit:
        plain(x)
    assert any(op.startswith("aten.bernoulli") for op, _, _ in audit.violations())


def test_strategy_dropout_seed():
    from lightning_det.strategy import DeterministicStrategy

    assert DeterministicStrategy(seed=5).step_state.dropout_seed == 5
    assert DeterministicStrategy(seed=5, dropout_seed=9).step_state.dropout_seed == 9
    with pytest.raises(ValueError, match="dropout_seed"):
        DeterministicStrategy(dropout_seed=1.5)


# ---- attention dropout ----------------------------------------------------------------------------

def _qkv(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, 2, 5, 8, generator=g).requires_grad_() for _ in range(3)]


def test_attention_dropout_is_batch_split_invariant_forward_and_backward():
    q, k, v = _qkv(4)
    go = torch.randn(4, 2, 5, 8, generator=torch.Generator().manual_seed(1))

    def run(sl, offset):
        qq, kk, vv = (t.detach()[sl].requires_grad_() for t in (q, k, v))
        o = det_scaled_dot_product_attention(qq, kk, vv, dropout_p=0.3, is_causal=True,
                                             dropout_key=key(offset=offset, samples=qq.shape[0]))
        o.backward(go[sl])
        return o, qq.grad, kk.grad, vv.grad

    whole = run(slice(0, 4), 0)
    parts = [run(slice(0, 3), 0), run(slice(3, 4), 3)]
    for i in range(4):
        assert torch.equal(whole[i], torch.cat([parts[0][i], parts[1][i]]))
    nodrop = det_scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.equal(whole[0], nodrop)


def test_attention_dropout_matches_an_fp64_reference():
    q, k, v = _qkv(3, seed=2)
    kk = key(samples=3)
    o = det_scaled_dot_product_attention(q, k, v, dropout_p=0.25, dropout_key=kk)
    m = dropout_multiplier(torch.empty(3, 2 * 5 * 5), 0.25, kk).view(3, 2, 5, 5).double()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = ((qd @ kd.transpose(-1, -2)) / 8 ** 0.5).softmax(-1) * m @ vd
    assert torch.allclose(o.double(), ref, rtol=1e-5, atol=1e-6)
    go = torch.randn_like(o)
    o.backward(go)
    ref.backward(go.double())
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="dropout_key"):
        det_scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    with pytest.raises(ValueError, match=r"first dimension to be the batch of 4"):
        det_scaled_dot_product_attention(q, k, v, dropout_p=0.25, dropout_key=key(samples=4))


def test_sdpa_dropout_routed_under_the_function_mode():
    q, k, v = (t.detach() for t in _qkv(4))
    state = _state()
    with det_function_mode(state=state):
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        state.position = BatchPosition(step=0, offset=2, size=2, global_size=4)
        b = F.scaled_dot_product_attention(q[2:], k[2:], v[2:], dropout_p=0.3)
    assert torch.equal(a[2:], b)


# Multi-process det_ddp runs with dropout (nn.Dropout, attention dropout) at world sizes 1, 2 and 4
# and with accumulation: tests/test_zoo.py (GPT-2, ViT, nn.TransformerEncoder, an MLP).

