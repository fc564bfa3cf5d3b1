"""One det_gemm call to look at under a profiler (Nsight Compute), after a warm-up call.

    ncu --clock-control none --kernel-name regex:gemm_kernel --launch-skip 1 --launch-count 1 \
        --set full -o gemm python3 benchmarks/tools/profile_gemm.py --n 4096 --dtype bf16

Not a benchmark (benchmarks/gemm.py is): it only makes the kernel run, on random normal data.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning_det.ops import det_gemm  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096, help="M = N = K")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--calls", type=int, default=2, help="det_gemm calls (the first one is the warm-up)")
    a = p.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.n, a.n, generator=g).to(dtype).cuda()
    w = torch.randn(a.n, a.n, generator=g).to(dtype).cuda()
    for _ in range(a.calls):
        det_gemm(x, w)
    torch.cuda.synchronize()
    print(f"det_gemm {a.dtype} {a.n}^3 x {a.calls} done")


if __name__ == "__main__":
    main()
