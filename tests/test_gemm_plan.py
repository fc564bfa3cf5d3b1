"""The GEMM planner (csrc/gemm_plan.h): explain_gemm names the route of a call and why, the route it
names is the one det_gemm / det_gemm_partial then run (last_gemm_plan, last_slices_plan,
last_fp64_counts), forcing options are explicit per call (no process-wide switch), and bad options
fail with a clear error. Every route gives the same bytes, checked against the exact Python
reference where a route is forced; the control shows torch.mm differs on those operands."""
import threading

import pytest
import torch
from conftest import assert_bitwise

import gen
from lightning_det.ops import (
    det_finalize,
    det_gemm,
    det_gemm_partial,
    explain_gemm,
    gemm_path,
    last_fp64_counts,
    last_gemm_plan,
    last_slices_plan,
    plan_gemm,
)
from lightning_det.reference import longacc_ref as R


def wide(shape, seed, lo=-40, hi=40, dtype=torch.float32):
    """|values| in [1, 2) * 2^e, e uniform in [lo, hi], random signs: beyond the slices' reach."""
    g = torch.Generator().manual_seed(seed)
    mant = 1 + torch.rand(shape, generator=g)
    e = torch.randint(lo, hi + 1, shape, generator=g).to(torch.float32)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(e)).to(dtype)


def least_cost_route(plan, digits):
    """The route the cost table's figures in the plan choose (ties to the earlier route)."""
    costs = [("kernel", plan.fields["cost_kernel"]), ("slices", plan.fields["cost_slices"])]
    if not digits:
        costs.append(("fp64", plan.fields["cost_fp64"]))
    best = min((c, i, r) for i, (r, c) in enumerate(costs) if c is not None)
    return best[2]


def run_and_compare(x, w, output="rounded", **kw):
    """explain_gemm's plan, then the call itself and its executed plan."""
    plan = explain_gemm(x, w, output=output, **kw)
    if output == "rounded":
        y = det_gemm(x, w, **kw)
    else:
        y = det_gemm_partial(x, w, **kw)
    ran = last_gemm_plan()
    assert ran.route == plan.route, (plan, ran)
    for k in ("slices_x", "slices_w", "moduli"):
        assert getattr(ran, k) == getattr(plan, k), (k, plan, ran)
    if plan.route == "slices":
        lp = last_slices_plan()
        assert (lp["slices_x"], lp["slices_w"], lp["moduli"]) == (plan.slices_x, plan.slices_w, plan.moduli)
    return plan, y


