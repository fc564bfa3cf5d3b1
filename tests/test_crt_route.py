"""The slices' CRT route (csrc/crt.h): the products' integer from its remainders modulo a few
int8-sized moduli, one int8 GEMM per modulus. It must give the long-accumulator kernel's bytes
everywhere, use the fewest moduli that cover the products (checked against an independent Python
count), fail without the last one on data at the bound (the bound has teeth), and step aside where
the int32 sums or the 128-bit reconstruction could not hold (the diagonals then run).

CUDA: the same route's kernels against the CUDA long-accumulator kernel and the CPU route.
"""
import math

import pytest
import torch
from conftest import (
    SLICE_OUT_DTYPES,
    assert_bitwise,
    assert_same_everywhere,
    fresh_operands,
    fresh_process_gemm,
    seven_bit_digits_gemm,
)

import gen
from lightning_det.ops import det_gemm, det_gemm_partial, gemm_path, last_slices_plan
from lightning_det.reference import longacc_ref as R

INT32_MAX = 2**31 - 1


def crt_moduli_py(bits: int):
    """The moduli, independently: pairwise coprime, greedy from 2^bits down, at most 15."""
    ms = []
    for c in range(2**bits, 2, -1):
        if all(math.gcd(c, m) == 1 for m in ms):
            ms.append(c)
        if len(ms) == 15:
            break
    return ms


def moduli_needed_py(K: int, sx: int, sw: int, bits: int) -> int:
    """Fewest moduli whose product is >= 2^(B + 1), |P| < 2^B = K 2^(bits sx - 2) 2^(bits sw - 2)."""
    B = math.ceil(math.log2(K)) + bits * (sx + sw) - 4
    prod = 1
    for q, m in enumerate(crt_moduli_py(bits), 1):
        prod *= m
        if prod >= 2 ** (B + 1):
            return q
    return 0


def garner_py(P: int, moduli):
    """P's symmetric reconstruction from its remainders modulo `moduli` (Python integers)."""
    M = math.prod(moduli)
    x = 0
    for m in moduli:  # plain CRT, independent of the kernel's Garner order
        Mi = M // m
        x += (P % m) * Mi * pow(Mi, -1, m)
    x %= M
    return x - M if x >= (M + 1) // 2 else x


def slice_bits() -> int:
    """The digit width this machine's CPU backend uses (8, or 7 without VNNI): values 1 + 2^-13
    span 14 bits, 2 slices of 8 bits (3 + 14 <= 16 + ...) but 3 of 7 (int_slices.h, slices_needed)."""
    x = torch.full((4, 64), 1 + 2.0**-13)
    with gemm_path("slices_crt"):
        det_gemm(x, x)
        s = last_slices_plan()["slices_x"]
    assert s in (2, 3), f"1 + 2^-13 took {s} slices"
    return 8 if s == 2 else 7


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_crt_route_runs_with_fewer_gemms_and_the_kernels_bytes(dt):
    x, w = gen.normal((64, 700), dt, 51), gen.normal((48, 700), dt, 52)
    plan = assert_same_everywhere(x, w, gen.normal((48,), torch.float32, 53), f"{dt} normal")
    assert plan["moduli"] == moduli_needed_py(700, plan["slices_x"], plan["slices_w"], slice_bits()), plan
    if dt == torch.float32:  # the point of the route: fewer int8 GEMMs than slice pairs
        assert 0 < plan["moduli"] < plan["slices_x"] * plan["slices_w"], plan
    # control: an ordinary fp32 matmul is not the exactly rounded result here
    with gemm_path("slices_crt"):
        exact = det_gemm(x.float(), w.float())
    assert not torch.equal(x.float() @ w.float().T, exact)


