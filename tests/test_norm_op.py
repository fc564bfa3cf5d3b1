"""The fused norm ops ``ldet::norm_forward`` / ``ldet::norm_backward`` (the arithmetic of
DetLayerNorm and DetRMSNorm, one op each) against the plain reference
(lightning_det/reference/norm_ref.py): the same bytes for every dtype, affine variant and odd
width; rows independent of the row count; NaN/inf kept to their rows; argument checks that name
the argument; CUDA == CPU. The control shows PyTorch's own norms give other bytes on the data.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gen
from conftest import assert_bitwise, cuda
from lightning_det import _build
from lightning_det.reference.norm_ref import norm_backward_ref, norm_forward_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
AFFINE = ["weight_bias", "weight", "bias", "none"]
SHAPES = [(5, 33), (5, 123), (1, 1)]


def _ops():
    _build.load()
    return torch.ops.ldet


def _eps(rms: bool) -> float:
    return 1e-6 if rms else 1e-5  # neither is an fp32 value: the op must round eps to fp32 itself


def _x(rows: int, width: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Rows of five kinds in turn: N(0,1); N(0,1) * 2^-8; N(0,1) * 2^6; 1e3 + N(0,1) (a large
    mean: x - mean cancels, and fp32 sums of x lose the low bits); random exponents in
    [2^-6, 2^7)."""
    kinds = [
        gen.normal((rows, width), torch.float32, seed),
        gen.normal((rows, width), torch.float32, seed + 1) * 2.0**-8,
        gen.normal((rows, width), torch.float32, seed + 2) * 2.0**6,
        gen.normal((rows, width), torch.float32, seed + 3) + 1e3,
        gen.wide_exponents((rows, width), -6, 6, seed=seed + 4),
    ]
    pick = torch.arange(rows) % len(kinds)
    x = torch.zeros(rows, width)
    for k, v in enumerate(kinds):
        x = torch.where((pick == k).unsqueeze(1), v, x)
    return x.to(dtype)


def _params(width: int, affine: str, seed: int = 50):
    w = gen.normal((width,), torch.float32, seed) * 0.5 + 1 if affine in ("weight_bias", "weight") else None
    b = gen.normal((width,), torch.float32, seed + 1) * 0.25 if affine in ("weight_bias", "bias") else None
    return w, b


def _to(t, device):
    return None if t is None else t.to(device)


def _forward(x, w, b, eps, rms, device="cpu"):
    y, xhat, rstd = _ops().norm_forward(x.to(device), _to(w, device), _to(b, device), eps, rms)
    return y.cpu(), xhat.cpu(), rstd.cpu()


def _backward(gy, xhat, rstd, w, rms, out_dtype, device="cpu"):
    return _ops().norm_backward(gy.to(device), xhat.to(device), rstd.to(device), _to(w, device), rms, out_dtype).cpu()