def test_tiny_fp32_takes_the_fp64_route_rounded_and_another_for_digits():
    # the CPU table: the fp64 route's fixed costs are the smallest; digits outputs cannot take it
    x, w = gen.normal((4, 4), seed=1), gen.normal((3, 4), seed=2)
    plan, y = run_and_compare(x, w)
    assert plan.route == "fp64" and plan.route_reason.startswith("auto"), plan
    assert plan.fields["cost_source"]
    assert_bitwise(y, R.gemm_rounded(x, w), "tiny")
    plan, acc = run_and_compare(x, w, output="digits")
    assert plan.route == least_cost_route(plan, True) != "fp64", plan
    assert torch.equal(det_finalize(acc), y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("output", ["rounded", "digits"])
def test_normal_data_auto_takes_the_least_cost_route(dtype, output):
    x, w = gen.normal((96, 128), seed=3).to(dtype), gen.normal((80, 128), seed=4).to(dtype)
    plan, y = run_and_compare(x, w, output=output)
    assert plan.route == least_cost_route(plan, output == "digits"), plan
    assert plan.route_reason.startswith("auto: least cost"), plan
    if plan.route == "slices":
        assert plan.slices_x >= 1 and plan.slices_w >= 1 and plan.counts_reason and plan.way_reason, plan


def test_wide_exponent_spread_sends_digits_back_to_the_kernel():
    # fp32 with exponents over [-40, 40]: most rows need more than 8 slices, so under auto the
    # slices hand the call to the kernel, and the plan says so
    x, w = wide((48, 256), seed=5), wide((40, 256), seed=6)
    plan, acc = run_and_compare(x, w, output="digits")
    assert plan.route == least_cost_route(plan, True) != "fp64", plan
    if plan.fields["slices_planned"]:
        assert "wide exponent spread" in plan.route_reason, plan
        assert plan.fields["kernel_rows_x"] > 24, plan
    with gemm_path("kernel"):
        ref = det_gemm_partial(x, w)
    assert torch.equal(acc, ref)


@pytest.mark.parametrize("shape", [(48, 40, 256), (128, 128, 128)])
def test_wide_16bit_rounded_auto_takes_the_fp64_route(shape):
    # bf16 with exponents over [-40, 40]: most of the kernel's K-blocks miss its fast path (about
    # 75x slower) and most rows are beyond the slices, so auto sends rounded outputs to the fp64
    # route, whose cost does not depend on the spread: through the probe where the cost table
    # chose the kernel, or through the slices' own plan where it chose them (CPUs with AVX-512 at
    # 128^3)
    M, N, K = shape
    x = wide((M, K), seed=23, dtype=torch.bfloat16)
    w = wide((N, K), seed=24, dtype=torch.bfloat16)
    plan, y = run_and_compare(x, w)
    assert plan.route == "fp64" and "wide exponent spread" in plan.route_reason, plan
    assert plan.route_reason.startswith("auto"), plan
    if not plan.fields["slices_planned"]:
        assert plan.fields["kernel_slow_share"] > 1 / 64, plan
    assert_bitwise(y, R.gemm_rounded(x, w), "wide bf16, auto")
    assert not torch.equal((x.float() @ w.float().T), y)  # the control: plain fp32 GEMM differs
    # digits cannot take the fp64 route: the kernel, as before
    digits = explain_gemm(x, w, output="digits")
    assert digits.route != "fp64", digits


def test_normal_16bit_data_keeps_the_kernel_where_the_table_chose_it():
    # the probe leaves normal data on the kernel: nearly every K-block takes its fast path
    x, w = gen.normal((48, 256), seed=25).bfloat16(), gen.normal((40, 256), seed=26).bfloat16()
    plan, y = run_and_compare(x, w)
    if plan.fields["cost_kernel"] <= min(plan.fields["cost_slices"], plan.fields["cost_fp64"] or float("inf")):
        assert plan.route == "kernel" and 0 <= plan.fields["kernel_slow_share"] <= 1 / 64, plan
    assert_bitwise(y, R.gemm_rounded(x, w), "normal bf16, auto")


def test_wide_data_forced_slices_recompute_rows_on_the_kernel():
    x, w = wide((48, 256), seed=7), wide((40, 256), seed=8)
    plan, y = run_and_compare(x, w, route="slices")
    assert plan.route == "slices" and plan.route_reason == "forced by route=slices", plan
    assert plan.fields["kernel_rows_x"] > 0 and "kernel" in plan.fallback, plan
    assert_bitwise(y, R.gemm_rounded(x, w), "wide, slices forced")


def test_large_k_cuts_the_diagonals_and_rules_out_crt():
    # K beyond the CRT way's int32 bound (K 2^14 r^2 < 2^31): the diagonals, in several K-chunks
    K = 140_000
    x, w = gen.normal((3, K), seed=9), gen.normal((2, K), seed=10)
    plan, y = run_and_compare(x, w, route="slices")
    assert plan.moduli == 0 and plan.slices_way == "diagonals", plan
    assert "no moduli cover" in plan.way_reason, plan
    assert plan.fields["k_chunks"] >= 2, plan
    assert_bitwise(y, det_gemm(x, w, route="kernel"), "K 140000")


def test_crt_and_diagonals_forced():
    x, w = gen.normal((40, 64), seed=11), gen.normal((24, 64), seed=12)
    ref = R.gemm_rounded(x, w)
    crt, y_crt = run_and_compare(x, w, route="slices_crt")
    diag, y_diag = run_and_compare(x, w, route="slices_diagonals")
    assert crt.slices_way == "crt" and crt.moduli > 0, crt
    assert diag.slices_way == "diagonals" and "forced" in diag.way_reason, diag
    assert_bitwise(y_crt, ref, "crt")
    assert_bitwise(y_diag, ref, "diagonals")


def test_fp64_forced_for_rounded_outputs_only():
    x, w = gen.normal((33, 300), seed=13), gen.normal((17, 300), seed=14)
    plan, y = run_and_compare(x, w, route="fp64")
    assert plan.route == "fp64" and plan.route_reason == "forced by route=fp64", plan
    assert plan.fields["fp64_n_chunk"] == 17 and "long accumulator" in plan.fallback, plan
    assert last_fp64_counts()["undecided"] >= 0
    assert_bitwise(y, R.gemm_rounded(x, w), "fp64")
    digits = explain_gemm(x, w, output="digits", route="fp64")
    assert digits.route != "fp64" and digits.route_reason.startswith("auto"), digits


def test_plain_torch_differs_on_these_operands():
    # the control: the ordinary float GEMM is not the exact sum rounded once on such data
    x, w = wide((48, 256), seed=7), wide((40, 256), seed=8)
    assert not torch.equal(x @ w.T, R.gemm_rounded(x, w))


def test_forcing_is_explicit_per_call_and_per_thread():
    x, w = gen.normal((8, 16), seed=15), gen.normal((8, 16), seed=16)
    assert explain_gemm(x, w, route="kernel").route == "kernel"
    assert explain_gemm(x, w, route="slices").route == "slices"
    seen = {}

    def other_thread():
        seen["plan"] = explain_gemm(x, w)
        det_gemm(x, w)
        seen["ran"] = last_gemm_plan()

    with gemm_path("slices"):
        assert explain_gemm(x, w).route_reason == "forced by route=slices"
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        det_gemm(x, w, route="kernel")  # the argument wins over the block
        assert last_gemm_plan().route == "kernel"
    assert seen["plan"].route_reason.startswith("auto"), seen["plan"]
    assert seen["ran"].route_reason.startswith("auto"), seen["ran"]


def test_bad_options_fail_clearly():
    x, w = gen.normal((4, 8), seed=17), gen.normal((3, 8), seed=18)
    with pytest.raises(ValueError, match="route: expected one of"):
        explain_gemm(x, w, route="fast")
    with pytest.raises(ValueError, match="route: expected one of"):
        det_gemm(x, w, route="fp32")
    with pytest.raises(ValueError, match="plans: expected a tuple"):
        explain_gemm(x, w, plans=(0, 9))
    with pytest.raises(ValueError, match="output: expected"):
        explain_gemm(x, w, output="bits")
    from lightning_det.ops._registry import ldet

    with pytest.raises(ValueError, match="route: expected 0 \\(auto\\)"):
        ldet().gemm(x, w, None, None, [-1, -1, 9])
    with pytest.raises(ValueError, match="options: expected"):
        ldet().gemm(x, w, None, None, [-1, -1, 0, 0])
    with pytest.raises(ValueError, match="plans: expected"):
        ldet().explain_gemm(x, w, False, [3, 0, 0])


@pytest.mark.parametrize("n", [16, 64, 128])
def test_cpu_fp32_rounded_takes_the_fp64_route(n):
    # the CPU cost table (benchmarks/results/cpu-gemm_routes.json): the fp64 route ahead of the
    # kernel and the slices for rounded fp32 outputs at every size measured; digits outputs cannot
    # take it and go to the least cost of the others
    x, w = gen.normal((n, n), seed=19), gen.normal((n, n), seed=20)
    plan, y = run_and_compare(x, w)
    assert plan.route == "fp64", plan
    digits = explain_gemm(x, w, output="digits")
    assert digits.route == least_cost_route(digits, True), digits
    assert_bitwise(y, det_gemm(x, w, route="kernel"), f"{n}^3")


@pytest.mark.parametrize("n", [8, 16, 32, 64, 256, 1024, 4096, 16384])
def test_cuda_fp32_plans_by_shape_on_any_machine(n):
    # plan_gemm is the planner's first stage as a pure function: on this machine it tells what a
    # GPU chooses. The CUDA cost table: rounded fp32 outputs take the fp64 route at every size;
    # digits outputs (no fp64 route) the slices, the least cost of the other two
    plan = plan_gemm(n, n, n, device="cuda")
    assert (plan.route, plan.device, plan.output) == ("fp64", "cuda", "rounded"), plan
    assert plan.fields["cost_fp64"] < min(plan.fields["cost_kernel"], plan.fields["cost_slices"]), plan
    digits = plan_gemm(n, n, n, device="cuda", output="digits")
    assert digits.route == "slices" == least_cost_route(digits, True), digits


@pytest.mark.parametrize("M,N,K,route", [
    # GPT-2-small at 8192 tokens, rounded to bf16: forward and dgrad (K <= 3072) on the fp64
    # route, the wgrads (K = 8192 tokens) and the head's dgrad (K = 32768) on the slices
    (8192, 2304, 768, "fp64"), (8192, 768, 768, "fp64"), (8192, 3072, 768, "fp64"), (8192, 768, 3072, "fp64"),
    (8192, 768, 2304, "fp64"), (8192, 32768, 768, "fp64"), (2048, 2048, 2048, "fp64"), (1024, 1024, 1024, "fp64"),
    (4096, 4096, 4096, "slices"), (2304, 768, 8192, "slices"), (8192, 768, 32768, "slices"),
])
def test_cuda_16bit_rounded_to_16_bits_plans_by_k(M, N, K, route):
    # the CUDA rows for 16-bit inputs rounded to 16 bits (kRound16Table, h100-gemm_routes.json
    # --out-dtype inputs); rounded to fp32 the same shapes keep kCostTable's slices from 2^32
    for dtype in (torch.bfloat16, torch.float16):
        plan = plan_gemm(M, N, K, dtype, device="cuda", out_dtype=dtype)
        assert plan.route == route and plan.fields["out16"], plan
        assert "rounded to 16 bits" in plan.route_reason, plan
        assert ("bf16 outputs" in plan.fields["cost_source"]) == (K <= 3072), plan
    to_fp32 = plan_gemm(M, N, K, torch.bfloat16, device="cuda")
    assert not to_fp32.fields["out16"] and "bf16 outputs" not in to_fp32.fields["cost_source"], to_fp32
    if M * N * K >= 2**32:
        assert to_fp32.route == "slices", to_fp32
    for device in ("cpu", "cpu-avx512"):  # the CPU has no such rows
        cpu = plan_gemm(M, N, K, torch.bfloat16, device=device, out_dtype=torch.bfloat16)
        assert cpu.route == plan_gemm(M, N, K, torch.bfloat16, device=device).route, cpu


def test_shape_plan_matches_the_operands_plan_where_the_data_changes_nothing():
    # explain_gemm runs the same first stage on real operands (then the data's stages, which
    # normal data leaves alone): both name the same route, costs and source, for each output,
    # dtype, route and a shape of each cost row of this machine's device class
    device = explain_gemm(gen.normal((4, 4), seed=1), gen.normal((4, 4), seed=2)).device
    for (m, n, k) in [(4, 4, 4), (64, 48, 96), (160, 128, 192), (520, 512, 512)]:
        for dtype in (torch.float32, torch.bfloat16):
            x, w = gen.normal((m, k), seed=m, dtype=dtype), gen.normal((n, k), seed=n + 1, dtype=dtype)
            for output, out_dtype in (("rounded", None), ("rounded", dtype), ("digits", None)):
                for route in (None, "kernel", "fp64"):
                    ops_plan = explain_gemm(x, w, output=output, route=route, out_dtype=out_dtype)
                    shape_plan = plan_gemm(m, n, k, dtype, device=device, output=output, route=route,
                                           out_dtype=out_dtype)
                    if ops_plan.route == "slices":  # the slices' counts come from the data
                        assert shape_plan.route == "slices", (shape_plan, ops_plan)
                        continue
                    for key in ("route", "route_reason", "fallback", "cost_kernel", "cost_slices", "cost_fp64",
                                "cost_source", "fp64_n_chunk", "out16"):
                        assert shape_plan.fields[key] == ops_plan.fields[key], (key, m, dtype, output, route)


def test_shape_plan_mixed_dtypes_and_the_route_scope():
    # an fp32 operand makes the call fp32 (the kernel splits it); a gemm_path block reaches the
    # pure planner as it reaches det_gemm
    mixed = plan_gemm(64, 64, 64, torch.bfloat16, w_dtype=torch.float32, device="cuda")
    assert mixed.inputs == "fp32" and mixed.route == "fp64", mixed
    assert plan_gemm(64, 64, 64, torch.bfloat16, device="cuda").inputs == "16-bit"
    with gemm_path("kernel"):
        assert plan_gemm(64, 64, 64, device="cuda").route == "kernel"
    assert plan_gemm(64, 64, 64, device="cuda", route="slices").route == "slices"
    assert plan_gemm(0, 64, 64, device="cuda").route_reason == "empty: no products"


def test_shape_plan_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="device: expected one of"):
        plan_gemm(4, 4, 4, device="tpu")
    with pytest.raises(ValueError, match="M, N, K: expected integers >= 0"):
        plan_gemm(4, -1, 4)
    with pytest.raises(ValueError, match="M, N, K: expected integers >= 0"):
        plan_gemm(4.5, 4, 4)
    with pytest.raises(TypeError, match="w_dtype: expected torch.float32"):
        plan_gemm(4, 4, 4, w_dtype=torch.int8)
    with pytest.raises(ValueError, match="output: expected"):
        plan_gemm(4, 4, 4, output="fp32")
    with pytest.raises(TypeError, match="out_dtype: expected None, torch.float32"):
        plan_gemm(4, 4, 4, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="out_dtype: digits outputs are not rounded"):
        plan_gemm(4, 4, 4, output="digits", out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype: digits outputs are not rounded"):
        explain_gemm(torch.ones(4, 4), torch.ones(4, 4), output="digits", out_dtype=torch.float32)
    with pytest.raises(ValueError, match="route: expected one of"):
        plan_gemm(4, 4, 4, route="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [16, 32, 64])
def test_cuda_fp32_rounded_takes_the_fp64_route(n):
    # the CUDA cost table (h100-gemm_routes.json below 64^3, h200-gemm_small.json from it): the
    # fp64 route ahead of the kernel and the slices for rounded fp32 outputs at every size;
    # digits outputs go to the least cost of the others; the CPU's bytes and the forced kernel's
    x, w = gen.normal((n, n), seed=21), gen.normal((n, n), seed=22)
    plan, y = run_and_compare(x.cuda(), w.cuda())
    assert plan.route == "fp64", plan
    assert torch.equal(y.cpu(), det_gemm(x, w))
    assert_bitwise(y, det_gemm(x.cuda(), w.cuda(), route="kernel"), f"{n}^3")
    digits, acc = run_and_compare(x.cuda(), w.cuda(), output="digits")
    assert digits.route == least_cost_route(digits, True), digits
    assert torch.equal(acc.cpu(), det_gemm_partial(x, w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,shape", [(torch.float32, (96, 80, 256)), (torch.bfloat16, (2048, 2048, 1024))])
def test_cuda_wide_data_leaves_the_slices_for_the_fp64_route(dtype, shape):
    # CUDA: where the cost table chose the slices (fp32 digits at every size, 16-bit from M N K =
    # 2^32) and most rows are beyond them, rounded outputs go to the fp64 route (not the kernel,
    # which is slow on such data), and digits outputs to the kernel; the CPU's bytes either way.
    # fp32 rounded outputs take the fp64 route by the table alone.
    M, N, K = shape
    x, w = wide((M, K), seed=27, dtype=dtype), wide((N, K), seed=28, dtype=dtype)
    plan, y = run_and_compare(x.cuda(), w.cuda())
    assert plan.route == "fp64", plan
    if least_cost_route(plan, False) == "slices":
        assert "beyond the slices" in plan.route_reason, plan
    assert torch.equal(y.cpu(), det_gemm(x, w))
    if M * N * K < 2**20:
        digits, acc = run_and_compare(x.cuda(), w.cuda(), output="digits")
        assert digits.route == "kernel" and "beyond the slices" in digits.route_reason, digits
        assert torch.equal(acc.cpu(), det_gemm_partial(x, w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (256, 192, 512)), (torch.float16, (512, 384, 1024))])
def test_cuda_wide_16bit_below_the_slices_takes_the_fp64_route(dtype, shape):
    # CUDA: below the slices' sizes the cost table chose the kernel, and the probe of its warp
    # K-blocks (a shape's first call reads it back) sends wide rounded calls to the fp64 route;
    # normal data of another shape keeps the kernel; the CPU's bytes either way
    M, N, K = shape
    lo, hi = (-40, 40) if dtype == torch.bfloat16 else (-12, 12)  # fp16: no overflow in the products
    x, w = wide((M, K), seed=29, lo=lo, hi=hi, dtype=dtype), wide((N, K), seed=30, lo=lo, hi=hi, dtype=dtype)
    plan, y = run_and_compare(x.cuda(), w.cuda())
    assert plan.route == "fp64" and plan.fields["kernel_slow_share"] > 1 / 64, plan
    assert "miss its fast path" in plan.route_reason, plan
    assert torch.equal(y.cpu(), det_gemm(x, w))
    assert not torch.equal((x.cuda().float() @ w.cuda().float().T).cpu(), y.cpu())  # the control
    # normal bf16 keeps the kernel where the table chose it (fp16's 10-bit significands leave
    # more of the kernel's blocks off the tensor cores: whichever route, the CPU's bytes)
    xn, wn = gen.normal((M + 8, K), seed=31).to(dtype), gen.normal((N, K), seed=32).to(dtype)
    plan, y = run_and_compare(xn.cuda(), wn.cuda())
    if dtype == torch.bfloat16 and least_cost_route(plan, False) == "kernel":
        assert plan.route == "kernel" and 0 <= plan.fields["kernel_slow_share"] <= 1 / 64, plan
    assert torch.equal(y.cpu(), det_gemm(xn, wn))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_probe_follows_a_shape_whose_data_turns_wide():
    # a shape's later calls take its last probe read back: data turning wide keeps the kernel on
    # the next call (no synchronization), and moves to the fp64 route once a later probe arrives
    # (every 16th call sends one); the bytes are the exact ones whichever route ran
    M, N, K = 200, 136, 320
    xn, wn = gen.normal((M, K), seed=33).bfloat16().cuda(), gen.normal((N, K), seed=34).bfloat16().cuda()
    xw = wide((M, K), seed=35, dtype=torch.bfloat16)
    ww = wide((N, K), seed=36, dtype=torch.bfloat16)
    ref = det_gemm(xw, ww)  # the CPU's bytes
    det_gemm(xn, wn)
    assert last_gemm_plan().route == "kernel"
    routes = []
    for _ in range(40):
        y = det_gemm(xw.cuda(), ww.cuda())
        torch.cuda.synchronize()
        routes.append(last_gemm_plan().route)
        assert torch.equal(y.cpu(), ref)
    assert routes[0] == "kernel", routes
    assert routes[-1] == "fp64" and routes.index("fp64") <= 18, routes
    assert explain_gemm(xw.cuda(), ww.cuda()).route == "fp64"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_16bit_rounded_to_16_bits_takes_the_fp64_route(dtype):
    # M N K = 2^32.6, K = 768: rounded to the inputs' dtype the fp64 route (kRound16Table), to
    # fp32 the slices; the same bytes as the forced slices and as the CPU
    x, w = gen.normal((4096, 768), seed=23).to(dtype), gen.normal((2048, 768), seed=24).to(dtype)
    xc, wc = x.cuda(), w.cuda()
    plan, y = run_and_compare(xc, wc, out_dtype=dtype)
    assert plan.route == "fp64" and plan.fields["out16"], plan
    assert y.dtype == dtype
    assert_bitwise(y, det_gemm(xc, wc, out_dtype=dtype, route="slices"), "fp64 route vs slices")
    assert torch.equal(y.cpu(), det_gemm(x, w, out_dtype=dtype))
    to_fp32, _ = run_and_compare(xc, wc)
    assert to_fp32.route == "slices" and not to_fp32.fields["out16"], to_fp32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", [None, "kernel", "slices", "slices_crt", "slices_diagonals", "fp64"])
def test_cuda_plans_name_the_route_and_match_the_cpu(dtype, route):
    # the CUDA planner: explain_gemm and the executed plan agree, the device is named, and every
    # route gives the CPU's bytes (rounded and digits)
    x, w = gen.normal((72, 160), seed=21).to(dtype), gen.normal((56, 160), seed=22).to(dtype)
    xc, wc = x.cuda(), w.cuda()
    for output in ("rounded", "digits"):
        plan, y = run_and_compare(xc, wc, output=output, route=route)
        assert plan.fields["device"] == "cuda", plan
        if route is None:
            assert plan.route_reason.startswith("auto"), plan
        ref = det_gemm(x, w) if output == "rounded" else det_gemm_partial(x, w)
        assert torch.equal(y.cpu(), ref), (output, plan)
