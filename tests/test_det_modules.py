"""Det modules: forward, input grad and parameter grads against fp64 and exact references;
row/position invariance at odd widths; digit-mode split invariance, with controls."""
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise, cuda
from torch import nn

import gen
from lightning_det.nn import (
    DetEmbedding,
    DetGELU,
    DetLayerNorm,
    DetReLU,
    DetRMSNorm,
    DetSiLU,
    DetTanh,
    DetSigmoid,
    DetQuickGELU,
    StepState,
    det_gelu,
    det_silu,
    det_tanh,
    det_sigmoid,
    finalize_grad_digits,
    set_grad_digits,
)
from lightning_det.reference import longacc_ref as R

# fp64 references written without cancellation: PyTorch's fp64 gelu forms 1 + erf(x/sqrt 2),
# which loses every digit for x < -8 (it returns -0.0 where the value is ~1e-16).
def _gelu64(x):
    return x * 0.5 * torch.special.erfc(-x * 0.5**0.5)


def _gelu_tanh64(x):
    return x * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))


REFS64 = {"gelu": _gelu64, "gelu_tanh": _gelu_tanh64, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}

ACTS = {
    "gelu": (lambda x: det_gelu(x), lambda x: F.gelu(x)),
    "gelu_tanh": (lambda x: det_gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "silu": (det_silu, F.silu),
    "tanh": (det_tanh, torch.tanh),
    "sigmoid": (det_sigmoid, torch.sigmoid),
}


def _within_rounding(got, ref, dtype, ulps=1.0, what=""):
    """|got - ref| <= ulps * ulp(ref) (+ the subnormal floor): ref is an fp64 tensor."""
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    err = (got.double() - ref).abs()
    bound = ref.abs() * eps * ulps + tiny * eps
    bad = ~(err <= bound)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} outside {ulps} ulp, e.g. x={ref[bad][:5]} got {got[bad][:5]}"


def _position_diffs(f, width=33, rows=64, seed=0):
    """Counts the positions where f's result for an element changes with the rows beside it or
    with its offset in the flat tensor."""
    x = gen.normal((rows, width), torch.float32, seed) * 3
    full = f(x)
    n = 0
    for m in range(1, rows):
        n += int((full[:m] != f(x[:m].clone())).sum())
    flat = x.flatten()
    for off in range(1, 17):
        part = flat[off:].clone()
        n += int((f(flat)[off:] != f(part)).sum())
    return n


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_forward_and_grad_vs_fp64(name, dtype):
    det, ref = ACTS[name][0], REFS64[name]
    x = torch.cat([gen.normal((4000,), torch.float32, 1) * 4, torch.linspace(-30, 30, 601),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 80.0, -80.0])]).to(dtype)
    xr = x.detach().double().requires_grad_()
    yr = ref(xr)
    gy = gen.normal(x.shape, dtype, 2)
    (gr,) = torch.autograd.grad(yr, xr, gy.double())
    if name == "tanh":  # autograd's fp64 1 - y*y cancels for |x| > 10; sech^2 does not
        gr = gy.double() / torch.cosh(x.double()) ** 2
    if name == "sigmoid":  # autograd's fp64 s (1 - s) cancels for large x; s sigmoid(-x) does not
        gr = gy.double() * torch.sigmoid(x.double()) * torch.sigmoid(-x.double())
    xd = x.clone().requires_grad_()
    y = det(xd)
    (g,) = torch.autograd.grad(y, xd, gy)
    assert y.dtype == dtype and g.dtype == dtype
    # computed in fp64 (~1e-15) and rounded once: within half an ulp plus a hair, so 1 ulp
    _within_rounding(y.detach(), yr.detach(), dtype, 1.0, f"{name} forward")
    _within_rounding(g, gr, dtype, 1.0, f"{name} grad")


def test_activation_specials():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38])
    for name, (det, ref) in ACTS.items():
        y, r = det(x), ref(x)
        # NaN stays NaN; +-inf and huge inputs give PyTorch's limits (silu/gelu(-inf) is NaN there too)
        assert torch.isnan(y[0]), name
        finite = torch.isfinite(r)
        assert torch.equal(y[1:][finite[1:]], r[1:][finite[1:]]), (name, y, r)


