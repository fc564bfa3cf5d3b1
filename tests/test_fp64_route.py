"""The fp64 route (csrc/fp64_bound.h): rounded det_gemm outputs from one fp64 GEMM whose proven
error bound decides each output's rounding, the undecided ones recomputed from the operands (a
compensated sum, else the long accumulator). Every output must equal the exact sum rounded once:
against the long-accumulator kernel and the exact Python reference, on data built so that each
of the three ways decides some outputs, and on the GPU against the CPU. The controls show that
the fp64 GEMM rounded once more gets such outputs wrong."""
import pytest
import torch
from conftest import SLICE_OUT_DTYPES, assert_bitwise, both_paths, cuda

import gen
from lightning_det.nn import DetLinear
from lightning_det.ops import det_gemm, gemm_path, last_fp64_counts
from lightning_det.reference import longacc_ref as R


def fp64_and_kernel(x, w, bias=None, out_dtype=torch.float32):
    """(kernel's, fp64 route's, the fp64 route's counts)."""
    with gemm_path("kernel"):
        ref = det_gemm(x, w, bias, out_dtype=out_dtype)
    with gemm_path("fp64"):
        got = det_gemm(x, w, bias, out_dtype=out_dtype)
        counts = last_fp64_counts()
    return ref, got, counts


def naive_fp64(x, w, bias=None, out_dtype=torch.float32):
    """The control: the fp64 GEMM (plus the bias) rounded once more, with no bound."""
    d = x.double() @ w.double().T
    if bias is not None:
        d = d + bias.double()
    return d.to(out_dtype)


@pytest.mark.parametrize("K", [1, 7, 64, 1000])
@pytest.mark.parametrize("out_dtype", SLICE_OUT_DTYPES)
def test_random_normal_matches_kernel(K, out_dtype):
    x, w, b = gen.normal((70, K), seed=1), gen.normal((50, K), seed=2), gen.normal((50,), seed=3)
    for bias in (None, b):
        ref, got, _ = fp64_and_kernel(x, w, bias, out_dtype)
        assert_bitwise(got, ref, f"K {K}, {out_dtype}, bias {bias is not None}")


def test_bound_leaves_some_outputs_to_the_compensated_sum():
    # K = 4096 random normal: ~1% of outputs lie within the fp64 GEMM's bound of a rounding boundary
    x, w = gen.normal((64, 4096), seed=4), gen.normal((48, 4096), seed=5)
    ref, got, counts = fp64_and_kernel(x, w)
    assert_bitwise(got, ref, "K 4096")
    assert counts["undecided"] > 0, counts
    assert counts["exact"] < counts["undecided"], counts  # the compensated sum decided most of them


def test_cancellation_against_reference_and_control():
    # huge products that cancel exactly plus tiny terms that decide the result: the fp64 GEMM loses
    # the tiny terms; the bound must send those outputs on, and the recomputation get them right
    pairs = [gen.cancellation(seed=s) for s in range(6)]
    x = torch.cat([p[0] for p in pairs])
    w = torch.cat([p[1] for p in pairs])
    ref = R.gemm_rounded(x, w)
    _, got, counts = fp64_and_kernel(x, w)
    assert_bitwise(got, ref, "cancellation vs the exact reference")
    assert counts["undecided"] > 0, counts
    assert not torch.equal(naive_fp64(x, w), ref), "control: the fp64 GEMM rounded once more got every output right"


