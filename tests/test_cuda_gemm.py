"""CUDA kernels: bitwise equal to the CPU kernels (and so to the exact reference)."""
import random

import pytest
import torch
from conftest import assert_bitwise, cuda

import gen
from lightning_det.nn import DetLinear
from lightning_det.ops import det_combine, det_finalize, det_gemm, det_gemm_partial, det_normalize, to_digits
from lightning_det.reference import longacc_ref as R

pytestmark = cuda


def inputs():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    yield "normal fp32 5x123x123", gen.normal((5, 123), f32, 1), gen.normal((123, 123), f32, 2)
    yield "normal bf16 67x129x19", gen.normal((67, 129), bf16, 3), gen.normal((19, 129), bf16, 4)
    yield "normal fp16 130x300x70", gen.normal((130, 300), f16, 5), gen.normal((70, 300), f16, 6)
    yield "wide fp32", gen.wide_exponents((70, 200), -100, 100, seed=7), gen.wide_exponents((66, 200), -100, 100, seed=8)
    yield "wide bf16", gen.wide_exponents((65, 96), -60, 60, bf16, 9), gen.wide_exponents((64, 96), -60, 60, bf16, 10)
    yield "full range fp32", gen.wide_exponents((33, 64), -149, 127, seed=11), gen.wide_exponents((31, 64), -149, 127, seed=12)
    yield "subnormal", gen.subnormals((20, 77), seed=13), gen.normal((21, 77), seed=14)
    x, w = gen.cancellation(seed=15)
    yield "cancellation", x, w
    sp = gen.normal((9, 40), seed=16)
    sp[0, 3], sp[1, 5], sp[2, 7], sp[3, 1] = float("inf"), float("-inf"), float("nan"), float("inf")
    wsp = gen.normal((8, 40), seed=17)
    wsp[0, 3], wsp[2, 9] = 0.0, float("-inf")
    yield "specials", sp, wsp


@pytest.mark.parametrize("case", list(range(9)))
def test_cpu_and_cuda_give_the_same_bytes(case):
    name, x, w = list(inputs())[case]
    bias = gen.normal((w.shape[0],), torch.float32, 99)
    acc_cpu = det_gemm_partial(x, w, bias)
    acc_gpu = det_gemm_partial(x.cuda(), w.cuda(), bias.cuda())
    assert torch.equal(acc_cpu, acc_gpu.cpu()), f"{name}: digits differ between CPU and CUDA"
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert_bitwise(det_finalize(acc_gpu, dt).cpu(), det_finalize(acc_cpu, dt), f"{name} finalize {dt}")
        assert_bitwise(det_gemm(x.cuda(), w.cuda(), bias.cuda(), out_dtype=dt).cpu(),
                       det_gemm(x, w, bias, out_dtype=dt), f"{name} det_gemm {dt}")
    if x.numel() <= 40 * 200:
        assert torch.equal(acc_cpu, R.gemm_digits(x, w, bias)), f"{name}: CPU vs Python reference"


def test_cuda_large_random_matches_cpu():
    for dt in (torch.float32, torch.bfloat16):
        x, w = gen.normal((300, 1000), dt, 20), gen.normal((260, 1000), dt, 21)
        assert_bitwise(det_gemm(x.cuda(), w.cuda()).cpu(), det_gemm(x, w), f"300x260x1000 {dt}")


def test_cuda_elementwise_ops_match_cpu():
    v = torch.cat([gen.wide_exponents((500,), -149, 127, seed=22), torch.tensor([0.0, -0.0, float("inf"), float("nan")])])
    assert torch.equal(to_digits(v.cuda()).cpu(), to_digits(v))
    raw = torch.randint(-(1 << 62), 1 << 62, (300, 19), dtype=torch.int64)
    raw[:, 18] = 0
    assert torch.equal(det_normalize(raw.cuda()).cpu(), det_normalize(raw))
    acc = det_normalize(raw)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert_bitwise(det_finalize(acc.cuda(), dt).cpu(), det_finalize(acc, dt), f"finalize {dt}")


