"""Exact long-accumulator ops (no Lightning import). See :mod:`lightning_det.ops.longacc`."""
from .distributed import det_all_reduce
from .linear import det_linear
from .longacc import (
    LongAcc,
    det_combine,
    det_finalize,
    det_gemm,
    det_gemm_partial,
    det_normalize,
    gemm_path,
    last_fp64_counts,
    last_slices_plan,
    scatter_sum_digits,
    to_digits,
)

__all__ = [
    "LongAcc",
    "det_gemm",
    "det_gemm_partial",
    "det_linear",
    "det_combine",
    "det_finalize",
    "det_normalize",
    "det_all_reduce",
    "gemm_path",
    "last_fp64_counts",
    "last_slices_plan",
    "scatter_sum_digits",
    "to_digits",
]
