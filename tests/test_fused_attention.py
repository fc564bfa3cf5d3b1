"""The fused deterministic attention kernels (ldet::attention_fwd / attention_bwd / attention_probs):
bit for bit the plain-PyTorch evaluation of their definition (csrc/attention.h) on odd shapes,
the same bytes on CPU and CUDA, nothing of size (L, L) kept on the GPU, and skipped keys that
cannot reach any output."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise, cuda
from helpers.attention_inputs import attention_dropout, attention_inputs

from lightning_det.nn import det_scaled_dot_product_attention
from lightning_det.ops.attention import AttentionDropout, attention_backward, attention_forward, attention_probs
from lightning_det.ops.dropout import DropoutKey
from lightning_det.reference.attention_ref import (attention_backward_ref, attention_forward_ref,
                                                    attention_weights_ref, fma32)


def _g(seed):
    return torch.Generator().manual_seed(seed)


# (B, H, Hkv, Lq, Lk, E, Ev, mask, causal, dropout)
CASES = [
    (2, 3, 3, 9, 9, 8, 8, None, True, False),
    (1, 4, 2, 7, 11, 5, 13, "bool", False, True),   # grouped-query heads, Lq != Lk, E != Ev
    (2, 2, 1, 6, 5, 33, 3, "float", False, False),  # odd widths, every head on one key/value head
    (1, 2, 2, 13, 13, 16, 16, None, True, True),
    (1, 1, 1, 4, 9, 7, 7, None, True, False),       # causal with more keys than queries
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cpu_kernels_are_the_reference_definition(case, dtype):
    b, h, hkv, lq, lk, e, ev, mask, causal, drop = case
    q, k, v, do, m = attention_inputs(b, h, hkv, lq, lk, e, ev, dtype, mask)
    scale = 1.0 / math.sqrt(e)
    dropout = attention_dropout(drop, b)
    o, stats = attention_forward(q, k, v, m, scale, causal, dropout)
    o_ref, stats_ref = attention_forward_ref(q, k, v, m, scale, causal, dropout)
    assert_bitwise(o, o_ref, "o")
    assert_bitwise(stats, stats_ref, "stats")
    grads = attention_backward(do, q, k, v, o, stats, m, scale, causal, dropout)
    refs = attention_backward_ref(do, q, k, v, o, m, scale, causal, dropout)
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert_bitwise(got, want, name)
    assert_bitwise(attention_probs(q, k, stats, m, scale, causal), attention_weights_ref(q, k, m, scale, causal),
                   "probs")


def test_the_reference_has_teeth():
    # fma32 is the one correct rounding (exact rationals), where a rounded product then a sum is not
    from fractions import Fraction
    g = _g(1)
    a, b = torch.randn(4000, generator=g), torch.randn(4000, generator=g)
    c = torch.randn(4000, generator=g) * 1e-3
    f = fma32(a, b, c)
    for i in range(0, 4000, 97):
        exact = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        err = abs(Fraction(f[i].item()) - exact)
        for nb in (torch.nextafter(f[i], torch.tensor(-math.inf)), torch.nextafter(f[i], torch.tensor(math.inf))):
            assert err <= abs(Fraction(nb.item()) - exact)
    assert not torch.equal(f, a * b + c)
    # the output chain differs from another summation of the same terms (PyTorch's matmul): the
    # bitwise checks above can fail
    q, k, v, _, _ = attention_inputs(2, 2, 2, 40, 40, 16, 16, torch.float32)
    o, stats = attention_forward(q, k, v, None, 0.25, True)
    p = attention_probs(q, k, stats, None, 0.25, True)
    assert not torch.equal(o, p @ v)
    torch.testing.assert_close(o, p @ v, rtol=1e-5, atol=1e-6)


def test_skipped_keys_never_reach_an_output():
    # a key a query may not attend adds no term, so inf or NaN there changes nothing for it
    q, k, v, do, _ = attention_inputs(1, 2, 2, 8, 8, 8, 8, torch.float32, seed=3)
    base = attention_forward(q, k, v, None, 0.3, True)
    v2, k2 = v.clone(), k.clone()
    v2[..., 5:, :] = float("inf")
    k2[..., 5:, 0] = float("nan")
    o2, st2 = attention_forward(q, k2, v2, None, 0.3, True)
    assert_bitwise(o2[..., :5, :], base[0][..., :5, :], "rows before the non-finite keys")
    assert_bitwise(st2[..., :5, :], base[1][..., :5, :], "their statistics")
    assert o2[..., 5:, :].isnan().all()


def test_rows_with_nothing_to_attend_give_zero():
    q, k, v, do, _ = attention_inputs(1, 1, 1, 3, 4, 4, 4, torch.float32, seed=4)
    m = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    m[0, 0, 1] = False
    o, stats = attention_forward(q, k, v, m, 0.5, False)
    assert torch.equal(o[0, 0, 1], torch.zeros(4)) and stats[0, 0, 1].tolist() == [0.0, 0.0]
    dq, dk, dv = attention_backward(do, q, k, v, o, stats, m, 0.5, False)
    assert torch.equal(dq[0, 0, 1], torch.zeros(4))
    assert all(t.isfinite().all() for t in (dq, dk, dv))


def test_argument_errors():
    q, k, v, do, _ = attention_inputs(1, 2, 2, 3, 3, 4, 4, torch.float32)
    with pytest.raises(RuntimeError, match="k: expected a number of heads dividing q.s 2, got 3"):
        k3 = torch.randn(1, 3, 3, 4)
        attention_forward(q, k3, k3, None, 0.5, False)
    # integers in the message: formatted without iostreams (csrc/check.h)
    with pytest.raises(RuntimeError, match=r"head dimensions in \[1, 256\], got E = 257 and Ev = 257"):
        z = torch.zeros(1, 1, 2, 257)
        attention_forward(z, z, z, None, 0.5, False)
    with pytest.raises(RuntimeError, match="mask: expected None when causal"):
        attention_forward(q, k, v, torch.ones(3, 3, dtype=torch.bool), 0.5, True)
    with pytest.raises(ValueError, match="mask: expected a shape broadcastable"):
        attention_forward(q, k, v, torch.ones(2, 5, dtype=torch.bool), 0.5, False)
    with pytest.raises(RuntimeError, match="v: expected dtype"):
        attention_forward(q, k, v.double(), None, 0.5, False)
    o, stats = attention_forward(q, k, v, None, 0.5, False)
    with pytest.raises(RuntimeError, match="stats: expected the forward's"):
        attention_backward(do, q, k, v, o, stats[..., :1].contiguous(), None, 0.5, False)
    with pytest.raises(ValueError, match="dropout: expected key.samples == 1"):
        attention_forward(q, k, v, None, 0.5, False, AttentionDropout(0.1, DropoutKey(0, 0, 0, 2, 0)))


# ---- CUDA -----------------------------------------------------------------------------------------

def _both(case, dtype, seed):
    b, h, hkv, lq, lk, e, ev, mask, causal, drop = case
    q, k, v, do, m = attention_inputs(b, h, hkv, lq, lk, e, ev, dtype, mask, seed)
    scale = 1.0 / math.sqrt(e)
    dropout = attention_dropout(drop, b)
    out = []
    for dev in ("cpu", "cuda"):
        t = [x.to(dev) for x in (q, k, v, do)]
        mm = None if m is None else m.to(dev)
        o, st = attention_forward(*t[:3], mm, scale, causal, dropout)
        g = attention_backward(t[3], *t[:3], o, st, mm, scale, causal, dropout)
        p = attention_probs(t[0], t[1], st, mm, scale, causal) if lq * lk <= 1 << 20 else None
        out.append([o, st, *g] + ([] if p is None else [p]))
    return out


# shapes across several tiles of each kernel, head dims of each tile class, tails everywhere
CUDA_CASES = [
    (2, 4, 4, 200, 200, 64, 64, None, True, False),
    (1, 4, 2, 130, 77, 64, 64, "bool", False, True),
    (1, 2, 2, 97, 97, 128, 128, None, True, True),
    (2, 2, 1, 70, 150, 80, 48, "float", False, False),
    (1, 2, 2, 65, 65, 256, 200, None, True, False),
    (1, 3, 3, 33, 40, 5, 13, None, False, False),
]


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_cuda_gives_the_cpu_bytes(case, dtype):
    cpu, gpu = _both(case, dtype, seed=5)
    for name, a, b in zip(("o", "stats", "dq", "dk", "dv", "probs"), cpu, gpu):
        assert_bitwise(b.cpu(), a, f"cuda {name}")


@cuda
def test_cuda_seq_4096_fits_and_matches_flash_within_rounding():
    # (B, H, L, E) = (2, 12, 4096, 64) bf16: the (L, L) scores of all slices would be 1.5 GiB in
    # fp32; the fused kernels keep O(B H L E)
    torch.manual_seed(0)
    b, h, lq, e = 2, 12, 4096, 64
    q, k, v, do = (torch.randn(b, h, lq, e, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = det_scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    out.backward(do)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    operand = q.numel() * 4  # one operand in fp32
    assert extra < 16 * operand, f"peak {extra / 2**20:.0f} MiB above the inputs"
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ro = F.scaled_dot_product_attention(*ref, is_causal=True)
    ro.backward(do)
    for name, got, want in (("out", out, ro), ("dq", qq.grad, ref[0].grad), ("dk", kk.grad, ref[1].grad),
                            ("dv", vv.grad, ref[2].grad)):
        err = (got.float() - want.float()).abs().max().item()
        assert err < 0.05 * want.float().abs().max().item(), f"{name}: max error {err}"
    # and the bytes of one slice computed alone
    one = det_scaled_dot_product_attention(q[1:, 5:6], k[1:, 5:6], v[1:, 5:6], is_causal=True)
    assert_bitwise(one, out.detach()[1:, 5:6], "slice (1, 5) alone")
