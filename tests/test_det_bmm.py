"""det_bmm: a batched exact GEMM. Slice i is det_gemm(a[i], b[i]) byte for byte, whatever the
other slices and their number (the batched CUDA kernel runs every slice in one launch), on every
device and route, and equals the exact reference; torch.bmm differs on the same operands."""
import pytest
import torch
from conftest import assert_bitwise

import gen
from lightning_det.ops import det_bmm, det_gemm
from lightning_det.reference import longacc_ref as R

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def operands(lead, m, n, k, dtype, seed):
    a = gen.normal((*lead, m, k), seed=seed).to(dtype)
    b = gen.normal((*lead, n, k), seed=seed + 1).to(dtype)
    return a, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_slice_is_det_gemm_of_that_slice(device, dtype):
    a, b = operands((5,), 7, 9, 33, dtype, seed=1)
    a, b = a.to(device), b.to(device)
    for out_dtype in (torch.float32, dtype):
        y = det_bmm(a, b, out_dtype=out_dtype)
        assert y.shape == (5, 7, 9) and y.dtype == out_dtype
        for i in range(5):
            assert torch.equal(y[i], det_gemm(a[i], b[i], out_dtype=out_dtype)), (i, out_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_slices_do_not_depend_on_the_batch(device):
    # (2, 3) leading dims, 130 keys: a sub-batch, one slice alone and the whole batch agree
    a, b = operands((2, 3), 66, 40, 130, torch.float32, seed=3)
    a, b = a.to(device), b.to(device)
    whole = det_bmm(a, b)
    assert whole.shape == (2, 3, 66, 40)
    assert torch.equal(det_bmm(a[1, 1:], b[1, 1:]), whole[1, 1:])
    assert torch.equal(det_bmm(a[0, 2], b[0, 2]), whole[0, 2])  # 2-D operands: one slice


def test_matches_the_exact_reference_and_torch_differs():
    a, b = operands((3,), 24, 16, 700, torch.float32, seed=5)
    y = det_bmm(a, b)
    for i in range(3):
        assert_bitwise(y[i], R.gemm_rounded(a[i], b[i]), f"slice {i}")
    # the control: the ordinary float batched GEMM is not the exact sum rounded once here
    assert not torch.equal(torch.bmm(a, b.transpose(1, 2)), y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("route", [None, "kernel", "slices", "fp64"])
def test_cuda_gives_the_cpu_bytes(dtype, route):
    # attention-like slices (48 of them): scores 100 x 100 x 64 and outputs 100 x 64 x 100
    q, k = operands((4, 12), 100, 100, 64, dtype, seed=7)
    p, vt = operands((4, 12), 100, 64, 100, dtype, seed=9)
    for x, w in ((q, k), (p, vt)):
        ref = det_bmm(x, w, out_dtype=dtype)
        got = det_bmm(x.cuda(), w.cuda(), out_dtype=dtype, route=route)
        assert torch.equal(got.cpu(), ref), (dtype, route)


def test_bad_input_fails_clearly():
    a, b = operands((2,), 3, 4, 5, torch.float32, seed=11)
    with pytest.raises(ValueError, match="b: expected shape"):
        det_bmm(a, b[:1])
    with pytest.raises(ValueError, match="b: expected shape"):
        det_bmm(a, b[..., :4])
    with pytest.raises(TypeError, match="a: expected dtype"):
        det_bmm(a.double(), b)
    with pytest.raises(ValueError, match="a: expected shape"):
        det_bmm(a[0, 0], b[0, 0])
    with pytest.raises(TypeError, match="out_dtype"):
        det_bmm(a, b, out_dtype=torch.float64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_attention_forward_and_backward_give_the_cpu_bytes(dtype):
    # the exact attention's six batched GEMMs a step, on (2, 3) slices of 37 queries, head dim 64
    from lightning_det.nn import det_scaled_dot_product_attention as sdpa

    q, k, v, g = (gen.normal((2, 3, 37, 64), seed=s).to(dtype) for s in (13, 14, 15, 16))

    def run(device):
        leaves = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, is_causal=True)
        out.backward(g.to(device))
        return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]

    for got, ref in zip(run("cuda"), run("cpu")):
        assert torch.equal(got, ref)
