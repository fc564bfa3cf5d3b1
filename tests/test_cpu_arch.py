"""The CPU kernels give the same bytes whatever instructions the build targets.

With AVX-512 the CPU build runs vector forms of the slices' row statistics, CRT remainders and
combine (csrc/cpu/*_vector.h); without it (an AVX2 machine) the scalar and auto-vectorized loops.
Here a child process builds the core for x86-64-v3 (AVX2, no AVX-512; LIGHTNING_DET_MARCH, its
own cache folder) and computes tests/helpers/arch_cases.py's results, which must equal this
process's (native build) byte for byte; each native result is also checked against the kernel's.
"""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_bitwise

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
import arch_cases  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 -march targets")
def test_avx2_build_gives_the_native_builds_bytes(tmp_path):
    out = tmp_path / "avx2.pt"
    code = (
        "import sys, torch; sys.path[:0] = ['tests', 'tests/helpers']\n"
        "import arch_cases\n"
        "torch.save(arch_cases.results(), sys.argv[1])\n"
    )
    env = dict(os.environ, LIGHTNING_DET_MARCH="x86-64-v3", LIGHTNING_DET_NO_CUDA="1", OMP_NUM_THREADS="2")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=env, check=True, timeout=1200)
    theirs = torch.load(out)
    ours = arch_cases.results()
    assert sorted(theirs) == sorted(ours)
    for key in ours:
        a, b = ours[key], theirs[key]
        if a.dtype == torch.int64:  # digits
            assert torch.equal(a, b), f"{key}: digits differ between the native and the x86-64-v3 build"
        else:
            assert_bitwise(b, a, f"{key}: x86-64-v3 build vs native")
    # and within this process every route gave the kernel's bytes (the cases are not vacuous)
    for name, *_ in arch_cases.operands():
        for route in ("slices_diagonals", "slices_crt", "auto"):
            for od in ("torch.float32", "torch.bfloat16"):
                assert_bitwise(ours[f"{name} {route} {od}"], ours[f"{name} kernel {od}"], f"{name} {route} {od}")
            assert torch.equal(ours[f"{name} {route} digits"], ours[f"{name} kernel digits"]), f"{name} {route}"
