"""det_scaled_dot_product_attention: accuracy against fp64 references, batch/head invariance,
causal masking, the module, and the op audit."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_det.nn import DetMultiheadSelfAttention, det_exp, det_function_mode, det_transform
from lightning_det.nn import det_scaled_dot_product_attention as dsdpa
from lightning_det.parallel.audit import OpAudit


def _inputs(shape_q, lk, ev, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, lq, e = shape_q
    q = torch.randn(*lead, lq, e, generator=g).to(dtype)
    k = torch.randn(*lead, lk, e, generator=g).to(dtype)
    v = torch.randn(*lead, lk, ev, generator=g).to(dtype)
    return q, k, v


def _explicit_fp64(q, k, v, mask=None, is_causal=False, scale=None):
    """softmax(Q K^T * scale + mask) V written out in fp64: the second, independent reference."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    elif mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (p / p.sum(-1, keepdim=True)) @ v


def _grads(fn, q, k, v, g):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv)
    return (out, *torch.autograd.grad(out, (qq, kk, vv), g.to(out.dtype)))


def _close(name, got, ref, rel):
    err = (got.double() - ref.double()).abs()
    bound = rel * ref.double().abs().amax().clamp_min(1e-30)
    if not bool((err <= bound).all()):
        i = int(err.argmax())
        raise AssertionError(f"{name}: max error {err.max().item():.3e} > {bound.item():.3e} at flat index {i} "
                             f"(got {got.reshape(-1)[i].item()}, ref {ref.reshape(-1)[i].item()})")


CASES = [
    dict(shape_q=(2, 3, 17, 8), lk=17, ev=8, is_causal=False),
    dict(shape_q=(2, 3, 17, 8), lk=17, ev=8, is_causal=True),
    dict(shape_q=(1, 2, 5, 123), lk=7, ev=33, is_causal=False),  # odd widths, Lq != Lk
    dict(shape_q=(3, 1, 9, 16), lk=9, ev=5, mask="bool"),
    dict(shape_q=(3, 1, 9, 16), lk=9, ev=5, mask="float"),
]


@pytest.mark.parametrize("dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['shape_q']}-{c['lk']}-{c.get('mask', c.get('is_causal'))}")
def test_forward_and_grads_vs_fp64(case, dtype, rel):
    q, k, v = _inputs(case["shape_q"], case["lk"], case["ev"], dtype)
    lq, lk = case["shape_q"][-2], case["lk"]
    g = torch.Generator().manual_seed(9)
    mask = None
    if case.get("mask") == "bool":
        mask = torch.rand(lq, lk, generator=g) > 0.3
        mask[:, 0] = True  # no fully masked row
    elif case.get("mask") == "float":
        mask = torch.randn(lq, lk, generator=g)
    causal = case.get("is_causal", False)
    d_out = torch.randn(*case["shape_q"][:-1], case["ev"], generator=g)

    det = _grads(lambda a, b, c: dsdpa(a, b, c, attn_mask=mask, is_causal=causal), q, k, v, d_out)
    ref = _grads(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=mask if mask is None or mask.dtype == torch.bool else mask.double(), is_causal=causal),
        q.double(), k.double(), v.double(), d_out.double())
    assert det[0].dtype == dtype and all(t.dtype == dtype for t in det[1:])
    for name, got, want in zip(("out", "dq", "dk", "dv"), det, ref):
        _close(name, got, want, rel)
    # the explicit formula agrees with torch's fp64 SDPA (guards the reference itself)
    _close("explicit", _explicit_fp64(q, k, v, mask, causal), ref[0], 1e-12)


def test_matches_sdpa_scale_argument():
    q, k, v = _inputs((2, 2, 6, 4), 6, 4)
    _close("scale", dsdpa(q, k, v, scale=0.3), _explicit_fp64(q, k, v, scale=0.3), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_and_head_invariance(dtype):
    B, H, L, E = 4, 4, 13, 12
    q, k, v = _inputs((B, H, L, E), L, E, dtype, seed=3)
    d_out = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(4))
    fn = lambda a, b, c: dsdpa(a, b, c, is_causal=True)  # noqa: E731
    full = _grads(fn, q, k, v, d_out)
    b = 2
    alone = _grads(fn, q[b:b + 1], k[b:b + 1], v[b:b + 1], d_out[b:b + 1])
    for name, x, y in zip(("out", "dq", "dk", "dv"), full, alone):
        assert torch.equal(x[b:b + 1], y), f"sequence {b}: {name} depends on the other sequences"
    h = 3
    one_head = _grads(fn, q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], d_out[:, h:h + 1])
    for name, x, y in zip(("out", "dq", "dk", "dv"), full, one_head):
        assert torch.equal(x[:, h:h + 1], y), f"head {h}: {name} depends on the number of heads"
    # and on the layout: (B*H, L, E) 3-D input gives the same bytes
    flat = dsdpa(q.reshape(B * H, L, E), k.reshape(B * H, L, E), v.reshape(B * H, L, E), is_causal=True)
    assert torch.equal(flat.reshape(B, H, L, E), full[0])