def test_ties_and_zeros_are_certified_exact():
    # small integers: exact zeros (+0.0 whatever the products' signs) and, scaled into fp32's
    # subnormals, exact ties between two neighbours: no bound decides them, but their fp64 sums
    # are exact, which the certificate (csrc/fp64_bound.h, step 2) proves: no long accumulator
    g = torch.Generator().manual_seed(6)
    xi = torch.randint(-3, 4, (40, 96), generator=g).float()
    wi = torch.randint(-3, 4, (30, 96), generator=g).float()
    for x, w, what in ((xi, wi, "integers"), (xi * 2.0**-130, wi * 2.0**-20, "subnormal ties")):
        for out_dtype in SLICE_OUT_DTYPES:
            ref, got, counts = fp64_and_kernel(x, w, None, out_dtype)
            assert_bitwise(got, ref, f"{what}, {out_dtype}")
            assert counts["undecided"] > 0 and counts["exact"] == 0, (what, out_dtype, counts)
    ref = R.gemm_rounded(xi * 2.0**-130, wi * 2.0**-20)
    _, got, _ = fp64_and_kernel(xi * 2.0**-130, wi * 2.0**-20)
    assert_bitwise(got, ref, "subnormal ties vs the exact reference")
    _, got, _ = fp64_and_kernel(xi, wi)
    zeros = got == 0
    assert zeros.any() and not torch.signbit(got[zeros]).any(), "an exact zero must read +0.0"
    # with a bias: the certificate takes the bias's lowest bit too
    b = torch.tensor([0.5, -0.25, 2.0**-149, 3.0, -0.0] * 6)
    ref, got, counts = fp64_and_kernel(xi * 2.0**-130, wi * 2.0**-20, b)
    assert_bitwise(got, ref, "subnormal ties + bias")


def bf16_tie_operands(M, N, K, seed):
    """bf16 integers whose exact dot products (about 2^25-2^26) often lie halfway between two fp32
    values, as the example model's bf16 activations and weights often do, and the exact products
    as int64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, 256, (M, K), generator=g).to(torch.bfloat16)
    w = torch.randint(-64, 256, (N, K), generator=g).to(torch.bfloat16)
    return x, w, x.long() @ w.long().T


def fp32_ties(exact):
    """Which int64 values lie exactly halfway between two neighbouring fp32 values."""
    a = exact.abs()
    ulp = torch.where(a >= 2**24, 2 ** (torch.floor(torch.log2(a.double())).long() - 23), torch.ones_like(a))
    return (a >= 2**24) & (a % ulp == ulp // 2)


def test_bf16_sums_on_fp32_ties_are_certified():
    x, w, exact = bf16_tie_operands(48, 40, 4096, seed=30)
    ties = fp32_ties(exact)
    assert ties.float().mean() > 0.1, "control: the data holds no exact ties"
    ref, got, counts = fp64_and_kernel(x, w)
    assert_bitwise(got, ref, "bf16 ties vs the kernel")
    assert_bitwise(got, exact.double().float(), "bf16 ties vs the int64 products rounded once")
    assert counts["undecided"] >= int(ties.sum()), counts  # a tie lies on a rounding boundary
    assert counts["exact"] == 0, counts


def spread_ties(M, N, seed):
    """(M, 4) x (N, 4) fp32: each output 1 + 2^-24 (a tie: 1.0) or 1 - 2^-24 (an fp32 value) hidden
    between +-s 2^60: 84 bits apart, beyond the certificate, so the long accumulator decides."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(1, 8, (M, 1), generator=g).float() * 2.0**60
    x = torch.cat([s, torch.ones(M, 1), torch.full((M, 1), 2.0**-24), -s], 1)
    sign = torch.randint(0, 2, (N, 1), generator=g).float() * 2 - 1
    w = torch.cat([torch.ones(N, 2), sign, torch.ones(N, 1)], 1)
    return x, w


def test_ties_beyond_the_certificate_go_to_the_long_accumulator():
    x, w = spread_ties(20, 16, seed=31)
    ref = R.gemm_rounded(x, w)
    for out_dtype in SLICE_OUT_DTYPES:
        kref, got, counts = fp64_and_kernel(x, w, None, out_dtype)
        assert_bitwise(got, kref, f"spread ties, {out_dtype}")
        assert counts["exact"] == counts["undecided"] == 20 * 16, (out_dtype, counts)
    _, got, _ = fp64_and_kernel(x, w)
    assert_bitwise(got, ref, "spread ties vs the exact reference")
    assert not torch.equal(naive_fp64(x, w), ref), "control: the fp64 GEMM rounded once more got them right"


