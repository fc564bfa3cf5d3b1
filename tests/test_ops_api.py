"""Op registration (opcheck), argument checking, empty and non-contiguous inputs."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_bitwise

import gen
from lightning_det import _build
from lightning_det.ops import det_all_reduce, det_combine, det_finalize, det_gemm, det_gemm_partial, to_digits


def test_opcheck():
    _build.load()
    x, w, b = gen.normal((5, 33), seed=1), gen.normal((4, 33), seed=2), gen.normal((4,), seed=3)
    torch.library.opcheck(torch.ops.ldet.gemm_partial.default, (x, w, b, 0))
    torch.library.opcheck(torch.ops.ldet.gemm.default, (x, w, b, torch.float32))
    torch.library.opcheck(torch.ops.ldet.gemm.default, (x, w, None, torch.bfloat16))
    acc = det_gemm_partial(x, w)
    torch.library.opcheck(torch.ops.ldet.normalize.default, (acc,))
    torch.library.opcheck(torch.ops.ldet.finalize.default, (acc, torch.bfloat16))
    torch.library.opcheck(torch.ops.ldet.to_digits.default, (x,))
    # autograd through the registered op: gradients are themselves exact, rounded once
    xr, wr, br = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    torch.library.opcheck(torch.ops.ldet.gemm.default, (xr, wr, br, torch.float32))


def test_det_gemm_is_differentiable():
    x = gen.normal((6, 20), seed=4).requires_grad_()
    w = gen.normal((3, 20), seed=5).requires_grad_()
    det_gemm(x, w).sum().backward()
    ref_x = torch.ones(6, 3, dtype=torch.float64) @ w.detach().double()
    ref_w = torch.ones(6, 3, dtype=torch.float64).T @ x.detach().double()
    assert torch.allclose(x.grad.double(), ref_x, rtol=1e-6) and torch.allclose(w.grad.double(), ref_w, rtol=1e-6)


@pytest.mark.parametrize("M,N,K", [(0, 4, 8), (3, 0, 8), (3, 4, 0), (0, 0, 0)])
def test_empty_dimensions(M, N, K):
    x, w = torch.randn(M, K), torch.randn(N, K)
    y = det_gemm(x, w)
    assert y.shape == (M, N) and torch.equal(y, torch.zeros(M, N))
    acc = det_gemm_partial(x, w)
    assert acc.shape == (M, N, 19) and not acc.any()
    b = torch.randn(N)
    assert_bitwise(det_gemm(x, w, b), b.expand(M, N).contiguous(), "K=0 with bias gives the bias")


def test_non_contiguous_inputs():
    base_x, base_w = gen.normal((40, 70), seed=6), gen.normal((50, 90), seed=7)
    x = base_x[::2, 5:69]  # strided rows, offset columns
    w = base_w.T[10:74, ::3].T.contiguous().T.T  # a transposed view
    w = base_w[1:40:3, 3:67]
    assert not x.is_contiguous() and not w.is_contiguous()
    assert_bitwise(det_gemm(x, w), det_gemm(x.contiguous(), w.contiguous()), "strided")
    xt = gen.normal((64, 12), seed=8).T  # (12, 64) column-major
    assert_bitwise(det_gemm(xt, w), det_gemm(xt.contiguous(), w.contiguous()), "transposed")


def test_mixed_input_dtypes_are_exact():
    x, w = gen.normal((4, 30), torch.bfloat16, 9), gen.normal((5, 30), torch.float32, 10)
    assert_bitwise(det_gemm(x, w), det_gemm(x.float(), w), "bf16 x fp32 == fp32 x fp32 on the same values")


def test_bad_input_errors_name_the_argument():
    x, w = torch.randn(4, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"^w: expected K = 8"):
        det_gemm(x, torch.randn(3, 9))
    with pytest.raises(ValueError, match=r"^w: expected a 2-D"):
        det_gemm(x, torch.randn(3, 8, 1))
    with pytest.raises(TypeError, match=r"^x: expected dtype float32, bfloat16 or float16, got torch.float64"):
        det_gemm(x.double(), w)
    with pytest.raises(TypeError, match=r"^w: expected dtype .* got torch.int32"):
        det_gemm(x, w.int())
    with pytest.raises(ValueError, match=r"^bias: expected shape \(3,\)"):
        det_gemm(x, w, torch.randn(4))
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor"):
        det_gemm([[1.0]], w)
    with pytest.raises(ValueError, match=r"^x: expected shape \(\.\.\., K\)"):
        det_gemm(torch.tensor(1.0), w)
    with pytest.raises(TypeError, match=r"^acc: expected a LongAcc of dtype torch.int64"):
        det_finalize(torch.zeros(3, 19, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^acc: expected a LongAcc with a trailing dimension of 19"):
        det_finalize(torch.zeros(3, 18, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"^dtype: expected"):
        det_finalize(torch.zeros(3, 19, dtype=torch.int64), torch.float64)
    with pytest.raises(ValueError, match=r"^accs\[1\]: expected shape"):
        det_combine([torch.zeros(2, 19, dtype=torch.int64), torch.zeros(3, 19, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"^accs: expected at least one"):
        det_combine([])
    with pytest.raises(TypeError, match=r"^out_dtype: expected"):
        det_gemm(x, w, out_dtype=torch.float64)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^w: expected device"):
            det_gemm(x, w.cuda())


def test_all_reduce_without_process_group_is_identity():
    acc = to_digits(gen.normal((7,), seed=11))
    assert torch.equal(det_all_reduce(acc), acc)


def test_extension_error_is_clear(monkeypatch, tmp_path):
    # A broken build must raise ExtensionError naming the cause and the fix, not crash deep inside.
    monkeypatch.setattr(_build, "_loaded", False)
    monkeypatch.setattr(_build, "csrc_dir", lambda: tmp_path)
    (tmp_path / "schema").mkdir()
    (tmp_path / "schema" / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setenv("LIGHTNING_DET_BUILD_DIR", str(tmp_path / "build"))
    monkeypatch.setenv("LIGHTNING_DET_NO_CUDA", "1")
    with pytest.raises(_build.ExtensionError, match="(?s)could not build or load .*What to do: install a C\\+\\+17 compiler"):
        _build.load()


LEFTOVER_LOCK_LOAD = """
import sys
from pathlib import Path
from lightning_det import _build
src = Path(sys.argv[1])
_build.csrc_dir = lambda: src
_build._on_load_hooks.clear()  # the tiny library registers none of the ops
(_build._build_dir(src, False) / "lock").touch()  # torch's lock file, left by a killed build
_build.load()
print("loaded")
"""


def test_a_killed_builds_leftover_lock_does_not_hang_the_next_load(tmp_path):
    # torch's build lock is a file it deletes when done; a build killed midway left it behind and
    # every later load of that folder waited for it forever. The load holds an OS lock (released
    # by a killed process) and removes the leftover. A tiny source stands in for csrc/.
    (tmp_path / "src" / "schema").mkdir(parents=True)
    (tmp_path / "src" / "schema" / "tiny.cpp").write_text("int ldet_tiny() { return 1; }\n")
    env = dict(os.environ, LIGHTNING_DET_BUILD_DIR=str(tmp_path / "build"), LIGHTNING_DET_NO_CUDA="1")
    out = subprocess.run([sys.executable, "-c", LEFTOVER_LOCK_LOAD, str(tmp_path / "src")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "loaded", out.stderr[-3000:]
