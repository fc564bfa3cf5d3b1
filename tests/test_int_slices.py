"""The integer-slice route of det_gemm (csrc/int_slices.h) against the long-accumulator kernel and
the Python-integer reference: every byte must be the same, whatever the slicing."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise, assert_same_everywhere, both_paths, rerun_in_fresh_process, seven_bit_digits_gemm

import gen
from lightning_det.ops import det_gemm, det_gemm_partial, explain_gemm, gemm_path, last_gemm_plan, last_slices_plan
from lightning_det.reference import longacc_ref as R

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROOT = Path(__file__).resolve().parents[1]


TINY = 1.5 * 2.0**-21  # bits at 2^-21 and 2^-22: in a row topped by 1.0, 3 slices end at 2^-21


def planted_residue_operands(M=40, N=24, K=512, dtype=torch.bfloat16):
    """Random rows plus 4 rows of x and of w whose one tiny value each lies one bit below a
    3-slice window, so that out[:4, :4] = 1 + TINY + 1 + TINY shows any lost residue term."""
    x, w = gen.normal((M, K), torch.float32, 30), gen.normal((N, K), torch.float32, 31)
    x[:4], w[:4] = 0, 0
    x[:4, 0], x[:4, 1], x[:4, 2], x[:4, 3] = 1, TINY, 1, 1  # x's residue meets w[:, 1] = 1
    w[:4, 0], w[:4, 1], w[:4, 2], w[:4, 3] = 1, 1, 1, TINY  # w's meets x[:, 3] = 1
    return x.to(dtype), w.to(dtype)


def test_residues_keep_the_slices_few_and_the_bytes_exact():
    x, w = planted_residue_operands()
    with gemm_path("slices"):
        got = det_gemm(x, w)
        plan = last_slices_plan()
    # without residues the planted rows need 4 slices (23 bits of span); with one residue each, 3
    assert (plan["slices_x"], plan["slices_w"]) == (3, 3), plan
    assert plan["residues_x"] >= 4 and plan["residues_w"] >= 4, plan
    assert torch.all(got[:4, :4] == 2 + 2 * TINY), "a residue term went missing"
    assert_bitwise(got, R.gemm_rounded(x, w, None, torch.float32), "slices vs Python reference")
    assert_same_everywhere(x, w, gen.normal((24,), torch.float32, 32), "planted residues")


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_residue_depth_cap_decides_the_slice_count(dt):
    # Rows topped by 1.0 hold 3 slices down to 2^(3 - 3 bits); one value whose only bit lies
    # kResidueDepthCap = 40 bits below that is a residue the 3-slice row may keep; one bit lower it
    # may not, and the row takes 4 (the value still a residue there) (int_slices.h, row_plan). The row statistics' top exponent and lowest
    # set bit decide it (csrc/cpu/slices_vector.h and the scalar loops alike).
    bits = 8 if seven_bit_digits_not_forced() else 7
    bottom = 3 - 3 * bits
    for depth, slices in ((40, 3), (41, 4)):
        x = (torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64) % 7 + 1) / 8  # 3 bits below 1.0
        x[:, 0] = 1.0
        x[2, 5] = 2.0 ** (bottom - depth)
        x = x.to(dt)
        w = torch.ones(6, 64, dtype=dt)
        with gemm_path("slices"):
            got = det_gemm(x, w)
            plan = last_slices_plan()
        assert plan["slices_x"] == slices and plan["residues_x"] == 1, (depth, plan)  # a residue at 4 too
        assert_bitwise(got, R.gemm_rounded(x, w, None, torch.float32), f"residue at depth {depth}")


def seven_bit_digits_not_forced() -> bool:
    """This process's CPU backend uses 8-bit digits (VNNI, and LIGHTNING_DET_SLICE_BITS unset)."""
    x = torch.full((4, 64), 1 + 2.0**-13)  # 14 bits: 2 slices of 8 bits, 3 of 7
    with gemm_path("slices"):
        det_gemm(x, x)
        return last_slices_plan()["slices_x"] == 2


