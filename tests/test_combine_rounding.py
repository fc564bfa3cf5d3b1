"""The slices' 128-bit rounding (int_slices.h finish_output_fast / round_signed_int128, its
integer shortcut round_u128_normal for normal results, and on the GPU the fp32 shortcut
round_u128_f32_normal) on outputs built to sit on its edges, for fp32, bf16 and fp16 outputs:
exact ties with and without a sticky bit below, each sign, results just below and past the
format's overflow, subnormal and underflowing results, with and without a bias. Against the
exact Python reference and the long-accumulator kernel, on the CPU and (where present) the GPU."""
import pytest
import torch
from conftest import assert_bitwise, assert_same_everywhere, both_paths, cuda

from lightning_det.ops import det_gemm
from lightning_det.reference import longacc_ref as R

# Per output dtype: its significand bits, the exponents of x's ulp (the sticky entry u 2^-30
# stays a normal fp32 value) and of w's rows, chosen so that the outputs 2^j A u cover the
# format's subnormal and underflowing results, normal ones, and results just below, at and past
# its overflow (a 24-bit A at 2^104 reaches 2^128, an 8-bit one at 2^120 or at 2^118 times 2^3,
# an 11-bit one at 2^5 reaches 2^16).
EDGES = {
    torch.float32: (24, [-119, -100, -60, -40, 0, 30, 100, 103, 104], [0, 3, -30, -60, -100]),
    torch.bfloat16: (8, [-60, -40, -30, -20, 0, 30, 100, 118, 120], [0, 3, -30, -60, -100]),
    torch.float16: (11, [-40, -35, -30, -24, -20, -10, 0, 4, 5], [0, 3, -3, -10, -20]),
}
BIAS = torch.tensor([0.0, 1.0, -0.5, 2.0**-100, -3.0])


def edge_rows(seed: int, od: torch.dtype = torch.float32, rows: int = 96):
    """x (rows, 3): [A u, t u / 2, s u 2^-30] with A an integer of the output's p significand bits
    (some all ones: rounding carries into the next binade, or to inf), t in {0, 1} (a tie), s in
    {-1, 0, 1} (a sticky bit on either side), signs mixed; u = 2^e for e from EDGES[od]. w (5, 3):
    rows of 2^j for j in EDGES[od], so output (i, j) = 2^j (A + t / 2 + s 2^-30) u, an exact value
    the rounding must get right. Every entry is an fp32 value."""
    p, ulp_exps, w_exps = EDGES[od]
    g = torch.Generator().manual_seed(seed)
    A = torch.randint(1 << (p - 1), 1 << p, (rows,), generator=g, dtype=torch.int64)
    A[::7] = (1 << p) - 1
    A[1::11] = 1 << (p - 1)
    t = torch.randint(0, 2, (rows,), generator=g)
    s = torch.randint(-1, 2, (rows,), generator=g)
    sign = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0).double()
    e = torch.tensor(ulp_exps)[torch.randint(0, len(ulp_exps), (rows,), generator=g)].double()
    u = torch.exp2(e)
    x = torch.stack([A.double() * u, t.double() * u / 2, s.double() * u * 2.0**-30], 1) * sign[:, None]
    assert torch.equal(x.float().double(), x), "an entry is not an fp32 value"
    w = torch.exp2(torch.tensor(w_exps, dtype=torch.float64))[:, None].expand(len(w_exps), 3)
    return x.float(), w.float().contiguous()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edges_against_the_reference(seed):
    x, w = edge_rows(seed)
    for bias in (None, BIAS):
        ref = R.gemm_rounded(x, w, bias)
        _, got = both_paths(lambda: det_gemm(x, w, bias), "slices_diagonals")
        assert_bitwise(got, ref, f"seed {seed}, bias {bias is not None}: slices vs the exact reference")
    assert_same_everywhere(x, w, None, f"edges seed {seed}")
    # control: the fp64 sum of the fp64 products rounded to fp32 misses ties with a sticky bit
    # (A + 1/2 + 2^-30 needs 55 bits): some outputs come out otherwise
    naive = (x.double() @ w.double().T).float()
    assert not torch.equal(naive, R.gemm_rounded(x, w)), "the control found no output the fp64 sum gets wrong"


@pytest.mark.parametrize("od", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_16_bit_edges_against_the_reference(seed, od):
    """bf16 and fp16 outputs, rounded once from the exact sum, on their own edges: every route and
    way against the exact reference (the kernel's rounding and the slices' integer shortcut)."""
    x, w = edge_rows(seed, od)
    for bias in (None, BIAS):
        ref = R.gemm_rounded(x, w, bias, od)
        for route in ("slices_diagonals", "slices_crt"):
            kernel, got = both_paths(lambda: det_gemm(x, w, bias, out_dtype=od), route)
            assert_bitwise(got, ref, f"seed {seed}, bias {bias is not None}, {od}: {route} vs the exact reference")
            assert_bitwise(kernel, ref, f"seed {seed}, bias {bias is not None}, {od}: kernel vs the exact reference")
    ref = R.gemm_rounded(x, w, None, od)
    assert (ref.float().abs() == float("inf")).any(), "no output overflows the format"
    assert ((ref.float() != 0) & (ref.float().abs() < torch.finfo(od).tiny)).any(), "no subnormal output"
    # control: the fp32 sum rounded again to the format drops the sticky bit below a tie
    naive = (x @ w.T).to(od)
    assert not torch.equal(naive, ref), "the control found no output the fp32 sum gets wrong"


@cuda
@pytest.mark.parametrize("od", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edges_cuda_matches_cpu(seed, od):
    x, w = edge_rows(seed, od)
    for bias in (None, BIAS):
        for route in ("slices_diagonals", "slices_crt"):
            _, cpu = both_paths(lambda: det_gemm(x, w, bias, out_dtype=od), route)
            bc = None if bias is None else bias.cuda()
            _, gpu = both_paths(lambda: det_gemm(x.cuda(), w.cuda(), bc, out_dtype=od), route)
            assert_bitwise(gpu.cpu(), cpu, f"seed {seed}, bias {bias is not None}, {od}, {route}: CUDA vs CPU")
        assert_bitwise(cpu, R.gemm_rounded(x, w, bias, od), f"seed {seed}, {od}: CPU vs the exact reference")


@cuda
def test_large_random_fp32_through_the_diagonals_cuda_matches_cpu():
    """The common case of det_ddp's step (fp32, 5 + 5 slices, nine diagonals) at a size where
    the GPU's combine runs many blocks, with a bias."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(512, 1024, generator=g), torch.randn(384, 1024, generator=g)
    b = torch.randn(384, generator=g)
    _, cpu = both_paths(lambda: det_gemm(x, w, b), "slices_diagonals")
    _, gpu = both_paths(lambda: det_gemm(x.cuda(), w.cuda(), b.cuda()), "slices_diagonals")
    assert_bitwise(gpu.cpu(), cpu, "512 x 384 x 1024 fp32 with bias: CUDA vs CPU")