@pytest.mark.parametrize("width", [33, 123])
@pytest.mark.parametrize("name", list(ACTS))
def test_det_activation_is_position_invariant(name, width):
    det, _ = ACTS[name]
    assert _position_diffs(det, width) == 0
    x = gen.normal((37, width), torch.float32, 3) * 3
    gy = gen.normal((37, width), torch.float32, 4)
    xd = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(det(xd), xd, gy)
    for m in (1, 5, 36):
        xm = x[:m].clone().requires_grad_()
        (gm,) = torch.autograd.grad(det(xm), xm, gy[:m])
        assert_bitwise(gm, g[:m], f"{name} grad rows {m}")


def test_relu_is_position_invariant():
    assert _position_diffs(torch.relu, 33) == 0
    assert _position_diffs(DetReLU(), 123) == 0


def test_control_torch_cpu_activations_are_position_dependent():
    """DESIGN 8: PyTorch's vectorized CPU silu / gelu(tanh) give different bits for the same
    element depending on where it sits (vector body vs scalar tail) at odd widths."""
    found = {name: _position_diffs(ref, 33) for name, (_, ref) in ACTS.items()}
    print("torch CPU position-dependent results at width 33:", found)
    assert found["silu"] > 0 or found["gelu_tanh"] > 0, found


@pytest.mark.parametrize("mod, fn", [(DetGELU(), det_gelu), (DetGELU("tanh"), lambda x: det_gelu(x, "tanh")),
                                     (DetSiLU(), det_silu), (DetTanh(), det_tanh), (DetSigmoid(), det_sigmoid),
                                     (DetQuickGELU(), lambda x: x * det_sigmoid(1.702 * x))])
def test_activation_modules_call_the_kernels(mod, fn):
    x = gen.normal((5, 33), torch.float32, 7)
    assert_bitwise(mod(x), fn(x))


# ---------------------------------------------------------------- norms


def _norm_pair(kind, width, dtype=torch.float32, affine=True, seed=0):
    torch.manual_seed(seed)
    if kind == "layer":
        ref = nn.LayerNorm(width, dtype=torch.float64, elementwise_affine=affine)
        det = DetLayerNorm(width, dtype=dtype, elementwise_affine=affine)
    else:
        ref = nn.RMSNorm(width, eps=1e-6, dtype=torch.float64, elementwise_affine=affine)
        det = DetRMSNorm(width, eps=1e-6, dtype=dtype, elementwise_affine=affine)
    with torch.no_grad():
        for p, q in zip(det.parameters(), ref.parameters()):
            p.copy_(gen.normal(p.shape, dtype, seed + 11) * 0.5 + 1)
            q.copy_(p.double())
    return det, ref


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [33, 123])
def test_norm_vs_fp64_reference(kind, dtype, width):
    det, ref = _norm_pair(kind, width, dtype)
    x = (gen.normal((3, 7, width), torch.float32, 1) * 2 + 0.5).to(dtype)
    gy = gen.normal((3, 7, width), dtype, 2)
    xd = x.clone().requires_grad_()
    y = det(xd)
    y.backward(gy)
    xr = x.double().requires_grad_()
    yr = ref(xr)
    yr.backward(gy.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y.double(), yr.detach(), **tol)
    torch.testing.assert_close(xd.grad.double(), xr.grad, **tol)
    for p, q in zip(det.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol["rtol"], atol=tol["atol"] * 21)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_param_grads_are_exact_sums(kind):
    # weight = 1, bias = 0: the forward output *is* xhat, so dweight = exact sum of gy * y
    width, rows = 33, 40
    det = DetLayerNorm(width) if kind == "layer" else DetRMSNorm(width, eps=1e-6)
    x = gen.wide_exponents((rows, width), -8, 8, seed=3)
    gy = gen.wide_exponents((rows, width), -20, 20, seed=4)
    y = det(x)
    y.backward(gy)
    for j in range(width):
        sw, sb = R.ExactSum(), R.ExactSum()
        for r in range(rows):
            sw.add_product(float(gy[r, j]), float(y.detach()[r, j]))
            sb.add_value(float(gy[r, j]))
        assert det.weight.grad[j].item() == R.round_sum(sw), j
        if kind == "layer":
            assert det.bias.grad[j].item() == R.round_sum(sb), j


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("width", [33, 123])
def test_norm_rows_are_batch_invariant(kind, width):
    det, _ = _norm_pair(kind, width)
    x = gen.normal((50, width), torch.float32, 5) * 3 + 1
    gy = gen.normal((50, width), torch.float32, 6)
    xf = x.clone().requires_grad_()
    y = det(xf)
    y.backward(gy)
    for m in (1, 2, 7, 31, 49):
        xm = x[m - 1 :].clone().requires_grad_()  # a different row count *and* row offset
        ym = det(xm)
        ym.backward(gy[m - 1 :])
        assert_bitwise(ym.detach(), y.detach()[m - 1 :], f"forward rows {m}")
        assert_bitwise(xm.grad, xf.grad[m - 1 :], f"dx rows {m}")