def test_products_at_their_bound_need_every_modulus():
    # Every element 1 + 2^-6 (x) and -(2 - 2^-23) (w): rows without spread, so the window integers
    # sit just below their bound and P = K X W is within a factor (1 - 2^-23) of 2^B. The plan's
    # moduli must be the independent count, the result exact, and one modulus fewer must not
    # reconstruct P (the count is tight here, so the bound matters).
    K = 4096
    x = torch.full((3, K), 1 + 2.0**-6)
    w = torch.full((2, K), -(2 - 2.0**-23))
    x[1] = -x[1]  # both signs of P
    plan = assert_same_everywhere(x, w, what="products at the bound")
    bits = slice_bits()
    q = moduli_needed_py(K, plan["slices_x"], plan["slices_w"], bits)
    assert plan["moduli"] == q > 0, plan
    # P from the operands' window integers (int_slices.h, step 1: sh = bits S - 3 - hi)
    X = int((1 + 2.0**-6) * 2.0 ** (bits * plan["slices_x"] - 3))
    W = -int((2 - 2.0**-23) * 2.0 ** (bits * plan["slices_w"] - 3))
    P = K * X * W
    moduli = crt_moduli_py(bits)
    B = math.ceil(math.log2(K)) + bits * (plan["slices_x"] + plan["slices_w"]) - 4
    assert abs(P) < 2**B and abs(P) > 2 ** (B - 2), "the data should sit near the bound"
    assert garner_py(P, moduli[:q]) == P and garner_py(-P, moduli[:q]) == -P
    # the control: one modulus fewer cannot cover this P (true for 8- and 7-bit digits alike)
    assert math.prod(moduli[: q - 1]) <= 2 * abs(P)
    assert garner_py(P, moduli[: q - 1]) != P


def test_int32_bound_of_the_remainder_sums():
    # x = w = 1 + 2^-(bits - 2) at S = 2: every window integer is 2^(2 bits - 3) + 2^(bits - 1),
    # so every remainder modulo 2^bits is -2^(bits - 1) and C_0 = K 2^(2 bits - 2): the largest
    # int32 sum there is. K = (2^31 - 1) >> (2 bits - 2) is the last K the route takes; one more
    # and it steps aside for the diagonals.
    bits = slice_bits()
    v = 1 + 2.0 ** -(bits - 2)
    k_max = INT32_MAX >> (2 * bits - 2)
    for K, crt in ((k_max, True), (k_max + 1, False)):
        x = torch.full((2, K), v)
        plan = assert_same_everywhere(x, x.clone(), what=f"K = {K}")
        assert plan["slices_x"] == plan["slices_w"] == 2, plan
        assert (plan["moduli"] > 0) == crt, f"K = {K}: {plan}"
    X = int(v * 2.0 ** (2 * bits - 3))
    assert X % 2**bits == 2 ** (bits - 1), "the remainders modulo 2^bits should be -2^(bits-1)"
    assert k_max * 2 ** (2 * bits - 2) <= INT32_MAX < (k_max + 1) * 2 ** (2 * bits - 2)


def test_digits_route_of_the_reconstructed_integer():
    # a bias far below the products' grid cannot join the 128-bit sum: every output takes the
    # digits, with P entering them in 32-bit limbs (int_slices.h, combine_output_value)
    x, w = gen.normal((16, 300), torch.float32, 54), gen.normal((12, 300), torch.float32, 55)
    bias = torch.full((12,), 2.0**-120) * torch.arange(1, 13)
    assert assert_same_everywhere(x, w, bias, "bias below the grid")["moduli"] > 0


def test_wide_and_out_of_range_rows_with_crt():
    # rows at scales 2^-30 .. 2^30, a NaN, an inf, a zero row: rows the slices cannot hold go to
    # the kernel, the others through the CRT route
    g = torch.Generator().manual_seed(56)
    x = torch.randn(40, 96, generator=g) * torch.exp2(torch.randint(-30, 30, (40, 1), generator=g).float())
    w = torch.randn(24, 96, generator=g) * torch.exp2(torch.randint(-6, 6, (24, 96), generator=g).float())
    x[5, 7], x[9], w[6, 3] = float("nan"), 0.0, float("inf")
    assert assert_same_everywhere(x, w, gen.normal((24,), torch.float32, 57), "wide rows")["moduli"] > 0


