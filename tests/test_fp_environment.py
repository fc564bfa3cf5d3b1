"""The CPU kernels' bytes do not depend on the caller's floating-point mode.

torch.set_flush_denormal(True) sets flush-to-zero and denormals-are-zero for the calling thread
(x86 MXCSR): every SSE/AVX instruction then reads subnormal inputs as zero and writes subnormal
results as zero. The GPU has no such mode, so a CPU result computed under it would part from the
CUDA one, and from the exact reference, on subnormal data. Each CPU kernel runs its arithmetic
under the IEEE default environment (csrc/cpu/fp_env.h); here each op runs on subnormal data with
the mode off and on and must give the same bytes, and the same as the exact reference where one
exists. The control: torch's own arithmetic under the mode does flush.
"""
import pytest
import torch
from conftest import assert_bitwise

import gen
from lightning_det.nn.functional import det_col_sums, det_exp, det_gelu, det_row_sums, det_silu
from lightning_det.ops import det_finalize, det_gemm, det_gemm_partial, gemm_path, to_digits
from lightning_det.optim import AdamWSR
from lightning_det.reference import longacc_ref as R


@pytest.fixture
def flush_denormal():
    """Turns the mode on for the test's thread (asserting this CPU has it), off afterwards."""
    assert torch.set_flush_denormal(True), "this x86 CPU should support flush-denormal"
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _operands():
    # products near 2^-140 and subnormal inputs: results in and around the fp32 subnormal range
    x = gen.normal((24, 96), torch.float32, 90) * 2.0**-70
    w = gen.normal((20, 96), torch.float32, 91) * 2.0**-70
    x[0, :8] = 2.0**-140 * torch.arange(1, 9)  # subnormal inputs
    w[3, 5] = -(2.0**-149)
    return x, w


@pytest.mark.parametrize("route", ["kernel", "slices_diagonals", "slices_crt"])
def test_gemm_bytes_do_not_depend_on_flush_to_zero(route, request):
    x, w = _operands()
    want = R.gemm_rounded(x, w)
    with gemm_path(route):
        plain = det_gemm(x, w)
        digits = det_gemm_partial(x, w)
    assert_bitwise(plain, want, f"{route}, IEEE mode")
    request.getfixturevalue("flush_denormal")
    with gemm_path(route):
        assert_bitwise(det_gemm(x, w), want, f"{route} under flush-denormal")
        assert torch.equal(det_gemm_partial(x, w), digits), f"{route} under flush-denormal: digits differ"


def test_elementwise_and_digit_ops_do_not_depend_on_flush_to_zero(request):
    x, w = _operands()
    tiny = torch.cat([x.flatten(), torch.tensor([2.0**-149, -(2.0**-130), 1e-39])])
    # every input made here, before the mode is on (torch's own ops would flush them)
    big, low, w0 = tiny * 2.0**60, torch.full((8,), -100.0) - torch.arange(8.0), w[:1].expand(24, 96).contiguous()
    ops = {
        "to_digits/det_finalize": lambda: det_finalize(to_digits(tiny)),
        "det_finalize scaled": lambda: det_finalize(to_digits(big), scale_exp=-60),
        "det_gelu": lambda: det_gelu(big),
        "det_silu": lambda: det_silu(tiny),
        "det_exp": lambda: det_exp(low),  # results below 2^-126
        "det_row_sums": lambda: det_finalize(det_row_sums(x, w0)),
        "det_col_sums": lambda: det_finalize(det_col_sums(x)),
    }
    ieee = {name: fn() for name, fn in ops.items()}
    assert torch.equal(ieee["to_digits/det_finalize"].view(torch.int32), tiny.view(torch.int32))
    request.getfixturevalue("flush_denormal")
    # control: torch's own arithmetic flushes now (a subnormal times one reads as zero)
    assert torch.equal(tiny * 1.0 == 0, (tiny.abs() < 2.0**-126))
    for name, fn in ops.items():
        got = fn()
        assert_bitwise(got, ieee[name], f"{name} under flush-denormal")


def test_adamw_sr_step_does_not_depend_on_flush_to_zero(request):
    p0 = (gen.normal((64,), torch.float32, 92) * 2.0**-120).to(torch.bfloat16)
    grads = [(gen.normal((64,), torch.float32, 93 + step) * 2.0**-130).to(torch.bfloat16) for step in range(3)]

    def run():  # inputs made above, before the mode is on
        p = torch.nn.Parameter(p0.clone())
        opt = AdamWSR([p], lr=2.0**-125, weight_decay=0.0, seed=3)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        return p.detach().clone(), opt.state[p]["exp_avg"].clone()
    want = run()
    request.getfixturevalue("flush_denormal")
    got = run()
    assert_bitwise(got[0], want[0], "AdamWSR weights under flush-denormal")
    assert_bitwise(got[1], want[1], "AdamWSR exp_avg under flush-denormal")
