"""Guessed slice plans (csrc/int_slices_host.h, "Guessed plans"): a GEMM that takes its plan from
a guess instead of waiting for its operands' summaries must give the long-accumulator kernel's
bytes whatever the guess: too few slices (rows recomputed by exact_rows), too many (zero slices,
and past the 128-bit proof: the combine's long-accumulator pass), or stale (a cached guess from
calls on other data)."""
import pytest
import torch
from conftest import assert_bitwise, rerun_in_fresh_process

import gen
from lightning_det.ops import det_gemm, det_gemm_partial, gemm_path, last_gemm_plan, last_slices_plan
from lightning_det.reference import longacc_ref as R
from test_int_slices import bias_below_the_unit_cases, planted_residue_operands

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# too few for every row of randn data; too few on one side only (rows of x, then of w, left to
# exact_rows alone); about right; too many; past the 128-bit proof
GUESSES = [(1, 1), (2, 6), (6, 2), (3, 3), (5, 5), (8, 8)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def kernel_bytes(fn):
    with gemm_path("kernel"):
        return fn()


def guessed(fn, guess):
    """fn(plans) on the slices route with the ``plans`` argument ``guess``."""
    with gemm_path("slices"):
        return fn(guess)


def sync_plan(x, w, b=None):
    with gemm_path("slices"):
        det_gemm(x, w, b, plans="sync")
        return last_slices_plan()


def assert_every_guess_exact(x, w, b, what):
    for od in OUT_DTYPES:
        ref = kernel_bytes(lambda: det_gemm(x, w, b, out_dtype=od))
        for g in GUESSES:
            got = guessed(lambda p: det_gemm(x, w, b, out_dtype=od, plans=p), g)
            assert_bitwise(got, ref, f"{what}: guess {g} -> {od}")
    ref = kernel_bytes(lambda: det_gemm_partial(x, w, b))
    for g in GUESSES:
        assert torch.equal(guessed(lambda p: det_gemm_partial(x, w, b, plans=p), g), ref), f"{what}: guess {g}, digits"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dx,dw", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                   (torch.float16, torch.float32)])
def test_every_guess_gives_the_kernels_bytes(device, dx, dw):
    x = gen.normal((70, 300), dx, 40).to(device)
    w = gen.normal((45, 300), dw, 41).to(device)
    b = gen.normal((45,), torch.float32, 42).to(device)
    plan = sync_plan(x, w, b)
    # the rows need more than the smallest guesses: those do leave rows to exact_rows
    assert plan["slices_x"] >= 2 and plan["slices_w"] >= 2, plan
    assert_every_guess_exact(x, w, b, f"{device} {dx}/{dw}")
    with gemm_path("slices"):
        det_gemm(x, w, b, plans=(2, 3))
        assert last_slices_plan()["slices_x"] == 2 and last_slices_plan()["residues_x"] == -1
    # the control: plain fp32 matmul is not the exact sum rounded once
    xf, wf = x.float().cpu(), w.float().cpu()
    assert not torch.equal(xf @ wf.T + b.cpu(), R.gemm_rounded(xf, wf, b.cpu(), torch.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_guesses_with_inf_nan_zero_and_wide_rows(device):
    x, w = gen.normal((40, 64), torch.float32, 43), gen.normal((24, 64), torch.float32, 44)
    x[3, 0], x[3, 1] = 2.0**60, 2.0**-60  # no S holds it
    x[5, 7] = float("nan")
    x[9] = 0
    x[11, 2] = 1e-44
    w[6, 3] = float("inf")
    w[7, 0], w[7, 1] = -(2.0**70), 2.0**-50
    b = gen.normal((24,), torch.float32, 45)
    assert_every_guess_exact(x.to(device), w.to(device), b.to(device), f"{device} specials")
    # fp16 infinities reach exact_rows' element reader too
    xh, wh = x.clamp(-100, 100).half(), w.clamp(-100, 100).half()
    xh[2, 2], wh[4, 4] = float("inf"), float("-inf")
    assert_every_guess_exact(xh.to(device), wh.to(device), None, f"{device} fp16 specials")


@pytest.mark.parametrize("device", DEVICES)
def test_guesses_with_residues_and_biases_below_the_unit(device):
    x, w = planted_residue_operands()
    assert_every_guess_exact(x.to(device), w.to(device), None, f"{device} planted residues")
    for x, w, b, cols in bias_below_the_unit_cases():
        xd, wd, bd = x.to(device), w.to(device), b.to(device)
        ref = kernel_bytes(lambda: det_gemm(xd, wd, bd))
        for g in [(3, 3), (2, 2)]:
            assert_bitwise(guessed(lambda p: det_gemm(xd, wd, bd, plans=p), g), ref, f"{device} bias 2^-100 in {cols}, {g}")


@pytest.mark.parametrize("device", DEVICES)
def test_guesses_across_output_column_chunks(request, device):
    # a 1 MiB cap on the int32 diagonals cuts N into chunks of 8 columns over 6000 rows: w's
    # listed rows (output columns) sit in different chunks, and exact_rows writes them into the
    # assembled result (the knob is read once per process: a fresh one)
    if rerun_in_fresh_process(request, LIGHTNING_DET_SLICES_CHUNK_MIB="1"):
        return
    x, w = gen.normal((6000, 96), torch.float32, 46), gen.normal((45, 96), torch.bfloat16, 47)
    w[[3, 30, 44], 5] = 2.0**-40  # three rows that need more slices than the others
    b = gen.normal((45,), torch.float32, 48)  # with a bias the slices keep x's rows whole
    det_gemm(x.to(device), w.to(device), b.to(device), route="slices")
    assert last_gemm_plan().fields["n_chunk"] == 8 and not last_gemm_plan().fields["slices_transposed"]
    assert_every_guess_exact(x.to(device), w.to(device), b.to(device), f"{device} N chunks")


@pytest.mark.parametrize("device", DEVICES)
def test_cached_guess_from_other_data_stays_exact_and_learns(device):
    # first calls: small integers (1 slice each); then randn rows of the same shapes, which need
    # more: the cached guess is too small for every row until their summary has been read
    small_x = torch.randint(-3, 4, (50, 128)).float().to(device)
    small_w = torch.randint(-3, 4, (30, 128)).float().to(device)
    x, w = gen.normal((50, 128), torch.float32, 49).to(device), gen.normal((30, 128), torch.float32, 50).to(device)
    ref = kernel_bytes(lambda: det_gemm(x, w))
    need = sync_plan(x, w)
    with gemm_path("slices"):
        for _ in range(3):
            det_gemm(small_x, small_w, plans="cached")
        assert (last_slices_plan()["slices_x"], last_slices_plan()["slices_w"]) == (1, 1)
        got = det_gemm(x, w, plans="cached")  # guess (1, 1): every row recomputed
        assert last_slices_plan()["slices_x"] == 1
        assert_bitwise(got, ref, f"{device} stale guess")
        if device == "cuda":
            torch.cuda.synchronize()  # the summary read at the next call must have landed
        got = det_gemm(x, w, plans="cached")  # now the largest of the recent plans, randn's
        plan = last_slices_plan()
        assert (plan["slices_x"], plan["slices_w"]) == (need["slices_x"], need["slices_w"]), (plan, need)
        assert_bitwise(got, ref, f"{device} learned guess")


@pytest.mark.parametrize("device", DEVICES)
def test_default_mode_plans_from_the_summaries_and_cached_mode_guesses(device):
    x, w = gen.normal((30, 64), torch.float32, 51).to(device), gen.normal((20, 64), torch.float32, 52).to(device)
    with gemm_path("slices"):
        for _ in range(2):
            det_gemm(x, w)
        assert last_slices_plan()["residues_x"] >= 0, "the default plans from each call's summaries"
        for _ in range(2):
            det_gemm(x, w, plans="cached")
        assert last_slices_plan()["residues_x"] == -1, "a repeated key takes a cached guess"
        det_gemm(x, w)
        assert last_slices_plan()["residues_x"] >= 0, "the plans argument holds for its own call only"


@pytest.mark.parametrize("bad", [(0, 3), (1, 9), (2,), "often", 3, (1.0, 2), (True, 2)])
def test_plans_argument_rejects_bad_values(bad):
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    with pytest.raises(ValueError, match="plans: expected"):
        det_gemm(x, w, plans=bad)
    with pytest.raises(ValueError, match="plans: expected"):
        det_gemm_partial(x, w, plans=bad)


def test_gemm_op_checks_its_plans_argument():
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    for bad in ([0, 3], [1, 9], [-2, -1]):
        with pytest.raises(ValueError, match="plans: expected"):
            torch.ops.ldet.gemm(x, w, None, None, bad)
    assert torch.equal(torch.ops.ldet.gemm(x, w, None, None, [2, 3]), det_gemm(x, w))