def test_cuda_k_shard_and_row_invariance_and_cublas_control():
    rng = random.Random(0)
    x, w = gen.normal((256, 1024), seed=23).cuda(), gen.normal((192, 1024), seed=24).cuda()
    full = det_gemm(x, w)
    for pieces in (2, 3, 16):
        cuts = [0] + sorted(rng.sample(range(1, 1024), pieces - 1)) + [1024]
        parts = [det_gemm_partial(x[:, a:b], w[:, a:b]) for a, b in zip(cuts, cuts[1:])]
        rng.shuffle(parts)
        assert_bitwise(det_finalize(det_combine(parts)), full, f"cuts {cuts}")
    for m in (1, 3, 17, 100):
        assert_bitwise(det_gemm(x[:m], w), full[:m], f"m={m}")
    # control: cuBLAS fp32 changes bits under a K split and with the row count
    torch.backends.cuda.matmul.allow_tf32 = False
    mm = x @ w.T
    assert not torch.equal(mm, x[:, :500] @ w[:, :500].T + x[:, 500:] @ w[:, 500:].T)
    xb, wb = gen.normal((2048, 1024), seed=25).cuda(), gen.normal((512, 1024), seed=26).cuda()
    assert not torch.equal((xb @ wb.T)[:8], xb[:8] @ wb.T)