def test_window_integers_past_2_to_the_46_with_crt():
    # each element scaled by 2^-10 .. 2^9: rows spanning ~20 bits take 7 slices of 8 bits, so their
    # window integers reach 2^(8 7 - 2) = 2^54, past what one fp64 holds: the CPU's remainders split
    # them in two (crt.h, crt_remainders_fp64); K = 64 keeps them within the 15 moduli
    g = torch.Generator().manual_seed(60)
    x = torch.randn(64, 64, generator=g) * torch.exp2(torch.randint(-10, 10, (64, 64), generator=g).float())
    w = torch.randn(48, 64, generator=g) * torch.exp2(torch.randint(-10, 10, (48, 64), generator=g).float())
    plan = assert_same_everywhere(x, w, gen.normal((48,), torch.float32, 61), "window integers past 2^46")
    assert plan["moduli"] > 0 and slice_bits() * plan["slices_x"] - 2 > 46, plan


def _tie_operands(case: str):
    """(x, w) fp32 whose exact products sit beside fp32 rounding ties, with the part that decides
    each tie more than 53 bits below the top: 18 x 21 outputs, so row blocks of eight end in
    partial ones. "subnormal": (A + 1/2) 2^-149 + t, t = +-2^-200 or 0, A = 1 .. 9 (x rows
    [A 2^-49, 2^-50, t 2^120], w rows [2^-100, 2^-100, 2^-120]: ties between subnormals). Others
    come from gen.fp32_pair_ties (tails 2^-56 and 2^-80 relative), both tail signs, negated and
    halved copies, scaled by 2^x_exp (x) and 2^w_exp (w)."""
    if case == "subnormal":
        rows = [[A * 2.0**-49, 2.0**-50, t * 2.0**120] for A in range(1, 10) for t in (2.0**-200, -(2.0**-200), 0.0)]
        x = torch.tensor(rows[:18], dtype=torch.float32)
        w = torch.tensor([[2.0**-100, 2.0**-100, 2.0**-120]] * 21, dtype=torch.float32)
        w[::2] *= torch.tensor([1.0, 1.0, -1.0])  # the tail's sign flips with the column
        return x, w
    x_exp, w_exp = {"normal": (0, 0), "smallest normals": (-63, -63), "overflow edge": (126, 0),
                    "wide scales": (-20, 30)}[case]
    xs, ws = zip(*(gen.fp32_pair_ties(0, tail) for tail in (1.0, -1.0)))
    x, w = torch.cat(xs), torch.cat(ws)
    x = torch.cat([x, -x, x * 0.5])  # 18 rows
    w = torch.cat([w, -w, w * 2.0, w[:3]])  # 21 rows
    return x * 2.0**x_exp, w * 2.0**w_exp


@pytest.mark.parametrize("case", ["normal", "smallest normals", "subnormal", "overflow edge", "wide scales"])
def test_crt_rounding_of_products_beside_ties(case):
    # The CPU's vector finish (csrc/cpu/crt_vector.h) rounds P to odd at 53 bits, then to fp32:
    # here what decides each tie lies past 53 bits below P's top, so a lost sticky bit or a double
    # rounding moves outputs. Ties at fp32 normals, at the smallest normals' and the subnormals'
    # ulp 2^-149, at the overflow edge 2^126 (2 - 2^-24), and with wide exponents E. Against the
    # plain-Python exact reference; no residues, no bias: every output takes the vector rounding.
    x, w = _tie_operands(case)
    want = R.gemm_rounded(x, w)
    with gemm_path("slices_crt"):
        got = det_gemm(x, w)
        plan = last_slices_plan()
    assert plan["moduli"] > 0 and plan["residues_x"] == plan["residues_w"] == 0, plan
    assert_bitwise(got, want, f"CRT route beside ties ({case})")
    # control: fp64 sums of the exact products rounded once more to fp32 miss some of these ties
    plain = (x.double() @ w.double().T).float()
    assert not torch.equal(plain.view(torch.int32), want.view(torch.int32))


