"""nn.MultiheadAttention and the Transformer layers after det_transform: PyTorch's function within
fp32 rounding, the same Parameters and state_dict, and bytes that do not depend on the batch
(a subset of the sequences gives the same bytes), the micro-batch split, or eval vs training."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from torch import nn

from lightning_det.nn import (DetLinear, StepState, det_function_mode, det_transform, finalize_grad_digits,
                              set_grad_digits)
from lightning_det.nn.mha import DetMultiheadAttention, DetTransformerEncoder, DetTransformerEncoderLayer
from lightning_det.ops import det_linear
from lightning_det.parallel import OpAudit
from lightning_det.reference.attention_ref import attention_weights_ref

E, H, N, L, S = 12, 3, 5, 7, 6


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _pair(seed=0, **kw):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, **kw)
    with torch.no_grad():  # non-zero biases, so a missed bias shows
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_(generator=_g(seed + 1))
    return ref, det_transform(copy.deepcopy(ref))


def _inputs(batch_first, kdim=E, vdim=E, seed=3):
    q = torch.randn(N, L, E, generator=_g(seed))
    k = torch.randn(N, S, kdim, generator=_g(seed + 1))
    v = torch.randn(N, S, vdim, generator=_g(seed + 2))
    return (q, k, v) if batch_first else tuple(t.transpose(0, 1) for t in (q, k, v))


def _masks():
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[1, -2:] = True
    kpm[3, 0] = True
    bm = torch.rand(L, S, generator=_g(10)) > 0.3  # True: may not attend
    bm[:, S - 3] = False  # every row keeps a key that key_padding_mask leaves too
    return kpm, torch.randn(L, S, generator=_g(9)), bm


CALLS = {
    "plain": {},
    "key_padding_mask": {"kpm": True},
    "float_attn_mask": {"am": "float"},
    "bool_attn_mask_and_kpm": {"am": "bool", "kpm": True},
    "per_head_weights": {"kpm": True, "average_attn_weights": False},
    "no_weights_float_mask": {"am": "float", "need_weights": False},
    "causal_hint": {"am": "causal", "need_weights": False, "is_causal": True},
}
OPTIONS = {
    "default": {},
    "kdim_vdim": {"kdim": 5, "vdim": 7},
    "no_bias": {"bias": False},
    "add_zero_attn": {"add_zero_attn": True},
}


def _call_kwargs(spec):
    kpm, fm, bm = _masks()
    kw = {k: v for k, v in spec.items() if k in ("need_weights", "average_attn_weights", "is_causal")}
    if spec.get("kpm"):
        kw["key_padding_mask"] = kpm
    am = spec.get("am")
    if am == "float":
        kw["attn_mask"] = fm
    elif am == "bool":
        kw["attn_mask"] = bm
    elif am == "causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)[:, :S]
    return kw


@pytest.mark.parametrize("opt,batch_first", [("default", True), ("default", False), ("kdim_vdim", False),
                                              ("no_bias", True), ("add_zero_attn", True)])
def test_mha_is_pytorch_within_rounding(opt, batch_first):
    kw = OPTIONS[opt]
    ref, det = _pair(**kw, batch_first=batch_first)
    assert type(det) is DetMultiheadAttention and type(det.out_proj) is DetLinear
    assert {k: v.shape for k, v in det.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    q, k, v = _inputs(batch_first, kw.get("kdim", E), kw.get("vdim", E))
    for name, spec in CALLS.items():
        spec_kw = _call_kwargs(spec)
        (o1, w1), (o2, w2) = ref(q, k, v, **spec_kw), det(q, k, v, **spec_kw)
        torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        if w1 is None:
            assert w2 is None
        else:
            torch.testing.assert_close(w2, w1, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} weights: {m}")
    # gradients of inputs and every parameter, self-attention (one tensor as query, key and value)
    if "kdim" not in kw:
        x = q
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa, xa, xa, need_weights=False)[0], det(xb, xb, xb, need_weights=False)[0]
        g = torch.randn(ya.shape, generator=_g(11))
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    else:  # cross-attention with other widths
        ka, kb = k.clone().requires_grad_(), k.clone().requires_grad_()
        ya, yb = ref(q, ka, v)[0], det(q, kb, v)[0]
        g = torch.randn(ya.shape, generator=_g(12))
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(kb.grad, ka.grad, rtol=1e-4, atol=1e-5)
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), det.named_parameters()):
        assert n1 == n2
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {n1}: {m}")


@pytest.mark.parametrize("batch_first", [True, False])
def test_mha_sequences_do_not_depend_on_the_batch(batch_first):
    _, det = _pair(seed=4, batch_first=batch_first)
    q, k, v = _inputs(True, seed=20)
    kpm, _, bm = _masks()
    bdim = 0 if batch_first else 1

    def run(rows):
        qs, ks, vs = (t[rows].clone().requires_grad_() for t in (q, k, v))
        if not batch_first:
            qs2, ks2, vs2 = (t.transpose(0, 1) for t in (qs, ks, vs))
        else:
            qs2, ks2, vs2 = qs, ks, vs
        out, w = det(qs2, ks2, vs2, key_padding_mask=kpm[rows], attn_mask=bm, average_attn_weights=False)
        (out.square().sum() + w.sum()).backward()
        return out.detach().movedim(bdim, 0), w.detach(), qs.grad, ks.grad, vs.grad

    full = run(slice(0, N))
    for rows in (slice(0, 1), slice(1, 4), slice(N - 2, N)):
        for i, (got, want) in enumerate(zip(run(rows), full)):
            assert_bitwise(got, want[rows], f"output {i}, sequences {rows.start}:{rows.stop}")


def test_mha_weights_are_the_attention_probabilities():
    # The returned per-head weights are the fused kernel's own p = e * r, given bit for bit by the
    # plain-PyTorch evaluation of its definition on the exact projections (DetLinear's rounding)
    # with PyTorch's merged float mask; out is out_proj(P V) within fp32 rounding.
    _, det = _pair(seed=5, batch_first=True)
    q, k, v = _inputs(True, seed=30)
    kpm, fm, _ = _masks()
    out, p = det(q, k, v, key_padding_mask=kpm, attn_mask=fm, average_attn_weights=False)

    def heads(x, i):
        y = det_linear(x, det.in_proj_weight[i * E:(i + 1) * E], det.in_proj_bias[i * E:(i + 1) * E])
        return y.view(N, -1, H, E // H).transpose(1, 2)

    qh, kh, vh = heads(q, 0), heads(k, 1), heads(v, 2)
    merged = fm.view(1, 1, L, S) + torch.zeros(N, 1, 1, S).masked_fill(kpm.view(N, 1, 1, S), float("-inf"))
    assert_bitwise(p.detach(), attention_weights_ref(qh, kh, merged, 1.0 / (E // H) ** 0.5), "weights")
    o = (p.double() @ vh.double()).transpose(1, 2).reshape(N, L, E).float()
    torch.testing.assert_close(det_linear(o, det.out_proj.weight, det.out_proj.bias), out.detach(),
                               rtol=1e-5, atol=1e-6)
    # and the averaged weights: the exact mean over heads, within rounding of PyTorch's mean
    _, avg = det(q, k, v, key_padding_mask=kpm, attn_mask=fm)
    torch.testing.assert_close(avg, p.mean(1), rtol=2e-7, atol=1e-8)


def test_mha_gradients_in_digit_mode_do_not_depend_on_the_micro_batches():
    ref, det = _pair(seed=6, batch_first=True)
    q, k, v = _inputs(True, seed=40)
    state = StepState()
    set_grad_digits(det, state)

    def grads(model, splits, digits):
        model.zero_grad(set_to_none=True)
        for rows in splits:
            model(q[rows], k[rows], v[rows], need_weights=False)[0].square().sum().backward()
        if digits:
            finalize_grad_digits(state, model.parameters())
        return [p.grad.clone() for p in model.parameters()]

    one = grads(det, [slice(0, N)], True)
    two = grads(det, [slice(0, 2), slice(2, N)], True)
    for a, b, (name, _) in zip(one, two, det.named_parameters()):
        assert_bitwise(b, a, f"grad of {name}, micro-batches 2 + 3 vs 5")
    # control: PyTorch's MultiheadAttention accumulates rounded per-micro-batch gradients
    r1, r2 = grads(ref, [slice(0, N)], False), grads(ref, [slice(0, 2), slice(2, N)], False)
    assert any(not torch.equal(a, b) for a, b in zip(r1, r2))


def test_mha_options_outside_the_set_are_named():
    with pytest.raises(ValueError, match="add_bias_kv"):
        det_transform(nn.MultiheadAttention(E, H, add_bias_kv=True))
    det = det_transform(nn.MultiheadAttention(E, H))
    with pytest.raises(ValueError, match="query: expected last dimension embed_dim=12"):
        det(torch.randn(2, 3, 5), torch.randn(2, 3, 5), torch.randn(2, 3, 5))
    nested = torch.nested.nested_tensor([torch.randn(2, E), torch.randn(3, E)])
    with pytest.raises(ValueError, match="query: nested tensors are not supported"):
        det(nested, nested, nested)
    with pytest.raises(RuntimeError, match="attn_mask: need attn_mask"):
        det(torch.randn(3, 2, E), torch.randn(3, 2, E), torch.randn(3, 2, E), is_causal=True)


def _encoder(norm_first, seed=7):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(E, H, 20, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.slow
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_is_pytorch_within_rounding_and_batch_invariant(norm_first):
    ref = _encoder(norm_first)
    det = det_transform(copy.deepcopy(ref))
    assert type(det) is DetTransformerEncoder and all(type(m) is DetTransformerEncoderLayer for m in det.layers)
    x = torch.randn(N, L, E, generator=_g(50))
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[2, -3:] = True
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa, mask=mask, src_key_padding_mask=kpm), det(xb, mask=mask, src_key_padding_mask=kpm)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    for (name, p1), p2 in zip(ref.named_parameters(), det.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    full = yb.detach()
    for rows in (slice(0, 1), slice(2, 5)):
        assert_bitwise(det(x[rows], mask=mask, src_key_padding_mask=kpm[rows]), full[rows], f"rows {rows}")


def test_transformer_encoder_takes_no_fast_path_in_eval():
    # PyTorch's eval / no_grad fast path (torch._transformer_encoder_layer_fwd, nested tensors)
    # would compute with the raw weights; the det encoder runs its exact modules there too.
    torch.manual_seed(8)
    layer = nn.TransformerEncoderLayer(E + 4, 4, 20, dropout=0.0, batch_first=True)
    ref = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True: the nested-tensor route is on
    det = det_transform(copy.deepcopy(ref))
    x = torch.randn(N, L, E + 4, generator=_g(60))
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[:, -2:] = True
    train_out = det(x, src_key_padding_mask=kpm).detach()
    det.eval()
    ref.eval()
    with torch.no_grad():
        with OpAudit() as audit:
            eval_out = det(x, src_key_padding_mask=kpm)
        with OpAudit() as ref_audit:
            ref(x, src_key_padding_mask=kpm)
    assert_bitwise(eval_out, train_out, "det encoder: eval/no_grad vs training forward")
    assert not audit.violations(), audit.violations()
    ref_ops = {op for op, _ in ref_audit.records}
    assert ref_ops & {"aten._transformer_encoder_layer_fwd", "aten._nested_tensor_from_mask"}, ref_ops


def test_transformer_decoder_is_pytorch_within_rounding_and_batch_invariant():
    torch.manual_seed(9)
    layer = nn.TransformerDecoderLayer(E, H, 20, dropout=0.0, activation="gelu", batch_first=True)
    ref = nn.TransformerDecoder(layer, 1)
    det = det_transform(copy.deepcopy(ref))
    tgt, mem = torch.randn(N, L, E, generator=_g(70)), torch.randn(N, S, E, generator=_g(71))
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    ma, mb = mem.clone().requires_grad_(), mem.clone().requires_grad_()
    ya, yb = ref(tgt, ma, tgt_mask=mask), det(tgt, mb, tgt_mask=mask)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-5)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(mb.grad, ma.grad, rtol=1e-4, atol=1e-5)  # memory is key and value at once
    assert_bitwise(det(tgt[1:3], mem[1:3], tgt_mask=mask), yb.detach()[1:3], "decoder rows 1:3")


def test_transformer_training_step_is_audit_clean():
    # a det-transformed encoder + decoder step under det_function_mode: no op outside the set
    torch.manual_seed(10)
    model = det_transform(nn.Transformer(E, H, 1, 1, 20, dropout=0.0, activation="gelu", batch_first=True))
    src, tgt = torch.randn(N, S, E, generator=_g(80)), torch.randn(N, L, E, generator=_g(81))
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    target = torch.randint(0, E, (N * L,), generator=_g(82))
    with OpAudit(model) as audit:
        with det_function_mode():
            y = model(src, tgt, tgt_mask=mask, tgt_is_causal=True)
            loss = F.cross_entropy(y.reshape(-1, E), target)
        loss.backward()
    assert not audit.violations(), audit.violations()


def test_audit_names_every_op_with_its_count_and_module_class_on_the_new_paths():
    class ParamProduct(nn.Module):  # x @ weight: a Parameter operand is not routed to det_matmul
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(E, E, generator=_g(90)))

        def forward(self, x):
            return x @ self.weight

    torch.manual_seed(11)
    layer = nn.TransformerEncoderLayer(E, H, 20, dropout=0.0, activation=F.softplus, batch_first=True)
    model = nn.Sequential(det_transform(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)), ParamProduct())
    x = torch.randn(N, L, E, generator=_g(91))
    with OpAudit(model, outside="training_step") as audit:
        with det_function_mode():
            model(x).sum().backward()
    with pytest.raises(Exception) as err:
        audit.check(strict=True)
    msg = str(err.value)
    for layer_name in ("'0.layers.0' (DetTransformerEncoderLayer)", "'0.layers.1' (DetTransformerEncoderLayer)"):
        assert f"aten.softplus x1 in {layer_name}" in msg, msg
    assert "in '1' (ParamProduct)" in msg and "aten.sum x1 in training_step" in msg, msg
    assert [n for _, _, n in err.value.violations] == [int(line.split(" x")[1].split()[0])
                                                       for line in msg.splitlines()[1:-1]], msg
