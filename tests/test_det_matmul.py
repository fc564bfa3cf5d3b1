"""Hand-written attention under det_function_mode: torch.matmul / @ / bmm of activations, softmax and
SDPA's enable_gqa go to exact versions. Each product is the exact sum rounded once (checked against
Python fractions), a slice's bytes do not depend on the other slices, and HF's eager and sdpa
attention run no op outside the verified set."""
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise
from torch import nn

from lightning_det.nn import det_function_mode, det_matmul, det_scaled_dot_product_attention, det_softmax
from lightning_det.parallel import OpAudit


def _g(seed):
    return torch.Generator().manual_seed(seed)


def _round_fp32(fr: Fraction) -> float:
    """Fraction -> nearest fp32 (ties to even), via an exact fp64 neighbourhood check."""
    x = torch.tensor(float(fr), dtype=torch.float64).float()  # may be off by double rounding: fix below
    best = x
    for cand in (torch.nextafter(x, torch.tensor(-float("inf"))), x, torch.nextafter(x, torch.tensor(float("inf")))):
        if abs(Fraction(cand.item()) - fr) < abs(Fraction(best.item()) - fr):
            best = cand
    return best.item()


def test_det_matmul_is_the_exact_sum_rounded_once():
    a = torch.randn(2, 3, 4, 9, generator=_g(0)) * torch.logspace(-6, 6, 9)  # wide exponents: float sums round
    b = torch.randn(1, 3, 9, 5, generator=_g(1)) * torch.logspace(6, -6, 9)[:, None]
    out = det_matmul(a, b)
    assert out.shape == (2, 3, 4, 5)
    for idx in [(0, 0, 0, 0), (1, 2, 3, 4), (1, 1, 2, 0), (0, 2, 1, 3)]:
        i, h, m, n = idx
        exact = sum(Fraction(a[i, h, m, k].item()) * Fraction(b[0, h, k, n].item()) for k in range(9))
        assert out[idx].item() == _round_fp32(exact), idx


def test_det_matmul_slices_and_gradients_do_not_depend_on_the_batch():
    a = torch.randn(6, 4, 33, generator=_g(2))
    b = torch.randn(6, 33, 5, generator=_g(3))
    g = torch.randn(6, 4, 5, generator=_g(4))

    def run(rows):
        ar, br = a[rows].clone().requires_grad_(), b[rows].clone().requires_grad_()
        y = det_matmul(ar, br)
        y.backward(g[rows])
        return y.detach(), ar.grad, br.grad

    full = run(slice(0, 6))
    for rows in (slice(0, 1), slice(2, 5)):
        for what, got, want in zip(("y", "da", "db"), run(rows), full):
            assert_bitwise(got, want[rows], f"{what} rows {rows}")
    # da = g @ b^T and db = a^T @ g, each the exact product of its slice, rounded once
    for i in range(6):
        assert_bitwise(full[1][i], det_matmul(g[i], b[i].t()), f"da[{i}]")
        assert_bitwise(full[2][i], det_matmul(a[i].t(), g[i]), f"db[{i}]")


def test_det_softmax_is_row_invariant_and_close_to_pytorch():
    x = torch.randn(64, 33, generator=_g(5)) * 4
    x[3, :10] = float("-inf")  # masked entries
    for dim, dtype in ((-1, None), (0, None), (-1, torch.float32)):
        xb = x.bfloat16() if dtype is not None else x
        xa = xb.clone().requires_grad_()
        p = det_softmax(xa, dim, dtype=dtype)
        torch.testing.assert_close(p, F.softmax(xb, dim, dtype=dtype), rtol=2e-6, atol=1e-7)
        g = torch.randn(p.shape, generator=_g(6))
        p.backward(g)
        ref = xb.float().clone().requires_grad_()
        F.softmax(ref, dim).backward(g)
        torch.testing.assert_close(xa.grad.float(), ref.grad, rtol=1e-5, atol=1e-6 if dtype is None else 1e-2)
    full = det_softmax(x, -1)
    for m in (1, 7, 33):
        assert_bitwise(det_softmax(x[:m], -1), full[:m], f"rows {m}")
        assert_bitwise(det_softmax(x[-m:], -1), full[-m:], f"last rows {m}")


def test_function_mode_routes_activation_products_and_leaves_parameters():
    a, b = torch.randn(2, 3, 4, 6, generator=_g(7)), torch.randn(2, 3, 6, 5, generator=_g(8))
    w = nn.Parameter(torch.randn(6, 5, generator=_g(9)))
    with OpAudit() as audit:
        with det_function_mode():
            outs = [torch.matmul(a, b), a @ b, a.matmul(b), torch.bmm(a[0], b[0]), a[0, 0].mm(b[0, 0]),
                    F.softmax(a, dim=-1), torch.softmax(a, 1), a.softmax(-1, dtype=torch.float32)]
            param_product = a @ w  # a Parameter (or a view of one): left to PyTorch, the audit names it
    with OpAudit() as view_audit, det_function_mode():
        a[0, 0] @ w.t().t()
    assert "aten.mm" in {op for op, _, _ in view_audit.violations()}
    want = det_matmul(a, b)
    for i, o in enumerate(outs[:3]):
        assert_bitwise(o, want, f"call {i}")
    assert_bitwise(outs[3], want[0], "bmm")
    assert_bitwise(outs[4], want[0, 0], "mm")
    assert_bitwise(outs[5], det_softmax(a, -1), "F.softmax")
    assert_bitwise(outs[6], det_softmax(a, 1), "torch.softmax")
    assert_bitwise(outs[7], det_softmax(a, -1), "Tensor.softmax")
    bad = {op for op, _, _ in audit.violations()}
    assert bad and bad <= {"aten.mm", "aten.bmm", "aten._unsafe_view", "aten.expand", "aten.matmul"}, bad
    assert torch.allclose(param_product, a @ w.detach())
    # control: PyTorch's own batched product of these slices is not the exactly rounded one everywhere
    x, y = torch.randn(64, 8, 200, generator=_g(10)), torch.randn(64, 200, 8, generator=_g(11))
    assert not torch.equal(torch.matmul(x, y), det_matmul(x, y))


