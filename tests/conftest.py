import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gen

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Keep the 2-core CI machine predictable; tests that care about thread counts set their own.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent GPU machine)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, so NaN compares equal to NaN."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[t.dtype]
    return t.contiguous().view(view)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """torch.equal on bit patterns; on failure print the mismatching elements (Liger style)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ba, bb = bits(a.cpu()), bits(b.cpu())
    if not torch.equal(ba, bb):
        idx = (ba != bb).nonzero()[:10]
        rows = [f"  at {tuple(i.tolist())}: {a.cpu()[tuple(i)].item()!r} vs {b.cpu()[tuple(i)].item()!r}" for i in idx]
        n = int((ba != bb).sum())
        raise AssertionError(f"{what}: {n} of {a.numel()} elements differ\n" + "\n".join(rows))


def assert_bitwise_nans(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """NaN at the same places, every other element bit for bit (a NaN's payload is not compared)."""
    na, nb = a.isnan(), b.isnan()
    assert torch.equal(na.cpu(), nb.cpu()), f"{what}: NaN at {na.nonzero().tolist()} against {nb.nonzero().tolist()}"
    assert_bitwise(a[~na], b[~nb], what)



SLICE_OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def at_thread_counts(fn, counts=(1, 2)) -> list:
    """``fn()`` run once with each intra-op thread count, the caller's count restored after."""
    before = torch.get_num_threads()
    try:
        out = []
        for n in counts:
            torch.set_num_threads(n)
            out.append(fn())
        return out
    finally:
        torch.set_num_threads(before)


def both_paths(fn, slices="slices"):
    """fn() under gemm_path("kernel") and under gemm_path(slices): (kernel's, slices')."""
    from lightning_det.ops import gemm_path

    with gemm_path("kernel"):
        ref = fn()
    with gemm_path(slices):
        got = fn()
    return ref, got


def assert_same_everywhere(x, w, bias=None, what="") -> dict:
    """det_gemm (every output dtype) and det_gemm_partial through the slices with each way of
    forming their products (one GEMM per diagonal of slice pairs; one per CRT modulus where the
    device has it and the moduli cover the products), and det_gemm through the fp64 route, give
    the kernel's bytes. Returns the last CRT call's last_slices_plan()."""
    from lightning_det.ops import det_gemm, det_gemm_partial, last_slices_plan

    for route in ("slices_diagonals", "slices_crt"):
        for od in SLICE_OUT_DTYPES:
            ref, got = both_paths(lambda: det_gemm(x, w, bias, out_dtype=od), route)
            assert_bitwise(got, ref, f"{what} det_gemm out {od}: {route} vs kernel")
        ref, got = both_paths(lambda: det_gemm_partial(x, w, bias), route)
        plan = last_slices_plan()
        assert torch.equal(got, ref), f"{what} det_gemm_partial: {route} digits differ from the kernel's"
    for od in SLICE_OUT_DTYPES:  # the fp64 route (rounded outputs only: csrc/fp64_bound.h)
        ref, got = both_paths(lambda: det_gemm(x, w, bias, out_dtype=od), "fp64")
        assert_bitwise(got, ref, f"{what} det_gemm out {od}: fp64 route vs kernel")
    return plan


FRESH_OPERANDS = {  # fresh_process_gemm's x and w: a gen call with the shape and the seed to fill in
    "normal": "gen.normal({}, torch.float32, {})",
    "wide": "gen.wide_exponents({}, -12, 12, torch.float32, {})",  # rows of ~24 bits: 7 slices of 8
}


def fresh_operands(kind: str, seeds):
    """fresh_process_gemm's (x, w, b) in this process (the same expressions, evaluated here)."""
    sx, sw, sb = seeds
    names = {"gen": gen, "torch": torch}
    x, w = (eval(FRESH_OPERANDS[kind].format(shape, seed), names) for shape, seed in (((30, 200), sx), ((20, 200), sw)))
    return x, w, gen.normal((20,), torch.float32, sb)


def fresh_process_gemm(route: str, env: dict, seeds=(12, 13, 14), check_plan: str = "True",
                       operands: str = "normal", op: str = "det_gemm_partial(x, w, b)") -> torch.Tensor:
    """`op` (by default det_gemm_partial(x, w, b)) of fresh_operands(operands, seeds) (30 x 200,
    20 x 200, bias 20) under gemm_path(route), computed in a fresh process with `env` added: for
    settings the CPU backend reads once per process. check_plan: a Python expression on `plan`
    (last_slices_plan()) the child asserts."""
    sx, sw, sb = seeds
    make = FRESH_OPERANDS[operands]
    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); import gen\n"
        "from lightning_det.ops import det_gemm, det_gemm_partial, gemm_path, last_slices_plan\n"
        f"x, w = {make.format((30, 200), sx)}, {make.format((20, 200), sw)}\n"
        f"b = gen.normal((20,), torch.float32, {sb})\n"
        f"with gemm_path({route!r}):\n    out = {op}\n    plan = last_slices_plan()\n"
        f"assert {check_plan}, plan\n"
        "torch.save(out, sys.argv[1])\n"
    )
    tag = "".join(ch if ch.isalnum() else "_" for ch in op)
    out = REPO / "build" / f"fresh_process_{route}_{operands}_{'_'.join(sorted(env))}_{tag}.pt"
    out.parent.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                   check=True, timeout=600)
    return torch.load(out)


def seven_bit_digits_gemm(route: str, seeds=(12, 13, 14), check_plan: str = "True") -> torch.Tensor:
    """fresh_process_gemm with LIGHTNING_DET_SLICE_BITS=7: the 7-bit digits of machines without
    VNNI, whose CPU backend is chosen once per process."""
    return fresh_process_gemm(route, {"LIGHTNING_DET_SLICE_BITS": "7"}, seeds, check_plan)


def clean_env(**extra) -> dict:
    """A minimal environment for child processes: no inherited torch/Lightning/pytest state."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "LIGHTNING_DET_BUILD_DIR",
                                      "LIGHTNING_DET_NO_CUDA") if k in os.environ}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update(extra)
    return env


def env_with_mpi() -> dict:
    """clean_env plus the OpenMPI/PMIx settings of the environment: Lightning imports mpi4py when
    it is installed (the GPU machine's image has it), and MPI_Init fails in a child without
    them."""
    env = clean_env()
    env.update({k: v for k, v in os.environ.items()
                if k.startswith(("OMPI_", "PMIX_", "OPAL_", "PRTE_")) or k == "LD_LIBRARY_PATH"})
    return env


def rerun_in_fresh_process(request, **env) -> bool:
    """For a test whose environment knobs the core reads once per process (GemmEnv: at its first
    GEMM): True in the test's own process, after the test ran again in a child pytest process with
    these variables set, and passed there; False in that child, which then runs the test's body."""
    node = request.node.nodeid
    if os.environ.get("LDET_FRESH_PROCESS_TEST") == node:
        return False
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node], cwd=REPO,
                          env=dict(os.environ, LDET_FRESH_PROCESS_TEST=node, **env), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{node} with {env}, in a fresh process:\n{proc.stdout[-5000:]}\n{proc.stderr[-2000:]}"
    return True


def run_cmd(args: list, timeout: float = 180, check: bool = True, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=REPO, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def _build_core():
    # Build once up front, so a first-time JIT build is not charged to whichever test runs first
    # (and child processes find the cache).
    from lightning_det import _build

    _build.load()