def test_rstd_matches_python_sqrt():
    # the per-row fp64 sqrt/divide must be correctly rounded whether vectorized or not: an RMSNorm
    # of width 1 has var = fp32(x * x), so the op's rstd output is fp32(1 / sqrt(fp64(var + eps)))
    import math

    from lightning_det import _build

    _build.load()
    x = gen.normal((1001,), torch.float32, 9).abs() + 1e-3
    _, _, got = torch.ops.ldet.norm_forward(x.reshape(-1, 1), None, None, 1e-5, True)
    eps32 = torch.tensor(1e-5, dtype=torch.float32)
    var = (x.double() * x.double()).float()  # the exact product rounded once
    for i in range(x.shape[0]):
        t = float(var[i] + eps32)
        assert got[i].item() == float(torch.tensor(1.0 / math.sqrt(t), dtype=torch.float64).float()), i


def _split_grads(module, x, gy, splits, digits):
    for p in module.parameters():
        p.grad = None
    state = StepState() if digits else None
    set_grad_digits(module, state)
    for xs, gs in zip(x.split(splits), gy.split(splits)):
        module(xs).backward(gs)
    if digits:
        finalize_grad_digits(state, module.parameters())
    set_grad_digits(module, None)
    return [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_digit_mode_split_invariance_with_control(kind):
    det, _ = _norm_pair(kind, 123)
    x = gen.wide_exponents((96, 123), -6, 6, seed=7)
    gy = gen.wide_exponents((96, 123), -10, 10, seed=8)
    whole = _split_grads(det, x, gy, 96, True)
    for splits in ([48, 48], [10, 50, 36], [1] * 8 + [88]):
        for a, b in zip(whole, _split_grads(det, x, gy, splits, True)):
            assert_bitwise(a, b, f"digit-mode grads, splits {splits}")
    # non-digit mode on the whole batch is the same single rounding
    for a, b in zip(whole, _split_grads(det, x, gy, 96, False)):
        assert_bitwise(a, b, "rounded once vs digits")
    # control: PyTorch's own norm with .grad accumulation over micro-batches differs
    plain = nn.LayerNorm(123) if kind == "layer" else nn.RMSNorm(123, eps=1e-6)
    plain.load_state_dict(det.state_dict())
    pw = _split_grads(plain, x, gy, 96, False)
    ps = _split_grads(plain, x, gy, [10, 50, 36], False)
    assert not all(torch.equal(a, b) for a, b in zip(pw, ps)), "control: plain norm unexpectedly split-invariant"


def test_norm_options_and_errors():
    ln = DetLayerNorm((3, 11), bias=False)
    x = gen.normal((4, 3, 11))
    ref = nn.LayerNorm((3, 11), bias=False)
    torch.testing.assert_close(ln(x), ref(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalized_shape"):
        ln(gen.normal((4, 11, 3)))
    rms = DetRMSNorm(33)  # eps=None: finfo(dtype).eps, as PyTorch
    x = gen.normal((5, 33))
    torch.testing.assert_close(rms(x), nn.RMSNorm(33)(x), rtol=1e-5, atol=1e-6)
    plain = nn.LayerNorm(8)
    p = plain.weight
    assert DetLayerNorm.from_layer_norm(plain) is plain and plain.weight is p and type(plain) is DetLayerNorm


# ---------------------------------------------------------------- embedding


def _emb_exact_grad(idx, gy, V, dtype):
    onehot = F.one_hot(idx.reshape(-1), V).to(dtype)  # exact 0/1
    return R.gemm_rounded(onehot.t(), gy.reshape(-1, gy.shape[-1]).t().contiguous(), None, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_forward_and_exact_grad(dtype):
    torch.manual_seed(0)
    emb = DetEmbedding(11, 33, dtype=dtype)
    idx = torch.randint(0, 11, (6, 17))
    idx[0, :5] = 3  # many repeats of one row
    y = emb(idx)
    assert_bitwise(y.detach(), emb.weight.detach()[idx], "forward is a gather")
    gy = gen.wide_exponents((6, 17, 33), -30, 30, dtype, seed=1)
    y.backward(gy)
    assert_bitwise(emb.weight.grad, _emb_exact_grad(idx, gy, 11, dtype), "dweight vs exact")


@pytest.mark.parametrize("V,positions", [(40, 12), (12, 40)])
def test_embedding_grad_both_routes_exact(V, positions):
    # V > positions: only the occurring rows (torch.unique); V <= positions: every row's digits,
    # no host synchronization. Both must give the exact sums, +0.0 for rows that never occur
    # (assert_bitwise compares bytes: -0.0 would fail) and a zero padding row.
    torch.manual_seed(3)
    emb = DetEmbedding(V, 9, padding_idx=5)
    idx = torch.randint(0, min(V, 12), (positions,))  # rows >= 12 never occur
    idx[:3] = 5
    gy = gen.wide_exponents((positions, 9), -25, 25, seed=4)
    emb(idx).backward(gy)
    ref = _emb_exact_grad(idx, gy, V, torch.float32)
    ref[5] = 0
    assert_bitwise(emb.weight.grad, ref, f"V={V}, positions={positions}")


def test_embedding_padding_and_rejected_options():
    emb = DetEmbedding(7, 5, padding_idx=2)
    idx = torch.tensor([[2, 1, 2, 0]])
    emb(idx).backward(torch.ones(1, 4, 5))
    assert torch.equal(emb.weight.grad[2], torch.zeros(5))
    assert torch.equal(emb.weight.grad[1], torch.ones(5))
    ref = nn.Embedding(7, 5, padding_idx=2)
    ref.load_state_dict(emb.state_dict())
    ref(idx).backward(torch.ones(1, 4, 5))
    assert_bitwise(emb.weight.grad, ref.weight.grad)
    for kw in (dict(max_norm=1.0), dict(scale_grad_by_freq=True), dict(sparse=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            DetEmbedding(7, 5, **kw)
        with pytest.raises(ValueError, match=next(iter(kw))):
            DetEmbedding.from_embedding(nn.Embedding(7, 5, **kw))


def test_embedding_grad_split_and_order_invariance_with_control():
    torch.manual_seed(1)
    emb = DetEmbedding(5, 33)
    idx = torch.randint(0, 5, (256,))
    gy = gen.wide_exponents((256, 33), -20, 20, seed=2)
    whole = _split_grads(emb, idx, gy, 256, False)[0]
    for splits in ([128, 128], [1, 100, 155], [64] * 4):
        assert_bitwise(whole, _split_grads(emb, idx, gy, splits, True)[0], f"digit mode, splits {splits}")
    perm = torch.randperm(256)
    assert_bitwise(whole, _split_grads(emb, idx[perm], gy[perm], 256, False)[0], "token order")
    plain = nn.Embedding(5, 33)
    plain.load_state_dict(emb.state_dict())
    pw = _split_grads(plain, idx, gy, 256, False)[0]
    ps = _split_grads(plain, idx, gy, [1, 100, 155], False)[0]
    assert not torch.equal(pw, ps), "control: plain nn.Embedding unexpectedly split-invariant"


# ---------------------------------------------------------------- CUDA == CPU


def _cpu_cuda(module_fn, x, gy, grad_x=True):
    out = []
    for dev in ("cpu", "cuda"):
        m = module_fn().to(dev)
        xi = x.to(dev)
        if grad_x:
            xi = xi.clone().requires_grad_()
        y = m(xi)
        y.backward(gy.to(dev))
        out.append([y.detach().cpu()] + ([xi.grad.cpu()] if grad_x else []) + [p.grad.cpu() for p in m.parameters()])
    for a, b in zip(*out):
        assert_bitwise(a, b, "cpu vs cuda")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [33, 123, 384])
def test_cuda_matches_cpu(dtype, width):
    x = (gen.normal((37, width), torch.float32, 1) * 3).to(dtype)
    gy = gen.normal((37, width), dtype, 2)
    for name in ACTS:
        det, _ = ACTS[name]
        _cpu_cuda(lambda: _Fn(det), x, gy)
    _cpu_cuda(lambda: _norm_pair("layer", width, dtype)[0], x, gy)
    _cpu_cuda(lambda: _norm_pair("rms", width, dtype)[0], x, gy)
    torch.manual_seed(0)
    idx = torch.randint(0, 9, (37,))
    for V in (9, 50):  # every row's digits (V <= 37 positions), only the occurring rows (V > 37)
        w = gen.normal((V, width), dtype, 3)

        def emb():
            e = DetEmbedding(V, width, dtype=dtype)
            with torch.no_grad():
                e.weight.copy_(w)
            return e

        _cpu_cuda(emb, idx, gy, grad_x=False)


class _Fn(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize("take", [False, True])
def test_add_grad_digits_in_place_sum_equals_det_combine(take):
    # Gradient accumulation adds each micro-batch's digits into the pending ones. A handed-over
    # (take=True) or previously summed accumulator is added into in place; the result must be
    # det_combine's exact canonical sum, and a caller's tensor passed with take=False must never
    # be written. Values: wide magnitudes, cancellation across contributions, NaN/inf counters.
    from lightning_det.ops import det_combine, to_digits

    g = torch.Generator().manual_seed(90)
    vals = [torch.randn(6, 5, generator=g) * torch.pow(2.0, torch.randint(-60, 60, (6, 5), generator=g).float())
            for _ in range(4)]
    vals[1] = -vals[0] + vals[1] * 2.0 ** -40  # cancels contribution 0 almost exactly
    vals[2][0, 0], vals[3][1, 1], vals[3][2, 2] = float("inf"), float("nan"), float("-inf")
    accs = [to_digits(v) for v in vals]
    before = [a.clone() for a in accs]
    p = torch.nn.Parameter(torch.zeros(6, 5))
    state = StepState()
    for a in accs:
        state.add_grad_digits(p, a, take=take)
    assert torch.equal(state.grad_digits(p), det_combine(before)), "pending digits != exact canonical sum"
    if not take:
        assert all(torch.equal(a, b) for a, b in zip(accs, before)), "a caller's tensor was written"
    else:
        assert not torch.equal(accs[0], before[0]), "control: with take=True the first tensor is summed into"


@cuda
@pytest.mark.parametrize(
    "shape,dtypes",
    [((4096, 33), (torch.float32, torch.float32)), ((5, 3000), (torch.bfloat16, torch.bfloat16)),
     ((1000, 70), (torch.float16, torch.float32)), ((0, 5), (torch.float32, torch.float32)),
     ((7, 0), (torch.float32, torch.float32))],
)
def test_cuda_row_and_col_sums_chunked_match_cpu_and_reference(shape, dtypes):
    # The CUDA sums split each output's elements into chunks (64 at least, ~64K threads) and add
    # the partial digits; the CPU sums each output in one pass. Wide exponents make the partials
    # cancel across chunks; a NaN and an inf land in different chunks of one column.
    from lightning_det.nn import det_col_sums, det_row_sums

    a = gen.wide_exponents(shape, -60, 60, seed=5).to(dtypes[0])
    b = gen.wide_exponents(shape, -30, 30, seed=6).to(dtypes[1])
    if shape == (4096, 33):
        a[10, 3], a[4000, 3], a[2000, 4] = float("nan"), float("inf"), float("-inf")
    for fn in (det_row_sums, det_col_sums):
        for bb in (b, None):
            cpu = fn(a, bb)
            gpu = fn(a.cuda(), None if bb is None else bb.cuda()).cpu()
            assert torch.equal(cpu, gpu), f"{fn.__name__} b={'yes' if bb is not None else 'no'}: cuda != cpu"
    # an independent exact reference for a few outputs of the column sums
    got = det_col_sums(a.cuda(), b.cuda()).cpu()
    for j in range(min(3, shape[1])):
        s = R.ExactSum()
        for r in range(shape[0]):
            s.add_product(float(a[r, j]), float(b[r, j]))
        assert got[j].tolist() == R.digits_of(s), f"column {j} != exact reference"


def _window_cases():
    """Rows whose terms enter, miss and re-enter a 128-bit window (csrc/window_acc.h): the first
    term places it, so each row starts with a different magnitude."""
    g = torch.Generator().manual_seed(77)
    n = 300
    rows = []
    base = torch.randn(n, generator=g)
    rows.append(base * 2.0 ** 40)  # all within ~2^-4..2^44: one window
    r = base.clone()
    r[0] = 2.0 ** -100  # a tiny first term places the window low: the rest lie above it
    rows.append(r)
    r = base * 2.0 ** -60
    r[0] = 2.0 ** 100  # a huge first term: the rest lie below it
    rows.append(r)
    r = torch.cat([base[:150], -base[:150]])  # cancels to exactly zero inside the window
    rows.append(r)
    r = -base.abs() * torch.pow(2.0, torch.randint(-120, 120, (n,), generator=g).float())  # negative, wide
    rows.append(r)
    r = base.clone()
    r[5], r[9] = 2.0 ** -149, -(2.0 ** 127)  # the fp32 extremes beside ordinary terms
    rows.append(r)
    r = torch.zeros(n)
    r[0], r[7] = -(2.0 ** 20), -(2.0 ** 20)  # a negative window whose low 64 bits are zero (the negation's carry)
    rows.append(r)
    return torch.stack(rows)


@pytest.mark.parametrize("with_b", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_row_and_col_sums_through_the_window_match_exact_reference(with_b, device):
    # The dot kernels add most terms to a 128-bit window and the rest, and each 2^16 terms'
    # window, to the digits (csrc/window_acc.h). Each row places its window at its first term:
    # terms below and above it, exact cancellation, negative sums, fp32 extremes; a long row
    # passes a flush; the column sums run one window per column.
    from lightning_det.nn import det_col_sums, det_row_sums

    a = _window_cases()
    long_row = gen.wide_exponents((1, 70000), -20, 20, seed=8)  # > 2^16 terms: a flush mid-row
    b = gen.normal(a.shape, seed=9) if with_b else None
    b_long = gen.normal(long_row.shape, seed=10) if with_b else None

    def reference(x, y, j, by_rows):
        s = R.ExactSum()
        v = x[j] if by_rows else x[:, j]
        w = None if y is None else (y[j] if by_rows else y[:, j])
        for k in range(v.numel()):
            s.add_product(float(v[k]), 1.0 if w is None else float(w[k]))
        return R.digits_of(s)

    def on(fn, x, y):  # on `device` (CUDA: each output's elements in chunks, a window per chunk)
        return fn(x.to(device), None if y is None else y.to(device)).cpu()

    def t(x):
        return None if x is None else x.T.contiguous()

    rows = on(det_row_sums, a, b)
    for j in range(a.shape[0]):
        assert rows[j].tolist() == reference(a, b, j, True), f"row {j} != exact reference"
    assert on(det_row_sums, long_row, b_long)[0].tolist() == reference(long_row, b_long, 0, True), "long row"
    cols = on(det_col_sums, t(a), t(b))
    for j in range(a.shape[0]):
        assert cols[j].tolist() == reference(a, b, j, True), f"column {j} != exact reference"
    assert on(det_col_sums, t(long_row), t(b_long))[0].tolist() == reference(long_row, b_long, 0, True), "long column"
    # control: plain PyTorch's rounded sums are not the exact sums rounded once
    from lightning_det.ops import det_finalize

    plain = (a if b is None else a * b).sum(1)
    assert not torch.equal(plain, det_finalize(rows, torch.float32)), "control: torch.sum matched the exact sums"