def test_pair_ties_against_reference_and_control():
    # outputs a hair beside fp32 rounding ties (2^-56 and 2^-80 relative), each sign and scale
    for scale in (0, 100, 126, -65):
        for tail in (1.0, -1.0):
            x, w = gen.fp32_pair_ties(scale, tail)
            ref = R.gemm_rounded(x, w)
            _, got, _ = fp64_and_kernel(x, w)
            assert_bitwise(got, ref, f"pair ties scale {scale} tail {tail}")
    x, w = gen.fp32_pair_ties(0, 1.0)
    assert not torch.equal(naive_fp64(x, w), R.gemm_rounded(x, w)), "control: no tie was rounded wrongly"


def test_specials_overflow_and_underflow():
    x, w = gen.normal((12, 40), seed=7), gen.normal((9, 40), seed=8)
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    w[4, 0] = -float("inf")
    x[5, 0], w[5, 0] = 0.0, float("inf")  # 0 * inf: output (5, 5) is NaN
    big = torch.full((3, 40), 2.0**100)
    x = torch.cat([x, big, -big])
    w = torch.cat([w, torch.full((2, 40), 2.0**27), gen.subnormals((2, 40), seed=9)])
    for bias in (None, torch.tensor([0.0, 1.0, -1.0, 2.0**-140, 3e38, -3e38, 0.5, 1e-45, 2.0, -2.0, 7.0, -0.0, 1.0])):
        for out_dtype in SLICE_OUT_DTYPES:
            ref, got, _ = fp64_and_kernel(x, w, bias, out_dtype)
            assert_bitwise(got, ref, f"specials, {out_dtype}, bias {bias is not None}")
    ref = R.gemm_rounded(x, w)
    _, got, _ = fp64_and_kernel(x, w)
    assert_bitwise(got, ref, "specials vs the exact reference")
    assert torch.isinf(got).any() and torch.isnan(got).any()


def test_wide_exponents_and_mixed_dtypes():
    x = gen.wide_exponents((33, 150), -40, 40, seed=10)
    w = gen.wide_exponents((21, 150), -40, 40, torch.bfloat16, seed=11)
    b = gen.normal((21,), torch.float16, seed=12)
    for out_dtype in SLICE_OUT_DTYPES:
        ref, got, _ = fp64_and_kernel(x, w, b, out_dtype)
        assert_bitwise(got, ref, f"wide exponents, mixed dtypes, {out_dtype}")


def test_transposed_views_and_single_rows():
    # DetLinear's backward passes transposed views; M = 1, N = 1 and K = 1 take the same route
    a = gen.normal((80, 60), seed=13)
    c = gen.normal((80, 45), seed=14)
    for x, w in ((a.t(), c.t()), (a[:1], c.t()[:, :60]), (a[:, :1], c[:, :1]), (a.t()[:, :1], a.t()[:1, :1])):
        ref, got, _ = fp64_and_kernel(x, w)
        assert_bitwise(got, ref, f"views {tuple(x.shape)} x {tuple(w.shape)}")


def test_detlinear_forward_backward_matches_kernel():
    torch.manual_seed(0)
    lin = DetLinear(96, 40)
    x = gen.normal((130, 96), seed=15)
    outs = {}
    for path in ("kernel", "fp64"):
        lin.zero_grad()
        xi = x.clone().requires_grad_(True)
        with gemm_path(path):
            y = lin(xi)
            (y * gen.normal(y.shape, seed=16)).sum().backward()
        outs[path] = (y.detach(), xi.grad, lin.weight.grad, lin.bias.grad)
    for a, b, what in zip(outs["kernel"], outs["fp64"], ("y", "dx", "dW", "db")):
        assert_bitwise(b, a, f"DetLinear {what}")


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path: expected one of"):
        with gemm_path("fp64_fast"):
            pass


