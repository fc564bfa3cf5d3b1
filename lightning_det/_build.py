"""Builds and loads the compiled numeric core (``csrc/``) on first use.

Build policy: JIT on first use, cached. The first op call compiles ``csrc/`` with
``torch.utils.cpp_extension.load`` (ninja) into a cache folder; later processes reuse the
cached library unless a source or flag changed. Processes building one folder take turns under
an OS file lock, which a killed build releases (torch's own lock file it would leave behind is
removed then). The CPU kernels are always built; the CUDA kernels are added where torch has
CUDA and ``nvcc`` is found.

The library registers its ops under ``torch.ops.ldet``. If it cannot be built or loaded we
raise :class:`ExtensionError` with the reason and the fix: there is no pure-Python fallback,
because a fallback would silently give arithmetic outside the contract.

Environment:
  LIGHTNING_DET_BUILD_DIR      cache folder (default ~/.cache/lightning_det/<key>)
  LIGHTNING_DET_VERBOSE_BUILD  set to 1 to print the compiler's output
  LIGHTNING_DET_NO_CUDA        set to 1 to build the CPU kernels only
  LIGHTNING_DET_MARCH          the -march of the CPU kernels (default: native). x86-64-v3 builds
                               them without AVX-512, as a machine without it runs them (the same
                               bytes: tests/test_cpu_arch.py); its own cache folder
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

__all__ = ["ExtensionError", "load", "on_load", "csrc_dir", "cuda_built"]

_lock = threading.Lock()
_loaded = False
_cuda_built = False
_on_load_hooks: list = []


class ExtensionError(RuntimeError):
    """The compiled core of lightning_det could not be built or loaded."""


def csrc_dir() -> Path:
    """The ``csrc/`` folder: beside the package in a source checkout (``pip install -e .``)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "csrc", here / "_csrc"):
        if (cand / "longacc.h").is_file():
            return cand
    raise ExtensionError(
        "lightning_det cannot find its C++/CUDA sources (csrc/longacc.h). It is meant to be "
        "installed from a source checkout with `pip install -e .`, which keeps csrc/ beside "
        f"the package; looked in {here.parent / 'csrc'} and {here / '_csrc'}."
    )


def _want_cuda() -> bool:
    if os.environ.get("LIGHTNING_DET_NO_CUDA") == "1" or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None


def _sources(src: Path, with_cuda: bool) -> list[str]:
    files = sorted(src.glob("schema/*.cpp")) + sorted(src.glob("cpu/*.cpp"))
    if with_cuda:
        files += sorted(src.glob("cuda/*.cu"))
    return [str(f) for f in files]


def _build_dir(src: Path, with_cuda: bool) -> Path:
    root = os.environ.get("LIGHTNING_DET_BUILD_DIR")
    flavour = f"cu{torch.version.cuda}" if with_cuda else "cpu"
    # Keyed by checkout path too, so two checkouts (worktrees) never overwrite each other.
    key = hashlib.sha1(str(src).encode()).hexdigest()[:10]
    base = Path(root) if root else Path.home() / ".cache" / "lightning_det"
    march = os.environ.get("LIGHTNING_DET_MARCH", "native")
    d = base / (f"torch{torch.__version__.split('+')[0]}-{flavour}-{key}" + ("" if march == "native" else f"-{march}"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cuda_arch_flags() -> list[str]:
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or not torch.cuda.is_available():
        return []  # torch's own defaults, or the user's list
    flags = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
    return sorted(set(flags))


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """One build of a folder at a time across processes, by an OS lock that a killed process
    releases. torch's own lock is a file (`lock`) it deletes when done: a build killed midway
    leaves it behind, and every later load of that folder then waits for it forever. Holding this
    lock, any such file is a leftover, and it is removed."""
    try:
        import fcntl
    except ImportError:  # no POSIX file locks: torch's lock alone
        yield
        return
    with open(build_dir / "ldet-build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load() -> None:
    """Build (if needed) and load the compiled core. Safe to call many times."""
    global _loaded, _cuda_built
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        src = csrc_dir()
        with_cuda = _want_cuda()
        from torch.utils import cpp_extension

        # -ffp-contract=off / -fmad=false: no compiler-chosen FMA contraction, so every
        # rounding step is the one written in the source, identical on CPU and GPU.
        # -fno-math-errno: sqrtf's errno branch otherwise blocks loop vectorization; results
        # are unchanged (sqrt stays the IEEE correctly rounded one, only errno is not set).
        march = os.environ.get("LIGHTNING_DET_MARCH", "native")
        cflags = ["-O3", f"-march={march}", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno"]
        cuda_flags = ["-O3", "-fmad=false", "--expt-relaxed-constexpr", "-lineinfo"]
        if with_cuda:
            cflags.append("-DLDET_WITH_CUDA")
            cuda_flags += ["-DLDET_WITH_CUDA"] + _cuda_arch_flags()
        name = "lightning_det_cuda" if with_cuda else "lightning_det_cpu"
        verbose = os.environ.get("LIGHTNING_DET_VERBOSE_BUILD") == "1"
        build_dir = _build_dir(src, with_cuda)
        try:
            with _build_lock(build_dir):
                cpp_extension.load(
                    name=name,
                    sources=_sources(src, with_cuda),
                    extra_include_paths=[str(src)],
                    extra_cflags=cflags,
                    extra_cuda_cflags=cuda_flags,
                    # cuBLASLt: the integer-slice GEMMs call it directly (csrc/cuda/int8_gemm_lt.cu)
                    extra_ldflags=["-fopenmp"] + (["-lcublasLt"] if with_cuda else []),
                    build_directory=str(build_dir),
                    is_python_module=False,
                    with_cuda=with_cuda,
                    verbose=verbose,
                )
        except Exception as exc:  # noqa: BLE001 - re-raised with the fix attached
            msg = str(exc).strip().splitlines()
            tail = "\n".join(msg[-25:])
            raise ExtensionError(
                f"lightning_det could not build or load its compiled core ({name}).\n"
                f"Reason: {type(exc).__name__}: {tail}\n"
                f"Sources: {src}\nBuild folder: {build_dir}\n"
                "What to do: install a C++17 compiler (`apt-get install g++`) and ninja "
                "(`pip install ninja`); for the CUDA kernels, nvcc matching torch's CUDA. "
                "Set LIGHTNING_DET_VERBOSE_BUILD=1 to see the compiler output, or delete the "
                "build folder to force a clean rebuild. There is no pure-Python fallback: "
                "it would break the bitwise contract."
            ) from exc
        _cuda_built = with_cuda
        _loaded = True
    # Python-side registrations (fake tensors, autograd) need the C++ schemas to exist.
    for hook in list(_on_load_hooks):
        hook()


def on_load(hook) -> None:
    """Run ``hook()`` once the core is loaded (now, if it already is).

    The ops registry (:mod:`lightning_det.ops._registry`) uses this for its ``register_fake`` /
    ``register_autograd`` calls, so that importing lightning_det never triggers a build.
    """
    if _loaded:
        hook()
    else:
        _on_load_hooks.append(hook)


def cuda_built() -> bool:
    """True when the loaded core contains the CUDA kernels."""
    load()
    return _cuda_built


if __name__ == "__main__":  # `python -m lightning_det._build` pre-builds the cache
    load()
    print(f"lightning_det core loaded (cuda={_cuda_built})", file=sys.stderr)