def _assert_same_nans(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """NaN in the same places (any payload); every other element the same bytes."""
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    if not torch.equal(na, nb):
        idx = (na != nb).nonzero()[:10].tolist()
        raise AssertionError(f"{what}: NaN masks differ at {idx}")
    assert_bitwise(a[~na], b[~nb], f"{what} (non-NaN elements)")


# ---------------------------------------------------------------- against the reference


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_forward_and_backward_match_reference(rms, dtype, affine, shape):
    rows, width = shape
    x = _x(rows, width, dtype, seed=1)
    w, b = _params(width, affine)
    eps = _eps(rms)
    y, xhat, rstd = _forward(x, w, b, eps, rms)
    ry, rxhat, rrstd = norm_forward_ref(x, w, b, eps, rms)
    what = f"{'rms' if rms else 'layer'} {dtype} {affine} {rows}x{width}"
    assert_bitwise(y, ry, f"{what}: y")
    assert_bitwise(xhat, rxhat, f"{what}: xhat")
    assert_bitwise(rstd, rrstd, f"{what}: rstd")
    # backward from the reference's saved tensors, so a forward mismatch cannot hide here
    gy = (gen.normal((rows, width), torch.float32, 2) * 3).to(dtype)
    gx = _backward(gy, rxhat, rrstd, w, rms, dtype)
    assert_bitwise(gx, norm_backward_ref(gy, rxhat, rrstd, w, rms, dtype), f"{what}: gx")


@pytest.mark.parametrize("gy_dtype,out_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_backward_out_dtype_other_than_gy_matches_reference(rms, gy_dtype, out_dtype):
    x = _x(5, 123, torch.float32, seed=3)
    w, _ = _params(123, "weight")
    _, xhat, rstd = norm_forward_ref(x, w, None, _eps(rms), rms)
    gy = (gen.normal((5, 123), torch.float32, 4) * 3).to(gy_dtype)
    gx = _backward(gy, xhat, rstd, w, rms, out_dtype)
    assert_bitwise(gx, norm_backward_ref(gy, xhat, rstd, w, rms, out_dtype), f"gx {gy_dtype} -> {out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_degenerate_rows_match_reference(rms, dtype):
    # var = 0 (zeros, a constant row: rstd = 1/sqrt(eps)), subnormal inputs, signed zeros, one
    # element far larger than the rest
    width = 33
    sub = gen.subnormals((1, width), dtype, seed=5)
    big = gen.normal((1, width), torch.float32, 6)
    big[0, 17] = 3e4
    signed = torch.zeros(1, width)
    signed[0, ::2] = -0.0
    signed[0, 5] = 2.0**-10
    x = torch.cat([torch.zeros(1, width), torch.full((1, width), 0.75), sub.float(), big, signed]).to(dtype)
    w, b = _params(width, "weight_bias")
    eps = _eps(rms)
    for got, ref, name in zip(_forward(x, w, b, eps, rms), norm_forward_ref(x, w, b, eps, rms), ("y", "xhat", "rstd")):
        assert_bitwise(got, ref, f"{dtype}: {name}")
    _, xhat, rstd = norm_forward_ref(x, w, b, eps, rms)
    gy = gen.normal((5, width), dtype, 7)
    assert_bitwise(_backward(gy, xhat, rstd, w, rms, dtype), norm_backward_ref(gy, xhat, rstd, w, rms, dtype), "gx")


# ---------------------------------------------------------------- batch (row-count) invariance


@pytest.mark.parametrize("width", [33, 123])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_rows_are_batch_invariant(rms, dtype, width):
    rows = 50
    x = _x(rows, width, dtype, seed=8)
    w, b = _params(width, "weight_bias")
    gy = (gen.normal((rows, width), torch.float32, 9) * 3).to(dtype)
    eps = _eps(rms)
    full = _forward(x, w, b, eps, rms)
    gx = _backward(gy, full[1], full[2], w, rms, dtype)
    for k in (1, 2, 7, 31, 49):
        # a prefix (fewer rows) and a suffix (fewer rows at another offset)
        for sl in (slice(0, k), slice(rows - k, rows)):
            part = _forward(x[sl].clone(), w, b, eps, rms)
            for got, ref, name in zip(part, full, ("y", "xhat", "rstd")):
                assert_bitwise(got, ref[sl], f"{name}, rows {sl}")
            gxk = _backward(gy[sl].clone(), full[1][sl].clone(), full[2][sl].clone(), w, rms, dtype)
            assert_bitwise(gxk, gx[sl], f"gx, rows {sl}")


# ---------------------------------------------------------------- control


@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_control_torch_norms_differ_from_reference(rms):
    # Rows with a large mean (1e3 + N(0,1)): PyTorch's fp32 norms (its fused kernel, and a naive
    # mean/var with torch.mean and rsqrt) round their sums differently, so some bytes differ;
    # the reference is still within fp32 rounding of the fp64 norm, and the op gives its bytes.
    rows, width = 8, 123
    x = gen.normal((rows, width), torch.float32, 10) + 1e3
    w, b = _params(width, "weight_bias")
    b = None if rms else b
    eps = _eps(rms)
    ry, _, rstd = norm_forward_ref(x, w, b, eps, rms)
    if rms:
        torch_y = F.rms_norm(x, (width,), w, eps)
        naive = x * torch.rsqrt((x * x).mean(1, keepdim=True) + eps) * w
        y64 = F.rms_norm(x.double(), (width,), w.double(), eps)
    else:
        torch_y = F.layer_norm(x, (width,), w, b, eps)
        mean = x.mean(1, keepdim=True)
        naive = (x - mean) * torch.rsqrt(((x - mean) ** 2).mean(1, keepdim=True) + eps) * w + b
        y64 = F.layer_norm(x.double(), (width,), w.double(), b.double(), eps)
    # near the fp64 norm: LayerNorm's mean is rounded twice before x - mean (the sum ~1.2e5 to
    # fp32, ulp 2^-7, then / 123; the quotient, ulp 2^-14), which moves d by up to ~2^-14; the
    # other steps are a few fp32 roundings (the bound takes 2^-13, twice that)
    mean_err = 0.0 if rms else 2.0**-13
    bound = mean_err * rstd.double().unsqueeze(1) * w.double().abs() + 4 * 2.0**-24 * y64.abs() + 1e-7
    err = (ry.double() - y64).abs()
    assert bool((err <= bound).all()), f"reference off the fp64 norm by {float((err - bound).max())} beyond the bound"
    assert not torch.equal(torch_y, ry), "control: torch's fp32 norm matched the reference bytes"
    assert not torch.equal(naive, ry), "control: the naive fp32 mean/var matched the reference bytes"
    assert_bitwise(_forward(x, w, b, eps, rms)[0], ry, "op y on the control's data")


# ---------------------------------------------------------------- NaN / inf


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_nan_and_inf_stay_in_their_rows(rms, dtype):
    rows, width = 6, 33
    x = _x(rows, width, torch.float32, seed=11)
    x[1, 3] = float("nan")
    x[3, 7] = float("inf")
    x[4, 0] = -float("inf")
    x = x.to(dtype)
    special = [1, 3, 4]
    clean = [0, 2, 5]
    w, b = _params(width, "weight_bias")
    eps = _eps(rms)
    got = _forward(x, w, b, eps, rms)
    ref = norm_forward_ref(x, w, b, eps, rms)
    assert bool(torch.isnan(ref[0][special]).any(1).all()), "each special row has a NaN in the reference"
    for g, r, name in zip(got, ref, ("y", "xhat", "rstd")):
        _assert_same_nans(g, r, name)
    alone = _forward(x[clean].clone(), w, b, eps, rms)
    for g, a, name in zip(got, alone, ("y", "xhat", "rstd")):
        assert_bitwise(g[clean], a, f"{name}: clean rows beside the special ones vs alone")
    # backward: the saved xhat/rstd of the special rows carry NaN; a NaN in gy of a clean row
    gy = gen.normal((rows, width), torch.float32, 12).to(dtype)
    gy[5, 9] = float("nan")
    gx = _backward(gy, ref[1], ref[2], w, rms, dtype)
    _assert_same_nans(gx, norm_backward_ref(gy, ref[1], ref[2], w, rms, dtype), "gx")
    ok = [0, 2]
    assert_bitwise(gx[ok], _backward(gy[ok].clone(), ref[1][ok].clone(), ref[2][ok].clone(), w, rms, dtype),
                   "gx: clean rows beside the special ones vs alone")


# ---------------------------------------------------------------- argument checks


def _raises_naming(name: str, fn) -> None:
    # the project's style: the message starts with the argument's name ("x: expected ...")
    with pytest.raises((RuntimeError, ValueError), match=rf"^{name}\b"):
        fn()


def test_forward_argument_errors_name_the_argument():
    op = _ops().norm_forward
    x = gen.normal((5, 33))
    w, b = _params(33, "weight_bias")
    op(x, w, b, 1e-5, False)  # the valid call works
    _raises_naming("x", lambda: op(gen.normal((33,)), w, b, 1e-5, False))
    _raises_naming("x", lambda: op(gen.normal((2, 5, 33)), w, b, 1e-5, False))
    _raises_naming("x", lambda: op(torch.ones(5, 33, dtype=torch.int32), w, b, 1e-5, False))
    _raises_naming("x", lambda: op(torch.ones(5, 33, dtype=torch.float64), w, b, 1e-5, False))
    _raises_naming("weight", lambda: op(x, gen.normal((32,)), b, 1e-5, False))
    _raises_naming("weight", lambda: op(x, w.to(torch.bfloat16), b, 1e-5, False))
    _raises_naming("weight", lambda: op(x, w.reshape(1, 33), b, 1e-5, False))
    _raises_naming("bias", lambda: op(x, w, gen.normal((34,)), 1e-5, False))
    _raises_naming("bias", lambda: op(x, w, b.to(torch.float16), 1e-5, False))


def test_backward_argument_errors_name_the_argument():
    op = _ops().norm_backward
    w, _ = _params(33, "weight")
    gy = gen.normal((5, 33))
    _, xhat, rstd = norm_forward_ref(gen.normal((5, 33), seed=1), w, None, 1e-5, False)
    op(gy, xhat, rstd, w, False, torch.float32)  # the valid call works
    _raises_naming("gy", lambda: op(gen.normal((33,)), xhat, rstd, w, False, torch.float32))
    _raises_naming("gy", lambda: op(torch.ones(5, 33, dtype=torch.int32), xhat, rstd, w, False, torch.float32))
    _raises_naming("xhat", lambda: op(gy, gen.normal((5, 34)), rstd, w, False, torch.float32))
    _raises_naming("xhat", lambda: op(gy, gen.normal((4, 33)), rstd, w, False, torch.float32))
    _raises_naming("xhat", lambda: op(gy, xhat.to(torch.bfloat16), rstd, w, False, torch.float32))
    _raises_naming("rstd", lambda: op(gy, xhat, gen.normal((6,)), w, False, torch.float32))
    _raises_naming("rstd", lambda: op(gy, xhat, rstd.reshape(5, 1).expand(5, 2), w, False, torch.float32))
    _raises_naming("weight", lambda: op(gy, xhat, rstd, gen.normal((32,)), False, torch.float32))
    _raises_naming("weight", lambda: op(gy, xhat, rstd, w.to(torch.bfloat16), False, torch.float32))


# ---------------------------------------------------------------- CUDA == CPU


def _assert_cuda_equals_cpu(x, w, b, gy, rms, out_dtype, what):
    eps = _eps(rms)
    cpu = _forward(x, w, b, eps, rms)
    gpu = _forward(x, w, b, eps, rms, "cuda")
    for c, g, name in zip(cpu, gpu, ("y", "xhat", "rstd")):
        _assert_same_nans(g, c, f"{what}: {name} cuda vs cpu")
    gx_cpu = _backward(gy, cpu[1], cpu[2], w, rms, out_dtype)
    gx_gpu = _backward(gy, cpu[1], cpu[2], w, rms, out_dtype, "cuda")
    _assert_same_nans(gx_gpu, gx_cpu, f"{what}: gx cuda vs cpu")


@cuda
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_cuda_matches_cpu(rms, dtype, affine):
    for rows, width in SHAPES + [(37, 384)]:
        x = _x(rows, width, dtype, seed=13)
        w, b = _params(width, affine)
        gy = (gen.normal((rows, width), torch.float32, 14) * 3).to(dtype)
        _assert_cuda_equals_cpu(x, w, b, gy, rms, dtype, f"{dtype} {affine} {rows}x{width}")


@cuda
@pytest.mark.parametrize("shape", [(4096, 1024), (64, 4097)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_cuda_matches_cpu_large(rms, dtype, shape):
    rows, width = shape
    x = _x(rows, width, dtype, seed=15)
    x[rows // 3, 5] = float("nan")
    x[rows // 2, width - 1] = float("inf")
    w, b = _params(width, "weight_bias")
    gy = (gen.normal((rows, width), torch.float32, 16) * 3).to(dtype)
    _assert_cuda_equals_cpu(x, w, b, gy, rms, dtype, f"{dtype} {rows}x{width}")


@cuda
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_cuda_rows_are_batch_invariant(rms):
    rows, width = 4096, 1024
    x = _x(rows, width, torch.bfloat16, seed=17)
    w, b = _params(width, "weight_bias")
    gy = gen.normal((rows, width), torch.bfloat16, 18)
    eps = _eps(rms)
    full = _forward(x, w, b, eps, rms, "cuda")
    gx = _backward(gy, full[1], full[2], w, rms, torch.bfloat16, "cuda")
    for k in (1, 17, 1000, 4095):
        for sl in (slice(0, k), slice(rows - k, rows)):
            part = _forward(x[sl].clone(), w, b, eps, rms, "cuda")
            for got, ref, name in zip(part, full, ("y", "xhat", "rstd")):
                assert_bitwise(got, ref[sl], f"cuda {name}, rows {sl}")
            gxk = _backward(gy[sl].clone(), full[1][sl].clone(), full[2][sl].clone(), w, rms, torch.bfloat16, "cuda")
            assert_bitwise(gxk, gx[sl], f"cuda gx, rows {sl}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_signed_zeros_round_as_torch_does(dtype):
    # width 1: d = x - mean = +0, xhat = +0, y = +0 * (negative weight) = -0.0, which PyTorch's
    # .to(dtype) keeps; a rounding through the digits alone would give +0.0
    x = gen.normal((6, 1), torch.float32, 70).to(dtype)
    w = -(gen.normal((1,), torch.float32, 71).abs() + 0.5)
    y, xhat, rstd = _forward(x, w, None, 1e-5, False)
    ry, _, _ = norm_forward_ref(x, w, None, 1e-5, False)
    assert torch.signbit(ry.float()).all(), "the reference's zeros are negative"
    assert_bitwise(y, ry, "y")
    gy = -torch.ones(6, 1, dtype=dtype)
    assert_bitwise(_backward(gy, xhat, rstd, w, False, dtype), norm_backward_ref(gy, xhat, rstd, w, False, dtype), "gx")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("width", [33, 768])
def test_cuda_row_sums_near_rounding_boundaries_match_cpu(rms, dtype, width):
    # The CUDA kernels decide most row sums from an fp64 sum and its error bound and leave the
    # rest to the digits (csrc/cuda/warp_digits.cuh). Rows whose exact sums sit on or just past an
    # fp32 rounding midpoint, cancel to zero or to a value far below their terms, or are all signed
    # zeros: an fp64 sum rounded to fp32 gets some of these wrong (1 + 2^-24 + 2^-60 rounds to
    # 1 + 2^-24 in fp64, then to 1 by ties-to-even, where the exact sum rounds up), the CPU's digits
    # never do.
    rows = []

    def row(*vals):
        r = torch.zeros(width)
        r[: len(vals)] = torch.tensor(vals, dtype=torch.float64).float()
        rows.append(r)

    row(1.0, 2.0**-24, 2.0**-60)           # just above a midpoint
    row(1.0, 2.0**-24, -(2.0**-60))        # just below it
    row(1.0, 2.0**-24)                     # on it: ties to even
    row(3.0, -3.0)                         # cancels to an exact zero
    row(1.0, -1.0, 2.0**-130)              # cancels to a tiny sum
    row(2.0**100, 1.0, -(2.0**100), 2.0**-20)  # cancellation across 120 binades
    rows.append(torch.full((width,), -0.0))
    rows.append(torch.zeros(width))
    x = torch.stack(rows + [gen.normal((width,), torch.float32, 20 + i) for i in range(8)]).to(dtype)
    # the backward's sums: gradients that cancel against xhat
    gy = torch.stack([r.flip(0) for r in rows] + [gen.normal((width,), torch.float32, 40 + i) * 3
                                                  for i in range(8)]).to(dtype)
    _assert_cuda_equals_cpu(x, None, None, gy, rms, dtype, f"{dtype} boundary rows, width {width}")
