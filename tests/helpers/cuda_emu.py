"""Builds and loads tests/csrc/attention_emu.cpp: the CUDA attention kernels run on the CPU under
the emulation of tests/csrc/cuda_emu.h, as ``torch.ops.ldet_emu.*`` (cached like the core)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tests" / "csrc" / "attention_emu.cpp"]
HEADERS = [ROOT / "tests" / "csrc" / "cuda_emu.h", ROOT / "csrc" / "cuda" / "attention_kernels.cuh",
           ROOT / "csrc" / "attention.h", ROOT / "csrc" / "attention_checks.h"]


def load_attention_emu():
    """``torch.ops.ldet_emu`` after building the emulated kernels if needed."""
    from torch.utils import cpp_extension

    key = hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]
    base = Path(os.environ.get("LIGHTNING_DET_BUILD_DIR") or Path.home() / ".cache" / "lightning_det")
    build = base / f"emu-torch{torch.__version__.split('+')[0]}-{key}"
    build.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off as the core's build: every rounding is the one the source writes
    cpp_extension.load(name="ldet_attention_emu", sources=[str(s) for s in SOURCES],
                       extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "tests" / "csrc")],
                       extra_cflags=["-O1", "-std=c++17", "-ffp-contract=off", "-fno-fast-math",
                                     "-Wno-unknown-pragmas"],
                       build_directory=str(build), is_python_module=False, verbose=False)
    return torch.ops.ldet_emu
