"""det_gemm by exact route against torch.mm fp32, timed in interleaved rounds: the figures of the
planner's cost table (csrc/gemm_plan.h, kCostTable).

    python benchmarks/gemm_routes.py                         # CPU, 64^3 .. 512^3, fp32 and bf16
    python benchmarks/gemm_routes.py --sizes 512 --rounds 9 --out /tmp/routes.json
    python benchmarks/gemm_routes.py --device cuda --dtypes bfloat16 --sizes "" --shapes gpt2

Each round times torch.mm fp32, torch.mm in the operands' dtype and every route once, back to
back, so a load that drifts during the run (a shared machine) hits them alike; each figure is the
median over rounds of torch.mm fp32's time divided by the route's (ratio_vs_fp32_mm: above 1 is
faster than torch.mm fp32; ratio_vs_dtype_mm likewise against torch.mm in the operands' dtype).
Operands: torch.randn, seeds 1 and 2: square n x n times n x n (--sizes), or M x K times K x N
(--shapes MxNxK,...; "gpt2": the GEMMs of a GPT-2-small step at 8192 tokens, forward, dgrad and
wgrad of d_model 768 against 2304, 3072 and 768). Rounded outputs (det_gemm) and, with the
wgrad shapes' --digits, canonical digits (det_gemm_partial, routes auto, kernel, slices).
Rounded outputs are fp32, or with --out-dtype inputs the operands' dtype (bf16 inputs to bf16
outputs, as a bf16 training step's forward and dgrad round them); each row records out_dtype.
auto_route is the route explain_gemm names. Every route returns the same bytes;
routes_same_bytes checks it on these operands.
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
from lightning_det.ops import det_gemm, det_gemm_partial, explain_gemm  # noqa: E402

ROUTES = ("auto", "kernel", "slices", "fp64")
DIGIT_ROUTES = ("auto", "kernel", "slices")
# GPT-2-small at 8192 tokens (d 768; qkv 2304, MLP 3072, attention projection 768): each Linear's
# forward (T x out x d), dgrad (T x d x out) and wgrad (out x d x T, digits)
GPT2 = [(8192, n, 768) for n in (2304, 3072, 768)] + [(8192, 768, k) for k in (2304, 3072)] + \
    [(n, 768, 8192) for n in (2304, 3072, 768)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(M: int, N: int, K: int, dtype: torch.dtype, device: str, rounds: int, digits: bool = False,
          out_dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dtype)
    xf, wf = x.float(), w.float()
    fns = {"torch.mm": lambda: torch.mm(xf, wf.T), "torch.mm dtype": lambda: torch.mm(x, w.T)}
    routes = DIGIT_ROUTES if digits else ROUTES
    if digits:
        fns.update({r: (lambda r=r: det_gemm_partial(x, w, route=r)) for r in routes})
    else:
        fns.update({r: (lambda r=r: det_gemm(x, w, out_dtype=out_dtype, route=r)) for r in routes})
    outs = {name: fn() for name, fn in fns.items()}  # warm-up, and the bytes
    same = all(torch.equal(outs[r], outs["auto"]) for r in routes)
    del outs
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in times.items()}
    row = {"op": "det_gemm_partial" if digits else "det_gemm", "dtype": str(dtype).replace("torch.", ""),
           "data": "normal", "M": M, "N": N, "K": K,
           "out_dtype": None if digits else str(out_dtype).replace("torch.", ""), "rounds": rounds, "torch_mm_fp32_s": med["torch.mm"],
           "torch_mm_dtype_s": med["torch.mm dtype"],
           "auto_route": explain_gemm(x, w, output="digits" if digits else "rounded").route,
           "routes_same_bytes": same}
    row.update({f"{r}_ratio_vs_fp32_mm": med["torch.mm"] / med[r] for r in routes})
    row.update({f"{r}_ratio_vs_dtype_mm": med["torch.mm dtype"] / med[r] for r in routes})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--sizes", default="64,128,256,512")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--shapes", default="", help='MxNxK,... (M x K times K x N), or "gpt2"')
    p.add_argument("--out-dtype", default="float32", choices=("float32", "inputs"),
                   help="rounded outputs in fp32, or in the operands' dtype")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cases = [(n, n, n, False) for n in (int(v) for v in a.sizes.split(",") if v)]
    if a.shapes == "gpt2":
        cases += [(m, n, k, m < 8192) for m, n, k in GPT2]
    elif a.shapes:
        cases += [tuple(int(v) for v in s.split("x")) + (False,) for s in a.shapes.split(",")]
    rows = []
    for m, n, k, digits in cases:
        for dt in a.dtypes.split(","):
            dtype = getattr(torch, dt)
            row = bench(m, n, k, dtype, a.device, a.rounds, digits,
                        torch.float32 if a.out_dtype == "float32" else dtype)
            rows.append(row)
            routes = DIGIT_ROUTES if digits else ROUTES
            ratios = "  ".join(f"{r} {row[f'{r}_ratio_vs_fp32_mm']:.3f}/{row[f'{r}_ratio_vs_dtype_mm']:.3f}"
                               for r in routes)
            print(f"{dt:9s} {m}x{n}x{k} {'digits ' if digits else 'rounded'} vs torch.mm fp32/{dt}: {ratios}  "
                  f"(auto = {row['auto_route']}, same bytes {row['routes_same_bytes']})", flush=True)
    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print("wrote", write("gemm_routes", a.device, rows, extra={"load_average_at_end": load}, path=a.out))


if __name__ == "__main__":
    main()