def test_residues_of_x_and_w_in_the_same_column():
    # x[m, 3] = w[n, 3] = 1 + 2^-6 in rows topped by 1.0 at one slice (window down to 2^-5): both
    # hold a residue 2^-6 in column 3, so out[:4, :4] needs x3 wr + xr w, not x wr + xr w, which
    # counts xr wr = 2^-12 twice (1 + 2^-5 + 2^-12 is exact in fp32: the double count shows).
    g = torch.Generator().manual_seed(3)
    x = torch.randint(16, 32, (16, 1024), generator=g).float() / 32  # 5 bits below 1.0: one slice
    w = torch.randint(16, 32, (16, 1024), generator=g).float() / 32
    x[:, 0], w[:, 0] = 1.0, 1.0
    x[:4, 3], w[:4, 3] = 1 + 2.0**-6, 1 + 2.0**-6
    want = R.gemm_rounded(x, w)
    for route in ("slices_diagonals", "slices_crt"):
        with gemm_path(route):
            got = det_gemm(x, w)
            plan = last_slices_plan()
        assert (plan["slices_x"], plan["slices_w"], plan["residues_x"], plan["residues_w"]) == (1, 1, 4, 4), plan
        assert_bitwise(got, want, f"{route}: residues of x and w in one column")
    assert_same_everywhere(x, w, gen.normal((16,), torch.float32, 36), "residues in one column")


@pytest.mark.parametrize("route", ["slices_diagonals", "slices_crt"])
def test_scratch_kept_between_calls_holds_no_stale_bytes(route):
    # The CPU keeps a slice GEMM's planes and slices between calls (csrc/scratch_pool.h): each call
    # must write every byte it reads. A large call fills the buffers with its data; then smaller
    # ones reuse them: a zero row, a row left to the kernel (inf), M = 5 (rows padded to 17), K
    # not a multiple of 16 (columns padded), fewer slices and moduli than before.
    big_x = gen.wide_exponents((96, 300), -10, 10, torch.float32, 37)
    big_w = gen.wide_exponents((80, 300), -10, 10, torch.float32, 38)
    x, w = gen.normal((5, 123), torch.float32, 39), gen.normal((40, 123), torch.float32, 40)
    x[1], w[7] = 0.0, 0.0
    w[9, 4] = float("inf")
    for a, b in ((big_x, big_w), (x, w), (big_x, big_w), (x * 2.0**-20, w), (x.bfloat16(), w.bfloat16())):
        ref, got = both_paths(lambda: det_gemm(a, b), route)
        assert_bitwise(got, ref, f"{route} after a larger call, {tuple(a.shape)} x {tuple(b.shape)}")
        ref, got = both_paths(lambda: det_gemm_partial(a, b), route)
        assert torch.equal(got, ref), f"{route} digits after a larger call"


@pytest.mark.parametrize("dt", DTYPES)
def test_residue_route_on_random_rows(dt):
    # randn rows of 700 values: a few values per row below the window the others need
    x, w = gen.normal((64, 700), dt, 33), gen.normal((48, 700), dt, 34)
    with gemm_path("slices"):
        det_gemm(x, w)
        plan = last_slices_plan()
    assert plan["residues_x"] + plan["residues_w"] > 0, plan
    assert_same_everywhere(x, w, gen.normal((48,), torch.float32, 35), f"{dt} random rows")


def test_against_python_reference_odd_shape():
    # 5 x 123 x 7: K not a multiple of 16, M below cuBLASLt's 17, N not a multiple of 8
    for dt in DTYPES:
        x, w, b = gen.normal((5, 123), dt, 1), gen.normal((7, 123), dt, 2), gen.normal((7,), dt, 3)
        with gemm_path("slices"):
            assert torch.equal(det_gemm_partial(x, w, b), R.gemm_digits(x, w, b)), f"{dt} digits"
            for od in OUT_DTYPES:
                assert_bitwise(det_gemm(x, w, b, out_dtype=od), R.gemm_rounded(x, w, b, od), f"{dt} -> {od}")


