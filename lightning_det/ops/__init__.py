"""The ops layer: the only code that calls the compiled ``ldet`` kernels (no Lightning import).

- :mod:`.longacc`: exact GEMMs and LongAcc digit arithmetic (the public ops below);
- :mod:`.sums`: exact row/column sums of products as digits;
- :mod:`.distributed`: the exact digit all-reduce;
- kernels behind nn, optim and digest, each file one job: :mod:`.activation`, :mod:`.norm`,
  :mod:`.cross_entropy`, :mod:`.optim`, :mod:`.digest`;
- :mod:`._registry`: loading the core, every fake and autograd registration of the ldet ops.
"""
from .distributed import det_all_reduce
from .linear import det_linear
from .longacc import (
    GemmPlan,
    LongAcc,
    det_combine,
    det_finalize,
    det_bmm,
    det_gemm,
    det_gemm_partial,
    det_normalize,
    explain_gemm,
    gemm_path,
    last_fp64_counts,
    last_gemm_plan,
    last_slices_plan,
    plan_gemm,
    scatter_sum_digits,
    to_digits,
)
from .sums import det_col_sums, det_row_sums

__all__ = [
    "LongAcc",
    "det_bmm",
    "det_gemm",
    "det_gemm_partial",
    "det_linear",
    "det_combine",
    "det_finalize",
    "det_normalize",
    "det_row_sums",
    "det_col_sums",
    "det_all_reduce",
    "explain_gemm",
    "GemmPlan",
    "gemm_path",
    "last_fp64_counts",
    "last_gemm_plan",
    "last_slices_plan",
    "plan_gemm",
    "scatter_sum_digits",
    "to_digits",
]
