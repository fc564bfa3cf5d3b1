"""det_gemm by exact route against torch.mm fp32, timed in interleaved rounds: the figures of the
planner's cost table (csrc/gemm_plan.h, kCostTable).

    python benchmarks/gemm_routes.py                         # CPU, 64^3 .. 512^3, fp32 and bf16
    python benchmarks/gemm_routes.py --sizes 512 --rounds 9 --out /tmp/routes.json

Each round times torch.mm fp32 and every route once, back to back, so a load that drifts during
the run (a shared machine) hits them alike; each figure is the median over rounds of torch.mm's
time divided by the route's (ratio_vs_fp32_mm: above 1 is faster than torch.mm fp32). Operands:
torch.randn, seeds 1 and 2, square n x n times n x n. auto_route is the route explain_gemm names.
Every route returns the same bytes; routes_same_bytes checks it on these operands.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import write  # noqa: E402
from lightning_det.ops import det_gemm, explain_gemm  # noqa: E402

ROUTES = ("auto", "kernel", "slices", "fp64")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(n: int, dtype: torch.dtype, device: str, rounds: int) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, n, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    xf, wf = x.float(), w.float()
    fns = {"torch.mm": lambda: torch.mm(xf, wf.T)}
    fns.update({r: (lambda r=r: det_gemm(x, w, route=r)) for r in ROUTES})
    outs = {name: fn() for name, fn in fns.items()}  # warm-up, and the bytes
    same = all(torch.equal(outs[r], outs["auto"]) for r in ROUTES)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in times.items()}
    row = {"op": "det_gemm", "dtype": str(dtype).replace("torch.", ""), "data": "normal", "M": n, "N": n, "K": n,
           "rounds": rounds, "torch_mm_fp32_s": med["torch.mm"], "auto_route": explain_gemm(x, w).route,
           "routes_same_bytes": same}
    row.update({f"{r}_ratio_vs_fp32_mm": med["torch.mm"] / med[r] for r in ROUTES})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sizes", default="64,128,256,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for n in (int(v) for v in a.sizes.split(",")):
        for dt in a.dtypes.split(","):
            row = bench(n, getattr(torch, dt), a.device, a.rounds)
            rows.append(row)
            ratios = "  ".join(f"{r} {row[f'{r}_ratio_vs_fp32_mm']:.4f}" for r in ROUTES)
            print(f"{dt:9s} {n:5d}^3  vs torch.mm fp32: {ratios}  (auto = {row['auto_route']}, "
                  f"same bytes {row['routes_same_bytes']})", flush=True)
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print("wrote", write("gemm_routes", a.device, rows, extra={"load_average_at_end": load}, path=a.out))


if __name__ == "__main__":
    main()
