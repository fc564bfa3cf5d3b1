"""Which cuBLASLt int8 kernel (sm90 or cutlass sm80, align16 or align4) runs torch._int_mm for the
slice route's diagonal GEMMs, C (M, n) int32 = A (M, Kd) . B (n, Kd)^T on column views of
3 x Kd-wide int8 matrices, as the chunk width n steps by 8 (40) from 256 to 4096, at M = 4096
(8192, 1024). Pure torch: needs no lightning_det build. The rule it found (NOTES "Session 7")
is csrc/int_slices_host.h's chunk_columns.

    python3 benchmarks/probe_chunk_scan.py OUT.json   # rows: (M, Kd, n, TOPS, kernel kind)
"""
import torch, json, sys, os
out = sys.argv[1]
rows = []
def kname(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
    n = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return "sm90" if any("sm90" in s for s in n) else ("c80a4" if any("align4" in s for s in n) else "c80")
for M, Kd, step in ((4096, 4096, 8), (8192, 4096, 40), (1024, 4096, 40)):
    xs = torch.randint(-128, 128, (M, 3 * Kd), dtype=torch.int8, device="cuda")
    ws = torch.randint(-128, 128, (4096, 3 * Kd), dtype=torch.int8, device="cuda")
    for n in range(256, 4097, step):
        A, B = xs[:, :Kd], ws[:n, :Kd]
        C = torch.empty(M, n, dtype=torch.int32, device="cuda")
        fn = lambda: torch._int_mm(A, B.t(), out=C)
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(3): fn()
        e.record(); torch.cuda.synchronize()
        ms = s.elapsed_time(e) / 3
        rows.append((M, Kd, n, round(2*M*n*Kd/ms/1e9), kname(fn)))
json.dump(rows, open(out, "w"))
from collections import Counter
for M in (4096, 8192, 1024):
    r = [x for x in rows if x[0] == M]
    print(M, Counter(x[4] for x in r), "sm90 n:", [x[2] for x in r if x[4] == "sm90"][:80])
    print("  best tops", sorted(r, key=lambda x: -x[3])[:8])
