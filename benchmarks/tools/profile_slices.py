"""Where a det_gemm call's device time goes, kernel by kernel (torch.profiler), for the integer
slices route at 4096^3 on random normal data. Not a benchmark (benchmarks/gemm.py is): it names
the kernels that the timings of gemm.py add up.

    python3 benchmarks/tools/profile_slices.py --out /tmp/slices-profile.json
    python3 benchmarks/tools/profile_slices.py --gemm-path slices_crt --out /tmp/crt-profile.json
    python3 benchmarks/tools/profile_slices.py --linear 8192,1024,4096 --out /tmp/linear-profile.json

--linear TOKENS,IN,OUT profiles one DetLinear forward + backward (benchmarks/linear.py's timed
call: three GEMMs, the bias sums, the operand copies) instead of one det_gemm call, and records
the wall time per call beside the device time (a gap between them is host time the GPU waited for).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common, linear
from _common import header  # noqa: E402
from lightning_det.ops import det_gemm, gemm_path, last_slices_plan  # noqa: E402


def kernel_table(prof, calls):
    """Device microseconds per call for each kernel name (summed over its launches)."""
    per = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time / calls
            per[e.name][1] += 1
    rows = [{"kernel": k[:160], "us_per_call": round(v[0], 1), "launches_per_call": v[1] / calls} for k, v in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--gemm-path", default="slices", help="the exact route profiled (lightning_det.ops.gemm_path)")
    p.add_argument("--linear", default=None, help="TOKENS,IN,OUT: profile DetLinear forward + backward instead")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    out = {**header("cuda"), "n": a.n, "calls": a.calls, "gemm_path": a.gemm_path, "linear": a.linear, "cases": []}
    with gemm_path(a.gemm_path):
        profile_cases(a, out)
    Path(a.out).write_text(json.dumps(out, indent=1))


def profile_cases(a, out):
    """Profiles a.calls det_gemm calls per dtype at a.n^3 and appends each kernel table to out."""
    for dt in (torch.bfloat16, torch.float32):
        call, plan = linear_call(a.linear, dt) if a.linear else gemm_call(a.n, dt)
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(a.calls):
                call()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.calls * 1e6
        table = kernel_table(prof, a.calls)
        total = sum(r["us_per_call"] for r in table)
        case = {"dtype": str(dt).replace("torch.", ""), "plan": plan, "device_us_per_call": round(total, 1),
                "wall_us_per_call_profiled": round(wall, 1), "kernels": table}
        out["cases"].append(case)
        print(f"{case['dtype']}: {total:.0f} us of device time per call ({wall:.0f} us wall, profiled), plan {plan}")
        for r in table[:16]:
            print(f"  {r['us_per_call']:9.1f} us  x{r['launches_per_call']:.0f}  {r['kernel'][:110]}")


def gemm_call(n, dt):
    """det_gemm at n^3 on random normal data, and its plan with counts."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, n, generator=g).to(dt).cuda()
    w = torch.randn(n, n, generator=g).to(dt).cuda()
    det_gemm(x, w, plans="sync")  # the plan with its counts (the profiled calls guess it: CUDA's default)
    plan = last_slices_plan()
    return (lambda: det_gemm(x, w)), plan


def linear_call(spec, dt):
    """DetLinear forward + backward as benchmarks/linear.py times it; no single plan (None)."""
    from linear import build, step_fn

    tokens, fin, fout = (int(v) for v in spec.split(","))
    return step_fn(*build("DetLinear", dt, tokens, fin, fout, "cuda")), None


if __name__ == "__main__":
    main()
