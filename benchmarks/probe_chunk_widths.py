"""Which cuBLASLt int8 kernel runs, and how fast, for the slice route's diagonal GEMMs as the
N-chunk width changes: C (4096, n) int32 = A (4096, Kd) . B (n, Kd)^T, A and B column views of
wider int8 slice matrices (ld = 3 or 5 x 4096), as csrc/int_slices_host.h hands them to
torch._int_mm. Pure torch: needs no lightning_det build.

    python3 benchmarks/probe_chunk_widths.py --out OUT.json
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header  # noqa: E402


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:90] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    M, K = 4096, 4096
    rows = []
    for S in (3, 5):
        xs = torch.randint(-128, 128, (M, S * K), dtype=torch.int8, device="cuda")
        ws = torch.randint(-128, 128, (4096, S * K), dtype=torch.int8, device="cuda")
        for pairs in (1, 3):
            Kd = pairs * K
            for n in (464, 512, 824, 1024, 1280, 1536, 1816, 2048, 2336, 2560, 3072, 3272, 4096):
                A, B = xs[:, :Kd], ws[:n, :Kd]
                C = torch.empty(M, n, dtype=torch.int32, device="cuda")
                fn = lambda: torch._int_mm(A, B.t(), out=C)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    fn()
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end) / 5
                row = {"ld": S * K, "Kd": Kd, "n": n, "ms": round(ms, 4), "tops": round(2 * M * n * Kd / ms / 1e9, 1),
                       "kernels": kernel_names(fn)}
                print(row, flush=True)
                rows.append(row)
    Path(a.out).write_text(json.dumps({**header("cuda"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