@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attention_is_each_heads_own_attention(causal):
    b, h, hkv, lq, lk, e = 2, 6, 2, 5, 5, 8
    q = torch.randn(b, h, lq, e, generator=_g(12))
    k, v = torch.randn(b, hkv, lk, e, generator=_g(13)), torch.randn(b, hkv, lk, e, generator=_g(14))
    mask = None if causal else torch.rand(b, 1, lq, lk, generator=_g(15)) > 0.2
    if mask is not None:
        mask[..., 0] = True
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out = det_scaled_dot_product_attention(qa, ka, va, attn_mask=mask, is_causal=causal, enable_gqa=True)
    g = torch.randn(out.shape, generator=_g(16))
    out.backward(g)
    # reference: every query head against its repeated key/value head (det attention, no GQA)
    qr, kr, vr = q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_()
    ref = det_scaled_dot_product_attention(qr, kr.repeat_interleave(h // hkv, 1), vr.repeat_interleave(h // hkv, 1),
                                           attn_mask=mask, is_causal=causal)
    ref.backward(g)
    assert_bitwise(out.detach(), ref.detach(), "output")
    assert_bitwise(qa.grad, qr.grad, "dq")
    # dk, dv: one chain over the group's heads (the reference adds per-head chains in float)
    torch.testing.assert_close(ka.grad, kr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(va.grad, vr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                   enable_gqa=True), rtol=1e-5, atol=1e-6)
    assert_bitwise(det_scaled_dot_product_attention(q[1:], k[1:], v[1:], attn_mask=None if mask is None else mask[1:],
                                is_causal=causal, enable_gqa=True), out.detach()[1:], "batch subset")


transformers = pytest.importorskip("transformers")


def _hf(family, impl, kv_heads=2):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=impl)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=16,
                                   attn_implementation=impl)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("family,impl,kv", [("llama", "sdpa", 2), ("llama", "eager", 4), ("gpt2", "sdpa", 0),
                                            ("gpt2", "eager", 0)])
def test_hf_attention_runs_only_verified_ops_and_is_batch_invariant(family, impl, kv):
    from lightning_det.nn import det_transform

    model = det_transform(_hf(family, impl, kv))
    x = torch.randint(0, 50, (4, 7), generator=_g(17))
    with OpAudit(model) as audit:
        with det_function_mode():
            out = model(input_ids=x, labels=x)
        out.loss.backward()
    bad = audit.violations()
    if family == "gpt2":  # its (1, T, D) position embedding's gradient, summed over the batch by autograd
        assert [(op, where) for op, where, _ in bad] == [("aten.sum", "backward of AddBackward0")], bad
    else:
        assert not bad, bad
    with torch.no_grad(), det_function_mode():
        full = model(input_ids=x).logits
        part = model(input_ids=x[1:3]).logits
    assert_bitwise(part, full[1:3], "logits of sequences 1:3")
    # and the function is HF's, within fp32 rounding
    plain = _hf(family, impl, kv)
    with torch.no_grad():
        torch.testing.assert_close(full, plain(input_ids=x).logits, rtol=1e-4, atol=1e-5)


def test_fully_masked_query_rows_give_zero_like_pytorch_sdpa():
    # HF's left padding masks every key of a padded query: PyTorch's SDPA returns 0 there (safe
    # softmax), so does det attention, and no NaN reaches any gradient
    q, k, v = (torch.randn(2, 3, 5, 8, generator=_g(s)) for s in (20, 21, 22))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[1, :, :2] = False  # sequence 1: query rows 0 and 1 see nothing
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = det_scaled_dot_product_attention(qa, ka, va, attn_mask=mask)
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    ref.sum().backward()
    for a, b in ((qa, qr), (ka, kr), (va, vr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert_bitwise(det_scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=mask[:1]), out.detach()[:1], "row")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_llama_with_left_padding_is_hfs_loss(impl):
    from lightning_det.nn import det_transform

    plain, det = _hf("llama", impl), det_transform(_hf("llama", impl))
    x = torch.randint(0, 50, (3, 6), generator=_g(23))
    am = torch.ones(3, 6, dtype=torch.long)
    am[1, :2] = 0
    labels = x.masked_fill(am == 0, -100)
    with det_function_mode():
        out = det(input_ids=x, attention_mask=am, labels=labels)
    out.loss.backward()
    want = plain(input_ids=x, attention_mask=am, labels=labels).loss
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    assert all(torch.isfinite(p.grad).all() for p in det.parameters() if p.grad is not None)