def test_cuda_norm_interval_path():
    x, w = gen.wide_exponents((70, 300), -90, 90, seed=27).cuda(), gen.wide_exponents((65, 300), -90, 90, seed=28).cuda()
    base = det_gemm_partial(x, w)
    assert torch.equal(det_gemm_partial(x, w, _norm_interval=2), base)
    assert torch.equal(base.cpu(), det_gemm_partial(x.cpu(), w.cpu()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_detlinear_cuda_matches_cpu(dtype):
    torch.manual_seed(0)
    cpu = DetLinear(96, 40, dtype=dtype)
    gpu = DetLinear(96, 40, dtype=dtype, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    x = gen.normal((3, 11, 96), dtype, 30)
    gy = gen.normal((3, 11, 40), dtype, 31)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    cpu(xc).backward(gy)
    yg = gpu(xg)
    yg.backward(gy.cuda())
    assert_bitwise(yg.detach().cpu(), cpu(x).detach(), "forward")
    assert_bitwise(xg.grad.cpu(), xc.grad, "dX")
    assert_bitwise(gpu.weight.grad.cpu(), cpu.weight.grad, "dW")
    assert_bitwise(gpu.bias.grad.cpu(), cpu.bias.grad, "db")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K", [1000, 1003])  # 1003: not a multiple of the 16-byte chunk, element-wise staging
def test_cuda_mixed_paths_in_one_tile(dtype, K):
    # Most (output, K-block) pairs take the tensor-core path; a few rows and columns are pushed
    # off it (wide spread, a tiny value, an inf), so one 64 x 64 tile mixes fast, exact, skip and
    # special decisions output by output. Shapes cross tile edges in M and N.
    x, w = gen.normal((130, K), dtype, 40), gen.normal((70, K), dtype, 41)
    x[5, 100:110] *= 2.0 ** 30
    x[64, 7] = 2.0 ** -60
    x[100, 64:96] = 0.0  # an empty row block
    w[3, 500] *= 2.0 ** -40
    if dtype == torch.bfloat16:  # fp32 with an inf skips the split: keep fp32 on the fast path
        w[69, 998] = float("inf")
    acc_cpu = det_gemm_partial(x, w)
    acc_gpu = det_gemm_partial(x.cuda(), w.cuda())
    assert torch.equal(acc_cpu, acc_gpu.cpu())
    assert torch.equal(det_gemm_partial(x.cuda(), w.cuda(), _norm_interval=1), acc_gpu)
    full = det_gemm(x.cuda(), w.cuda())
    assert_bitwise(full.cpu(), det_gemm(x, w), "det_gemm CPU vs CUDA")
    for m in (1, 63, 65):
        assert_bitwise(det_gemm(x[:m].cuda(), w.cuda()), full[:m], f"rows {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_running_bound_transitions(dtype):
    # The tensor cores add K-blocks straight into the running sums while a per-warp bound proves
    # every partial sum exact; these rows drive that bound through each of its exits:
    #   rows 0-15   large narrow blocks, then tiny narrow ones: the bound fails, the re-measured
    #               |S| fails too, S moves into the digits and restarts;
    #   rows 16-31  all-positive terms that grow S steadily beside one low bit per block: the
    #               worst-case growth fails first, the re-measured |S| lets it go on;
    #   rows 32-47  an inf and a NaN in the middle of K, ordinary blocks after them;
    #   rows 48-63  a block too wide on its own (output by output), then ordinary blocks.
    # Every other row is ordinary, so one warp mixes threads that pass with threads that fail.
    K = 1024
    x, w = gen.normal((130, K), dtype, 50), gen.normal((70, K), dtype, 51)
    x[0:16, :256] *= 2.0 ** 25
    x[0:16, 256:512] *= 2.0 ** -25
    x[16:32] = x[16:32].abs() + 1.0
    w[0:40] = w[0:40].abs()
    x[16:32, ::32] = 2.0 ** -30
    x[32, 300], x[33, 400] = float("inf"), float("nan")
    x[48:64, 64] = 2.0 ** 60
    x[48:64, 65] = 2.0 ** -60
    if dtype == torch.float32:  # an inf turns the split off for the whole GEMM: keep it on
        x[32, 300], x[33, 400] = 3.0, 5.0
    acc_cpu = det_gemm_partial(x, w)
    acc_gpu = det_gemm_partial(x.cuda(), w.cuda())
    assert torch.equal(acc_cpu, acc_gpu.cpu())
    rows = [0, 17, 50]  # one of each kind, a few outputs (the Python reference is slow)
    assert torch.equal(acc_cpu[rows, :2], R.gemm_digits(x[rows], w[:2])), "CPU vs the Python reference"
    full = det_gemm(x.cuda(), w.cuda())
    assert_bitwise(full.cpu(), det_gemm(x, w), "det_gemm CPU vs CUDA")
    for m in (1, 20, 65):
        assert_bitwise(det_gemm(x[:m].cuda(), w.cuda()), full[:m], f"rows {m}")
    # control: cuBLAS (fp32 accumulation) is not the exact sum on these rows
    torch.backends.cuda.matmul.allow_tf32 = False
    fin = torch.isfinite(full[:32])
    assert not torch.equal((x.float().cuda() @ w.float().cuda().T)[:32][fin], full[:32][fin])


@cuda
@pytest.mark.parametrize("scale_exp", [0, -65, 126])
@pytest.mark.parametrize("tail", [1.0, -1.0])
def test_cuda_fp32_segment_pair_rounding_near_ties(scale_exp, tail):
    # For fp32 the CUDA kernel keeps H, the finished split segments' sum, beside the running sum
    # S (S restarts at H's TwoSum error at each segment edge) and rounds the exact pair H + S
    # (+ bias) to fp32 without the digits unless it sits on a tie. These rows put the hi*hi
    # segment exactly on a tie with a +-2^-56 remainder from the later segments; with and
    # without a bias, against the exact reference and the CPU kernel.
    x, w = gen.fp32_pair_ties(scale_exp, tail)
    for bias in (None, gen.normal((w.shape[0],), torch.float32, 80) * 2.0 ** min(scale_exp, 100)):
        ref = R.gemm_rounded(x, w, bias)
        got = det_gemm(x.cuda(), w.cuda(), None if bias is None else bias.cuda()).cpu()
        assert_bitwise(got, ref, f"CUDA pair rounding near ties, scale 2^{scale_exp}, tail {tail}, bias {bias is not None}")
        assert_bitwise(det_gemm(x, w, bias), ref, "CPU")
    # control: the fp64 sum of the products rounded once more to fp32 misses these ties
    if scale_exp == 0:
        assert not torch.equal((x.double() @ w.double().T).float().diagonal(), R.gemm_rounded(x, w).diagonal())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_transposed_operands_match_cpu(dtype):
    """det_gemm of transposed views (DetLinear's backward: g^T x^T, g W^T) takes the GPU's tiled
    transpose (csrc/cuda/dense_rows_cuda.cu) into the slices: the same bytes as the CPU and as
    contiguous copies, at sizes off the 32 x 32 tiles, through the slices and the auto route."""
    from lightning_det.ops import gemm_path

    for (m, k, n), seed in (((33, 70, 45), 30), ((1000, 97, 129), 31), ((64, 4097, 2), 32)):
        xs, ws = gen.normal((k, m), dtype, seed), gen.normal((k, n), dtype, seed + 100)  # x = xs^T, w = ws^T
        for path in ("slices", "auto"):
            with gemm_path(path):
                gpu = det_gemm(xs.cuda().t(), ws.cuda().t()).cpu()
                dense = det_gemm(xs.cuda().t().contiguous(), ws.cuda().t().contiguous()).cpu()
                cpu = det_gemm(xs.t(), ws.t())
            assert_bitwise(gpu, cpu, f"{dtype} {m}x{k}x{n} {path}: transposed views, CUDA vs CPU")
            assert_bitwise(gpu, dense, f"{dtype} {m}x{k}x{n} {path}: transposed views vs contiguous copies")
