"""Probe: torch._int_mm speed and stride acceptance on this GPU (planning data for the integer route).

    python3 benchmarks/probe_int_mm.py OUT.json     # CUDA only; results/h200-int8-probe.json

The committed results file came from a version with a third stride case, "B_rowmajor", whose
operands had mismatched shapes (the probe's mistake, not torch's); it is left out here.
"""
import json, sys, torch
d = "cuda"
def t(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n
out = {"torch": torch.__version__, "dev": torch.cuda.get_device_name()}
torch.backends.cuda.matmul.allow_tf32 = False
for M, K, N in [(4096, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 1024), (4096, 20480, 4096), (20480, 4096, 4096)]:
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8, device=d)
    b = torch.randint(-128, 128, (N, K), dtype=torch.int8, device=d).t()
    ms = t(lambda: torch._int_mm(a, b))
    af = torch.randn(M, K, device=d); bf = torch.randn(K, N, device=d)
    mf = t(lambda: torch.mm(af, bf))
    out[f"{M}x{K}x{N}"] = {"int_mm_ms": ms, "int_TOPS": 2*M*K*N/ms/1e9, "fp32_ms": mf, "fp32_TF": 2*M*K*N/mf/1e9}
# strided views: a column block of a wider row-major A, and of a [N, 3K] B storage
A = torch.randint(-128, 128, (4096, 3 * 1024), dtype=torch.int8, device=d)
B = torch.randint(-128, 128, (4096, 3 * 1024), dtype=torch.int8, device=d)
for name, fn in {"A_view": lambda: torch._int_mm(A[:, 1024:3072], B[:, :2048].t().contiguous()),
                 "B_view": lambda: torch._int_mm(A[:, :2048].contiguous(), B[:, 1024:3072].t())}.items():
    try:
        fn()
        out[name] = "ok"
    except Exception as ex:
        out[name] = f"{type(ex).__name__}: {str(ex)[:200]}"
a = A[:, 1024:3072]; b = B[:, 1024:3072].t()
r = torch._int_mm(a, b); ref = (a.double() @ b.double())
out["view_exact"] = bool(torch.equal(r.double(), ref))
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[1], "w"), indent=1)