def test_crt_rounding_where_the_low_64_bits_of_p_are_zero():
    # x rows [s 2^a, 2^(a-30), 0] (5 slices: window integers s 2^37, 2^7) and w rows
    # [2^b, 0, 2^(b-24)] (4 slices: 2^29, ...) give P = s 2^66 exactly for every output: a
    # negative P whose low 64 bits are all zero, where the vector finish's 128-bit negation must
    # carry into the high word. Outputs s 2^(a+b), against the exact reference.
    x = torch.tensor([[(-1.0) ** a * 2.0**a, 2.0 ** (a - 30), 0.0] for a in range(-3, 6)])
    w = torch.tensor([[2.0**b, 0.0, 2.0 ** (b - 24)] for b in range(-5, 6)])
    with gemm_path("slices_crt"):
        got = det_gemm(x, w)
        plan = last_slices_plan()
    assert plan["moduli"] > 0 and (plan["slices_x"], plan["slices_w"]) == (5, 4), plan
    assert_bitwise(got, R.gemm_rounded(x, w), "P = +-2^66")
    assert (got < 0).any() and (got > 0).any()


def test_crt_vector_form_unproven_lanes_take_the_scalar_form():
    # LIGHTNING_DET_CRT_VECTOR_UNPROVEN=1 (read once per process) marks every lane of the vector
    # reconstruction unproven, as real data would only within ~2^-40 M of the moduli's bound: each
    # output then comes from crt_value and the one-by-one finish. Rounded (with and without bias)
    # and digits, against this process's kernel.
    seeds = (63, 64, 65)
    x, w, b = fresh_operands("normal", seeds)
    with gemm_path("kernel"):
        want = (det_gemm(x, w), det_gemm(x, w, b), det_gemm_partial(x, w, b))
    got = fresh_process_gemm("slices_crt", {"LIGHTNING_DET_CRT_VECTOR_UNPROVEN": "1"}, seeds, "plan['moduli'] > 0",
                             op="(det_gemm(x, w), det_gemm(x, w, b), det_gemm_partial(x, w, b))")
    for what, g, ref in zip(("rounded", "rounded with bias"), got, want):
        assert_bitwise(g, ref, f"unproven lanes, {what}")
    assert torch.equal(got[2], want[2]), "unproven lanes: digits differ"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device, seeds", [("cpu", (58, 59)), pytest.param("cuda", (74, 75), marks=CUDA)])
def test_guessed_slice_counts_with_crt(device, seeds):
    # a fixed guess too small for some rows: they are zero rows in the remainder planes and their
    # outputs are recomputed exactly (exact_rows); the rest through the CRT route
    x = gen.normal((30, 200), torch.float32, seeds[0]).to(device)
    w = gen.normal((20, 200), torch.float32, seeds[1]).to(device)
    x[3, ::7] *= 2.0**-20
    with gemm_path("kernel"):
        want = det_gemm(x, w)
    with gemm_path("slices_crt"):
        got = det_gemm(x, w, plans=(3, 3))
        assert last_slices_plan()["moduli"] > 0
    assert_bitwise(got.cpu(), want.cpu(), f"{device} guessed (3, 3) with the CRT route")


def test_crt_route_with_seven_bit_digits():
    # machines without VNNI use 7-bit digits and remainders (moduli <= 128); run that branch in a
    # fresh process and compare with this process's kernel
    x, w, b = fresh_operands("normal", (60, 61, 62))
    with gemm_path("kernel"):
        want = det_gemm_partial(x, w, b)
    assert torch.equal(seven_bit_digits_gemm("slices_crt", (60, 61, 62), "plan['moduli'] > 0"), want)