@pytest.mark.parametrize("seed", range(6))
def test_random_shapes_dtypes_and_scales(seed):
    g = torch.Generator().manual_seed(seed)
    M, K, N = (int(v) for v in torch.randint(1, 90, (3,), generator=g))
    dx, dw = DTYPES[seed % 3], DTYPES[(seed + 1) % 3]
    # rows at scales 2^-30 .. 2^30 apart: each row gets its own exponent, S follows the widest row
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-30, 30, (M, 1), generator=g).float())
    w = torch.randn(N, K, generator=g) * torch.exp2(torch.randint(-8, 8, (N, K), generator=g).float())
    bias = torch.randn(N, generator=g) * 2.0**-20 if seed % 2 else None
    assert_same_everywhere(x.to(dx), w.to(dw), bias, f"seed {seed}")


def test_rows_the_slices_cannot_hold_go_to_the_kernel():
    # a row spanning ~120 bits (> 8 slices), an inf in a w row, a NaN in an x row, a zero row, a
    # subnormal: those rows take the long-accumulator kernel, the others the slices
    x, w = gen.normal((40, 64), torch.float32, 4), gen.normal((24, 64), torch.float32, 5)
    x[3, 0], x[3, 1] = 2.0**60, 2.0**-60
    x[5, 7] = float("nan")
    x[9] = 0
    x[11, 2] = 1e-44
    w[6, 3] = float("inf")
    w[7, 0], w[7, 1] = -(2.0**70), 2.0**-50
    assert_same_everywhere(x, w, gen.normal((24,), torch.float32, 6), "rows out of range")
    got = det_gemm(x, w)  # auto mode: most rows still fit
    assert torch.isnan(got[5]).all() and not torch.isfinite(got[:, 6]).any() and torch.isfinite(got[0, :6]).all()


def test_k_chunks_and_the_digit_path_of_the_combine():
    # every row spans ~60 bits, so S = 8 slices per side: K = 20000 needs two K-chunks (int32
    # bound) and the 128-bit combine is out of range, so every output takes the digits
    g = torch.Generator().manual_seed(7)
    K = 20000
    x = torch.randn(18, K, generator=g)
    w = torch.randn(9, K, generator=g)
    x[:, 0], w[:, 0] = 2.0**30, 2.0**28
    x[:, 1], w[:, 1] = 2.0**-30, -(2.0**-31)
    assert_same_everywhere(x, w, what="S = 8, two K-chunks")


def test_row_count_invariance_with_different_slice_counts():
    # the widest row sets S for the whole call; results must not depend on which rows came along
    x, w = gen.normal((48, 96), torch.float32, 8), gen.normal((40, 96), torch.float32, 9)
    x[40:, ::3] *= 2.0**-25
    with gemm_path("slices"):
        full = det_gemm(x, w)
        for m in (1, 17, 40):
            assert_bitwise(det_gemm(x[:m], w), full[:m], f"first {m} rows")
        assert_bitwise(det_gemm(x[40:], w), full[40:], "the wide rows alone")
        # a K-split: each shard picks its own slice counts; the combined digits must not change
        from lightning_det.ops import det_combine
        parts = det_combine([det_gemm_partial(x[:, :37], w[:, :37]), det_gemm_partial(x[:, 37:], w[:, 37:])])
        assert torch.equal(parts, det_gemm_partial(x, w)), "K-split digits differ"
    # the control: plain fp32 matmul changes under the same K-split
    assert not torch.equal(x[:, :37] @ w[:, :37].T + x[:, 37:] @ w[:, 37:].T, x @ w.T)


