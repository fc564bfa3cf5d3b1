"""Builds and loads the CUDA kernels that run on the CPU under the emulation of
tests/csrc/cuda_emu.h (cached like the core; ninja rebuilds when a header they include changes):
tests/csrc/attention_emu.cpp as ``torch.ops.ldet_emu.*`` (the fused attention), and
tests/csrc/warp_sum_emu.cpp as ``torch.ops.ldet_warp_emu.*`` (the norms' warp row sums). Also the
host build of a host-and-device function that needs no emulation: tests/csrc/round_fmt_check.cpp
as ``torch.ops.ldet_round_check.*`` (the kernels' rounding into bf16/fp16)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from lightning_det._build import _build_lock

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, source: str) -> None:
    from torch.utils import cpp_extension

    key = hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]
    base = Path(os.environ.get("LIGHTNING_DET_BUILD_DIR") or Path.home() / ".cache" / "lightning_det")
    build = base / f"{name}-torch{torch.__version__.split('+')[0]}-{key}"
    build.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off as the core's build: every rounding is the one the source writes
    with _build_lock(build):  # as the core's: a killed build's leftover lock never hangs the next
        cpp_extension.load(name=name, sources=[str(ROOT / "tests" / "csrc" / source)],
                           extra_include_paths=[str(ROOT / "csrc"), str(ROOT / "tests" / "csrc")],
                           extra_cflags=["-O1", "-std=c++17", "-ffp-contract=off", "-fno-fast-math",
                                         "-Wno-unknown-pragmas"],
                           build_directory=str(build), is_python_module=False, verbose=False)


def load_attention_emu():
    """``torch.ops.ldet_emu`` after building the emulated attention kernels if needed."""
    _load("ldet_attention_emu", "attention_emu.cpp")
    return torch.ops.ldet_emu


def load_warp_sum_emu():
    """``torch.ops.ldet_warp_emu`` after building the emulated warp row sums if needed."""
    _load("ldet_warp_sum_emu", "warp_sum_emu.cpp")
    return torch.ops.ldet_warp_emu


def load_round_fmt_check():
    """``torch.ops.ldet_round_check`` after building round_double_fmt's host check if needed."""
    _load("ldet_round_fmt_check", "round_fmt_check.cpp")
    return torch.ops.ldet_round_check
