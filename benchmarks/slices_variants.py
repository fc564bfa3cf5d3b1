"""Which int8 GEMM setup is fastest for the slice route: column views vs contiguous copies, and the
cap on the int32 diagonals (MiB), at 4096^3, fp32 and bf16 random normal data. Each variant's
output is checked against the long-accumulator kernel's (same bits or it fails).

    python3 benchmarks/slices_variants.py --out OUT.json      # CUDA
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import time_fn, write  # noqa: E402

from lightning_det.ops import det_gemm, gemm_path  # noqa: E402

VARIANTS = [("views", "0", "256"), ("contiguous", "1", "256"), ("views", "0", "4096"), ("contiguous", "1", "4096")]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    n, rows = args.n, []
    g = torch.Generator().manual_seed(1)
    x32, w32 = torch.randn(n, n, generator=g).cuda(), torch.randn(n, n, generator=g).cuda()
    fp32 = time_fn(lambda: torch.mm(x32, w32.T), "cuda", warmup=2, repeat=5)
    for dt in (torch.float32, torch.bfloat16):
        x, w = x32.to(dt), w32.to(dt)
        with gemm_path("kernel"):
            ref = det_gemm(x, w)
        for layout, contig, cap in VARIANTS:
            os.environ["LIGHTNING_DET_SLICES_CONTIGUOUS"], os.environ["LIGHTNING_DET_SLICES_CHUNK_MIB"] = contig, cap
            with gemm_path("slices"):
                t = time_fn(lambda: det_gemm(x, w), "cuda", warmup=1, repeat=3)
                same = torch.equal(det_gemm(x, w).view(torch.int32), ref.view(torch.int32))
            row = {"dtype": str(dt).replace("torch.", ""), "operands": layout, "diagonal_cap_mib": int(cap), "n": n,
                   "ms": t * 1e3, "ratio_vs_fp32_mm": fp32 / t, "same_bytes_as_kernel": same}
            print(row, flush=True)
            rows.append(row)
    print(f"wrote {write('slices_variants', 'cuda', rows, path=args.out)}")


if __name__ == "__main__":
    main()