@pytest.mark.parametrize("operands", ["normal", "wide"])
def test_cuda_kernels_crt_arithmetic_on_the_cpu(operands):
    # LIGHTNING_DET_CRT_SCALAR=1 (read once per process): the CPU's CRT way through crt.h's 32-bit
    # per-element and per-output forms (dp4a remainders of packed digits, 32-bit reductions,
    # crt_value), the arithmetic the CUDA kernels run, instead of its fp64 loops; so a CPU-only CI
    # checks that arithmetic too. "wide": rows of ~24 bits, 7 slices, window integers past 2^46.
    seeds = (66, 67, 68)
    x, w, b = fresh_operands(operands, seeds)
    with gemm_path("kernel"):
        want = det_gemm_partial(x, w, b)
    check = "plan['moduli'] > 0" + (" and plan['slices_x'] >= 7" if operands == "wide" else "")
    got = fresh_process_gemm("slices_crt", {"LIGHTNING_DET_CRT_SCALAR": "1"}, seeds, check, operands)
    assert torch.equal(got, want), f"CUDA's CRT arithmetic on the CPU, {operands} operands: digits differ"


def _cuda_cases():
    """(name, x, w, bias) CPU operands for the CUDA CRT route: normal fp32 and bf16, data at the
    bound, wide rows with NaN / inf / a zero row, a bias below the grid."""
    g = torch.Generator().manual_seed(65)
    wide_x = torch.randn(40, 96, generator=g) * torch.exp2(torch.randint(-30, 30, (40, 1), generator=g).float())
    wide_w = torch.randn(24, 96, generator=g) * torch.exp2(torch.randint(-6, 6, (24, 96), generator=g).float())
    wide_x[5, 7], wide_x[9], wide_w[6, 3] = float("nan"), 0.0, float("inf")
    bound_x, bound_w = torch.full((3, 4096), 1 + 2.0**-6), torch.full((2, 4096), -(2 - 2.0**-23))
    bound_x[1] = -bound_x[1]
    return [
        ("normal fp32", gen.normal((64, 700), torch.float32, 66), gen.normal((48, 700), torch.float32, 67),
         gen.normal((48,), torch.float32, 68)),
        ("normal bf16", gen.normal((64, 700), torch.bfloat16, 69), gen.normal((48, 700), torch.bfloat16, 70), None),
        ("at the bound", bound_x, bound_w, None),
        ("wide rows", wide_x, wide_w, gen.normal((24,), torch.float32, 71)),
        ("bias below the grid", gen.normal((16, 300), torch.float32, 72), gen.normal((12, 300), torch.float32, 73),
         torch.full((12,), 2.0**-120) * torch.arange(1, 13)),
    ]


@CUDA
@pytest.mark.parametrize("case", range(5))
def test_cuda_crt_route_matches_kernel_and_cpu(case):
    # the CUDA remainder planes and reconstruction (csrc/cuda/int_slices_cuda.cu with crt.h's
    # functions): the CUDA kernel's bytes and the CPU CRT route's, rounded and as digits
    name, x, w, b = _cuda_cases()[case]
    xc, wc = x.cuda(), w.cuda()
    bc = None if b is None else b.cuda()
    for od in SLICE_OUT_DTYPES:
        with gemm_path("slices_crt"):
            got = det_gemm(xc, wc, bc, out_dtype=od)
            assert last_slices_plan()["moduli"] > 0, f"{name}: {last_slices_plan()}"
            cpu = det_gemm(x, w, b, out_dtype=od)
        with gemm_path("kernel"):
            want = det_gemm(xc, wc, bc, out_dtype=od)
        assert_bitwise(got.cpu(), want.cpu(), f"cuda {name} -> {od}: crt vs kernel")
        assert_bitwise(got.cpu(), cpu, f"cuda {name} -> {od}: cuda crt vs cpu crt")
    with gemm_path("slices_crt"):
        got = det_gemm_partial(xc, wc, bc)
    with gemm_path("kernel"):
        assert torch.equal(got.cpu(), det_gemm_partial(xc, wc, bc).cpu()), f"cuda {name}: digits"