def test_rerun_is_bitwise_equal():
    q, k, v = _inputs((2, 2, 11, 8), 11, 8, seed=5)
    d = torch.randn(2, 2, 11, 8)
    a = _grads(lambda x, y, z: dsdpa(x, y, z, is_causal=True), q, k, v, d)
    b = _grads(lambda x, y, z: dsdpa(x, y, z, is_causal=True), q, k, v, d)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_causal_future_keys_have_no_influence():
    q, k, v = _inputs((2, 2, 10, 8), 10, 8, seed=6)
    base = dsdpa(q, k, v, is_causal=True)
    for t in (0, 4, 8):
        k2, v2 = k.clone(), v.clone()
        k2[..., t + 1:, :] += 100.0 * torch.randn_like(k2[..., t + 1:, :])
        v2[..., t + 1:, :] = torch.randn_like(v2[..., t + 1:, :])
        out = dsdpa(q, k2, v2, is_causal=True)
        assert torch.equal(out[..., : t + 1, :], base[..., : t + 1, :]), f"row <= {t} saw a future key"
        assert not torch.equal(out[..., t + 1:, :], base[..., t + 1:, :]), "the perturbation must matter"


def test_argument_errors():
    q, k, v = _inputs((1, 1, 4, 4), 4, 4)
    with pytest.raises(ValueError, match="dropout_key"):  # keyed masks need the call's key
        dsdpa(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="key: expected shape"):
        dsdpa(q, k[..., :3], v)
    with pytest.raises(TypeError, match="query: expected dtype"):
        dsdpa(q.double(), k, v)
    with pytest.raises(ValueError, match="attn_mask: expected None"):
        dsdpa(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True)


def test_det_exp_vs_fp64():
    x = torch.cat([torch.linspace(-100, 80, 10001), torch.tensor([float("-inf"), 0.0])])
    y = det_exp(x)
    ref = x.double().exp()
    assert torch.equal(y[-2:], torch.tensor([0.0, 1.0]))
    rel = ((y.double() - ref).abs() / ref.clamp_min(1e-300))[:-2]
    assert rel[ref[:-2] > 1e-37].max() <= 2 ** -24  # correctly rounded up to the fp64 exp's error
    assert torch.equal(det_exp(x[1:20]), y[1:20]), "position invariance"


class _PlainMHSA(nn.Module):
    """The same module written the usual way: nn.Linear + F.scaled_dot_product_attention."""

    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.dim = n_heads, dim
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, l, self.dim))


def test_module_matches_plain_and_passes_audit():
    torch.manual_seed(0)
    det = DetMultiheadSelfAttention(24, 3)
    plain = _PlainMHSA(24, 3).double()
    plain.load_state_dict({k: v.double() for k, v in det.state_dict().items()})
    x = torch.randn(2, 9, 24)
    g = torch.randn(2, 9, 24)
    with OpAudit(det) as audit:
        y = det(x, is_causal=True)
        y.backward(g)  # no loss reduction here: the audit sees the module's ops only
    assert audit.violations() == [], audit.violations()
    yp = plain(x.double())
    yp.backward(g.double())
    _close("module out", y, yp, 1e-5)
    for (n, p), (_, pp) in zip(det.named_parameters(), plain.named_parameters()):
        _close(f"grad {n}", p.grad, pp.grad, 1e-4)


def test_function_mode_redirects_plain_sdpa():
    torch.manual_seed(1)
    det = DetMultiheadSelfAttention(16, 4)
    plain = det_transform(_PlainMHSA(16, 4))  # DetLinear projections, F.scaled_dot_product_attention inside
    plain.load_state_dict(det.state_dict())
    x = torch.randn(3, 7, 16)
    g = torch.randn(3, 7, 16)
    with det_function_mode():
        y = plain(x)
    y.backward(g)
    yd = det(x, is_causal=True)
    yd.backward(g)
    assert torch.equal(y, yd)
    for (n, p), (_, pd) in zip(plain.named_parameters(), det.named_parameters()):
        assert torch.equal(p.grad, pd.grad), n
    q = torch.randn(1, 6, 4, 8)
    with det_function_mode():  # grouped-query attention: tests/test_det_matmul.py
        assert torch.equal(F.scaled_dot_product_attention(q, q, q, enable_gqa=True), dsdpa(q, q, q))
        with pytest.raises(ValueError, match="key, value: with enable_gqa"):
            F.scaled_dot_product_attention(q, q[:, :4], q[:, :4], enable_gqa=True)