def test_transposed_inputs_as_autograd_passes_them():
    x, w = gen.normal((70, 33), torch.bfloat16, 10), gen.normal((70, 50), torch.bfloat16, 11)
    ref, got = both_paths(lambda: det_gemm(x.t(), w.t()))
    assert_bitwise(got, ref, "transposed views")


def test_gemm_path_rejects_unknown_names():
    with pytest.raises(ValueError, match="path: expected one of"):
        with gemm_path("fast"):
            pass


def test_seven_bit_digits_give_the_same_bytes():
    # machines without VNNI get 7-bit digits (their int8 GEMM may saturate 16-bit pair sums);
    # run that branch here in a fresh process and compare with this process's 8-bit results
    x, w, b = gen.normal((30, 200), torch.float32, 12), gen.normal((20, 200), torch.float32, 13), gen.normal((20,), torch.float32, 14)
    with gemm_path("slices"):
        want = det_gemm_partial(x, w, b)
    assert torch.equal(seven_bit_digits_gemm("slices"), want)


def assert_cuda_same_as_kernel_and_cpu(x, w, b, what):
    """det_gemm on CUDA through the slices: the kernel's bytes and the CPU slices' bytes, for every
    output dtype. Returns the CUDA operands."""
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    for od in OUT_DTYPES:
        ref, got = both_paths(lambda: det_gemm(xc, wc, bc, out_dtype=od))
        assert_bitwise(got.cpu(), ref.cpu(), f"cuda {what} -> {od}: slices vs kernel")
        with gemm_path("slices"):
            assert_bitwise(got.cpu(), det_gemm(x, w, b, out_dtype=od), f"cuda {what} -> {od}: cuda vs cpu")
    return xc, wc, bc


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dx,dw", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                   (torch.float16, torch.bfloat16)])
def test_cuda_slices_equal_kernel_and_cpu(dx, dw):
    for (M, K, N) in [(5, 123, 7), (300, 1000, 260), (1024, 2048, 512)]:
        x = gen.normal((M, K), dx, 20) * torch.exp2(torch.randint(-10, 10, (M, 1)).float()).to(dx)
        w = gen.normal((N, K), dw, 21)
        x[0, 0] = float("inf") if M > 5 else x[0, 0]
        b = gen.normal((N,), torch.float32, 22)
        xc, wc, bc = assert_cuda_same_as_kernel_and_cpu(x, w, b, f"{M}x{K}x{N} {dx}/{dw}")
        ref, got = both_paths(lambda: det_gemm_partial(xc, wc, bc))
        assert torch.equal(got, ref), f"cuda digits {M}x{K}x{N}"


