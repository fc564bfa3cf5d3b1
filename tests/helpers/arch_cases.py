"""The CPU computations tests/test_cpu_arch.py runs twice, in processes whose core was built for
different -march targets (LIGHTNING_DET_MARCH): each result keyed by a name, in a dict that
torch.save can write. Every exact route, output dtype and the digits, on data that takes the
vector forms' every branch where the build has AVX-512 (csrc/cpu/*_vector.h): residues in x and w,
a bias, ties past 53 bits, subnormal and overflowing outputs, wide rows (7 slices), NaN rows."""
import torch

import gen
from lightning_det.nn.functional import det_col_sums, det_gelu, det_row_sums
from lightning_det.ops import det_finalize, det_gemm, det_gemm_partial, gemm_path, to_digits


def operands():
    """(name, x, w, bias) fp32 / bf16 CPU operands."""
    x, w = gen.normal((64, 700), torch.float32, 100), gen.normal((48, 700), torch.float32, 101)
    ties_x, ties_w = gen.fp32_pair_ties(0, 1.0)
    sub_x, sub_w = gen.fp32_pair_ties(0, -1.0)
    wide_x = gen.wide_exponents((40, 96), -12, 12, torch.float32, 102)
    wide_w = gen.wide_exponents((24, 96), -12, 12, torch.float32, 103)
    wide_x[5, 7] = float("nan")
    return [
        ("normal fp32 + bias", x, w, gen.normal((48,), torch.float32, 104)),
        ("normal bf16", x.bfloat16(), w.bfloat16(), None),
        ("normal fp16 + subnormals", torch.cat([x[:32].half(), (x[32:] * 2.0**-16).half()]), w.half(), None),
        ("ties", torch.cat([ties_x, -ties_x]), torch.cat([ties_w, ties_w * 0.5]), None),
        ("subnormal ties", sub_x * 2.0**-63, sub_w * 2.0**-63, None),
        ("overflow edge", ties_x * 2.0**126, ties_w, None),
        ("wide rows, NaN", wide_x, wide_w, gen.normal((24,), torch.float32, 105)),
    ]


def results() -> dict:
    out = {}
    for name, x, w, b in operands():
        for route in ("kernel", "slices_diagonals", "slices_crt", "auto"):
            with gemm_path(route):
                for od in (torch.float32, torch.bfloat16):
                    out[f"{name} {route} {od}"] = det_gemm(x, w, b, out_dtype=od)
                out[f"{name} {route} digits"] = det_gemm_partial(x, w, b)
    a = gen.normal((33, 77), torch.float32, 106)
    out["row sums"] = det_finalize(det_row_sums(a))
    out["col sums"] = det_finalize(det_col_sums(a))
    out["gelu"] = det_gelu(a * 4)
    # The erf-GELU's fp64 values before rounding (the AVX-512 form, csrc/cpu/detmath_vector.h, where
    # the build has it): both branches of norm_cdf in one vector of eight, -0, NaN, the far tails.
    v = torch.cat([torch.linspace(-9.0, 9.0, 2001, dtype=torch.float64), (a * 3).double().flatten(),
                   torch.tensor([0.0, -0.0, float("nan"), 60.0, -60.0, 4.2426, -4.2427], dtype=torch.float64)])
    out["gelu fp64"] = torch.ops.ldet.act_fp64(v, 0)
    out["gelu grad fp64"] = torch.ops.ldet.act_fp64(v, 0, torch.linspace(-2.0, 2.0, v.numel(), dtype=torch.float64))
    out["to_digits"] = to_digits(a * 2.0**-120)
    return out