@cuda
@pytest.mark.parametrize("out_dtype", SLICE_OUT_DTYPES)
def test_cuda_matches_cpu(out_dtype):
    cases = [
        (gen.normal((300, 4096), seed=20), gen.normal((260, 4096), seed=21), gen.normal((260,), seed=22)),
        (gen.wide_exponents((64, 512), -30, 30, seed=23), gen.normal((72, 512), torch.bfloat16, seed=24), None),
        (torch.randint(-3, 4, (50, 300)).float() * 2.0**-130, torch.randint(-3, 4, (40, 300)).float() * 2.0**-20,
         None),
    ]
    pairs = [gen.cancellation(seed=s) for s in range(4)]
    cases.append((torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]), None))
    # about half of these outputs are exact ties or zeros: more marks than the GPU's list holds
    # (one output in 8, csrc/cuda/fp64_bound_cuda.cu), so its sweep recomputes the rest
    g = torch.Generator().manual_seed(29)
    cases.append((torch.randint(-3, 4, (400, 64), generator=g).float() * 2.0**-130,
                  torch.randint(-3, 4, (300, 64), generator=g).float() * 2.0**-20, None))
    cases.append(spread_ties(400, 300, seed=32) + (None,))
    cases.append(bf16_tie_operands(96, 80, 4096, seed=33)[:2] + (None,))
    for i, (x, w, b) in enumerate(cases):
        with gemm_path("kernel"):
            ref = det_gemm(x, w, b, out_dtype=out_dtype)
        with gemm_path("fp64"):
            got = det_gemm(x.cuda(), w.cuda(), None if b is None else b.cuda(), out_dtype=out_dtype)
            counts = last_fp64_counts()
        assert_bitwise(got.cpu(), ref, f"case {i}, {out_dtype}: CUDA fp64 route vs the CPU kernel")
        if i == 0 and out_dtype == torch.float32:
            assert counts["undecided"] > 0, counts
        if i == 2:  # ties and zeros: the exactness certificate, never the long accumulator
            assert counts["undecided"] > 0 and counts["exact"] == 0, counts
        if i == 3:
            assert counts["exact"] > 0, counts
        if i == 4:
            if out_dtype == torch.float32:  # (bf16 / fp16: these tiny outputs round to zeros)
                assert counts["undecided"] > 400 * 300 // 8 + 1024, counts
            assert counts["exact"] == 0, counts  # the sweep's certificate
        if i == 5:  # every output to the long accumulator, most through the sweep
            assert counts["exact"] == counts["undecided"] == 400 * 300, counts
        if i == 6 and out_dtype == torch.float32:  # fp32 ties (bf16 / fp16 outputs: none here)
            assert counts["undecided"] > 0 and counts["exact"] == 0, counts
    # transposed operands on the GPU (DetLinear's backward)
    a, c = gen.normal((513, 257), seed=25), gen.normal((513, 129), seed=26)
    with gemm_path("kernel"):
        ref = det_gemm(a.t(), c.t(), out_dtype=out_dtype)
    with gemm_path("fp64"):
        got = det_gemm(a.cuda().t(), c.cuda().t(), out_dtype=out_dtype)
    assert_bitwise(got.cpu(), ref, f"transposed views, {out_dtype}")


@cuda
def test_cuda_auto_takes_the_route_for_fp32():
    x, w = gen.normal((1024, 1024), seed=27).cuda(), gen.normal((1024, 1024), seed=28).cuda()
    with gemm_path("auto"):
        det_gemm(x[:1, :8], w[:8, :8])  # too small for the route: its counts read zero
        assert last_fp64_counts() == {"undecided": 0, "exact": 0}
        got = det_gemm(x, w)
        counts = last_fp64_counts()
    with gemm_path("kernel"):
        ref = det_gemm(x, w)
    assert_bitwise(got, ref, "auto on CUDA")
    assert counts["undecided"] > 0, counts