def misaligned_cuda(t):
    """t on CUDA, its storage starting one element past an aligned address (still contiguous)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
    out = buf[1:].view(t.shape).copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 8 != 0
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_cuda_row_loads_misaligned_and_long_rows(dt):
    # row_needs and make_slices load 4 elements at once from aligned rows (K % 4 == 0): operands
    # one element off alignment take single loads; a warp per row for K <= 1024, a block beyond;
    # rows longer than one round of a block's loads (K > 4096) are read twice. With a zero row,
    # an inf row and a wide row left to the kernel, none of it may change a byte
    for (M, K, N) in [(40, 1024, 24), (40, 4100, 24), (16, 8192, 24)]:
        x = gen.normal((M, K), dt, 40) * torch.exp2(torch.randint(-6, 6, (M, 1)).float()).to(dt)
        w = gen.normal((N, K), dt, 41)
        x[2] = 0
        x[3, K - 1] = float("inf")
        x[4, 7] = 2.0**-120  # past the deepest residue of 8 slices
        b = gen.normal((N,), torch.float32, 42)
        with gemm_path("slices"):
            want = det_gemm(x, w, b)
        for xc, wc in [(x.cuda(), w.cuda()), (misaligned_cuda(x.cuda()), misaligned_cuda(w.cuda()))]:
            # plans "sync": the plan with its counts, whatever the default mode
            ref, got = both_paths(lambda: det_gemm(xc, wc, b.cuda(), plans="sync"))
            assert last_slices_plan()["kernel_rows_x"] == 2  # the inf row and the wide row
            assert_bitwise(got.cpu(), ref.cpu(), f"cuda {M}x{K}x{N} {dt}: slices vs kernel")
            assert_bitwise(got.cpu(), want, f"cuda {M}x{K}x{N} {dt}: cuda vs cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk_mib", ["256", "1"])  # one N-chunk, then two
def test_cuda_residues_equal_cpu_and_kernel(request, chunk_mib):
    if rerun_in_fresh_process(request, LIGHTNING_DET_SLICES_CHUNK_MIB=chunk_mib):
        return
    x, w = planted_residue_operands(M=600, N=100, K=2048)
    b = gen.normal((100,), torch.float32, 36)
    xc, wc, bc = x.cuda(), w.cuda(), b.cuda()
    assert (explain_gemm(xc, wc, route="slices").fields["n_chunk"] < 100) == (chunk_mib == "1")
    for od in OUT_DTYPES:
        # plans "sync": the plan with its counts, whatever the default mode
        ref, got = both_paths(lambda: det_gemm(xc, wc, bc, out_dtype=od, plans="sync"))
        plan = last_slices_plan()
        assert plan["residues_x"] >= 4 and plan["residues_w"] >= 4 and plan["slices_x"] == 3, plan
        assert_bitwise(got.cpu(), ref.cpu(), f"cuda residues -> {od}, chunks {chunk_mib} MiB")
        with gemm_path("slices"):
            assert_bitwise(got.cpu(), det_gemm(x, w, b, out_dtype=od), f"cuda vs cpu residues -> {od}")
    assert torch.all(det_gemm(xc, wc)[:4, :4].cpu() == 2 + 2 * TINY)
    ref, got = both_paths(lambda: det_gemm_partial(xc, wc, bc))
    assert torch.equal(got, ref), f"cuda residue digits, chunks {chunk_mib} MiB"


@pytest.mark.parametrize("contiguous", ["0", "1"])
def test_output_column_chunks_and_operand_copies(request, contiguous):
    # a 1 MiB cap on the int32 diagonals cuts N into chunks of 8 columns over 6000 rows; the
    # copies variant hands the int8 GEMM contiguous operands: neither may change a bit (knobs
    # read once per process: a fresh one)
    if rerun_in_fresh_process(request, LIGHTNING_DET_SLICES_CHUNK_MIB="1", LIGHTNING_DET_SLICES_CONTIGUOUS=contiguous):
        return
    x, w, b = gen.normal((6000, 96), torch.float32, 15), gen.normal((45, 96), torch.bfloat16, 16), gen.normal((45,), torch.float32, 17)
    det_gemm(x, w, b, route="slices")  # with its bias: w's rows in chunks (without, transposed)
    assert last_gemm_plan().fields["n_chunk"] == 8 and not last_gemm_plan().fields["slices_transposed"]
    assert_same_everywhere(x, w, b, f"N chunks, contiguous={contiguous}")
    # w's residue lists are cut with its rows: 3 + 3 slices, 600 rows -> chunks of 56 columns
    xp, wp = planted_residue_operands(M=600, N=100, K=256)
    assert explain_gemm(xp, wp, route="slices").fields["n_chunk"] < 100
    assert_same_everywhere(xp, wp, None, f"N chunks with residues, contiguous={contiguous}")
    assert last_slices_plan()["residues_w"] >= 4


def bias_below_the_unit_cases():
    """Operands plus biases of 2^-100, below every output's unit, in a few columns and in all: the
    128-bit route must leave those outputs to the long accumulator. Rows 4:8 of x are zero, so
    there the output is the bias itself."""
    x, w = planted_residue_operands(M=600, N=100, K=1024)
    x[4:8] = 0
    for cols in (slice(3, 6), slice(None)):
        b = torch.zeros(100)
        b[cols] = 2.0**-100
        yield x, w, b, cols


def test_outputs_the_128_bit_route_leaves():
    for x, w, b, cols in bias_below_the_unit_cases():
        assert_same_everywhere(x, w, b, f"bias below the unit in columns {cols}")
        with gemm_path("slices"):
            assert torch.all(det_gemm(x, w, b, out_dtype=torch.float32)[4:8, cols] == 2.0**-100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_outputs_the_128_bit_route_leaves():
    # on CUDA the leftovers are listed (a few columns) or, past the list's capacity (every
    # column), all outputs are redone by the long accumulator: unwritten or wrong outputs show
    for x, w, b, cols in bias_below_the_unit_cases():
        xc, wc, bc = assert_cuda_same_as_kernel_and_cpu(x, w, b, f"bias below the unit in columns {cols}")
        assert torch.all(det_gemm(xc, wc, bc, out_dtype=torch.float32)[4:8, cols].cpu() == 2.0**-100)


def test_a_slices_gemm_builds_no_tensor_views_per_int8_gemm():
    # host time: the int8 GEMMs get raw addresses (Int8Gemm), not three views each; with one
    # N-chunk the only views are the summaries' three and both residue counts' (fp32 randn: 9
    # diagonal GEMMs), all in the call's one zeroed buffer, which also holds the combine's counter.
    # Zero-filled buffers: that one, and on the CPU the scales and F of both operands (each an
    # allocation and, on a GPU, a launch; the residue counts had two more)
    x, w = gen.normal((256, 200), torch.float32, 60), gen.normal((128, 200), torch.float32, 61)
    with gemm_path("slices"):
        det_gemm(x, w)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            det_gemm(x, w)
    under = [e.name for e in prof.events() if e.cpu_parent is not None and e.cpu_parent.name == "ldet::gemm"]
    views = [n for n in under if n in ("aten::narrow", "aten::select", "aten::slice", "aten::as_strided")]
    gemms = under.count("aten::_int_mm")
    assert gemms >= 9, f"expected the 9 diagonal GEMMs of 5 x 5 slices, saw {gemms}: {under}"
    assert len(views) <= 5, f"{len(views)} tensor views for {gemms} int8 GEMMs: {under}"
    assert under.count("aten::zeros") <= 5, f"zero-filled buffers: {under}"


@pytest.mark.parametrize("fill", ["0", "1"])
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_buffers_the_kernels_write_skip_the_deterministic_fill(fill, device):
    # under torch.use_deterministic_algorithms (the strategy's environment) at::empty fills new
    # memory; the slices' internal buffers are written in full by their kernels and skip it
    # (csrc/uninit.h). LIGHTNING_DET_FILL_EMPTY=1 restores the fill in a subprocess: the bytes of
    # the result must not change either way
    code = (
        "import torch, collections\n"
        "from lightning_det.ops import det_gemm, gemm_path\n"
        "import sys; sys.path.insert(0, 'tests'); import gen\n"
        "torch.use_deterministic_algorithms(True, warn_only=True)\n"
        "x, w = gen.normal((96, 300), torch.float32, 62), gen.normal((40, 300), torch.bfloat16, 63)\n"
        "x[3, 5] = 2.0 ** -30  # residues: their lists are allocated too\n"
        f"x, w = x.to('{device}'), w.to('{device}')\n"
        "with gemm_path('slices'):\n"
        "    det_gemm(x, w)\n"
        "    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        "        y = det_gemm(x, w)\n"
        "def alloc_fill(e):  # the fill inside an at::empty, not the one of an at::zeros\n"
        "    p = e.cpu_parent\n"
        "    return e.name == 'aten::fill_' and p is not None and p.name == 'aten::empty' and (\n"
        "        p.cpu_parent is None or p.cpu_parent.name != 'aten::zeros')\n"
        "fills = [e for e in prof.events() if alloc_fill(e)]\n"
        "with gemm_path('kernel'):\n"
        "    ref = det_gemm(x, w)\n"
        "print(len(fills), int(torch.equal(y.view(torch.int32), ref.view(torch.int32))))\n"
    )
    env = dict(os.environ, LIGHTNING_DET_FILL_EMPTY=fill)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    fills, same = (int(v) for v in out.stdout.split()[-2:])
    assert same == 1, "the slices' bytes differ from the kernel's"
    if fill == "1":
        assert fills > 0, "the control: at::empty fills under deterministic algorithms"
    else:
        assert fills == 0, f"{fills} deterministic fills of buffers the kernels write in full"


@pytest.mark.parametrize("chunk_mib", ["1", "256"])
def test_tall_x_runs_the_slices_transposed(request, chunk_mib):
    # at 1 MiB of int32 planes, w's N-chunks over x's 20000 rows would be 8 columns wide: the
    # slices run C^T = w x^T in chunks of x's rows and transpose the rounded result back; the
    # kernel's bytes, planned and guessed (digits, as is). At 256 MiB (the control) w's 64 rows fit
    # one chunk and nothing is transposed. The knob is read once per process: a fresh one each.
    if rerun_in_fresh_process(request, LIGHTNING_DET_SLICES_CHUNK_MIB=chunk_mib):
        return
    x, w = gen.normal((20000, 48), torch.float32, 64), gen.normal((64, 48), torch.float32, 65)
    x[7, :2] = torch.tensor([2.0**60, 2.0**-60])  # beyond every slice count: the kernel's fix-up row
    want = chunk_mib == "1"
    plan = explain_gemm(x, w, route="slices")
    assert plan.fields["slices_transposed"] == want and plan.fields["kernel_rows_x"] == 1, plan
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        y = det_gemm(xd, wd, route="slices")
        assert last_gemm_plan().fields["slices_transposed"] == want and last_slices_plan()["kernel_rows_x"] == 1
        assert torch.equal(y, det_gemm(xd, wd, route="kernel")), dtype
        d = det_gemm_partial(xd, wd, route="slices")  # digits keep x's rows whole (no 19-word copy)
        assert not last_gemm_plan().fields["slices_transposed"]
        assert torch.equal(d, det_gemm_partial(xd, wd, route="kernel")), dtype
        y = det_gemm(xd, wd, route="slices", plans=(2, 3))  # a guess too small for some rows: exact_rows
        assert (last_slices_plan()["slices_x"], last_slices_plan()["slices_w"]) == (2, 3)
        assert torch.equal(y, det_gemm(xd, wd, route="kernel")), dtype
    b = gen.normal((64,), torch.float32, 66)  # a bias joins each column's exact sum: never transposed
    y = det_gemm(x, w, b, route="slices")
    assert not last_gemm_plan().fields["slices_transposed"]
    assert torch.equal(y, det_gemm(x, w, b, route="kernel"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tall_x_runs_the_slices_transposed():
    # GPT-2's head wgrad shape class: 50304 rows of x against 768 of w leave w's chunks 136
    # columns wide under cuBLASLt's output cap; transposed, the CPU's bytes
    x, w = gen.normal((50304, 64), torch.float32, 67).bfloat16(), gen.normal((768, 64), torch.float32, 68).bfloat16()
    xc, wc = x.cuda(), w.cuda()
    assert explain_gemm(xc, wc, route="slices").fields["slices_transposed"]
    y = det_gemm(xc, wc, route="slices", out_dtype=torch.bfloat16)
    assert last_gemm_plan().fields["slices_transposed"]
    assert torch.equal(y.cpu(), det_gemm(x, w, out_dtype=torch.bfloat16))
