"""DetLinear forward + backward against nn.Linear, same shapes, same device, one run.

    python benchmarks/linear.py --device cuda   # tokens 8192, (in, out) = (1024, 4096) and (4096, 1024)
    python benchmarks/linear.py --device cpu    # tokens 512, 256 -> 512 (default device)
    python benchmarks/linear.py --device cpu --out /tmp/linear.json

One timed call is ``layer(x).backward(gy)`` with the gradients cleared first: three GEMMs (y, dX,
dW) and the bias sums. x requires grad, as in any layer but the first. x, gy ~ randn (seeds 1, 2);
weights: nn.Linear's init under torch.manual_seed(0), copied into DetLinear (rounded to bf16 for
the bf16 row). Rows:
  DetLinear float32   vs nn.Linear float32 (TF32 off)
  DetLinear bfloat16  vs nn.Linear float32 (TF32 off); nn.Linear bfloat16 is recorded beside it
ratio = baseline_ms / ours_ms (the performance target is ratio >= 0.5). Times: median after
warm-up (benchmarks/_common.py time_fn). Memory (CUDA only; None on CPU): each variant is built
alone on the device, then peak_bytes = torch.cuda.max_memory_allocated() over one call after
reset_peak_memory_stats(), and extra_bytes = peak_bytes minus what was allocated before the call
(weights, x, gy). Writes benchmarks/results/<device>-linear.json (or --out).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import call_peak_memory, time_fn, write  # noqa: E402

from lightning_det.nn import DetLinear  # noqa: E402
from lightning_det.ops import gemm_path  # noqa: E402

SHAPES = {"cuda": (8192, [(1024, 4096), (4096, 1024)]), "cpu": (512, [(256, 512)])}


def _dt(dtype):
    return str(dtype).replace("torch.", "")


def build(kind, dtype, tokens, fin, fout, device):
    """(layer, x, gy) on the device; the same weights and data for every kind and dtype."""
    torch.manual_seed(0)
    ref = nn.Linear(fin, fout)
    layer = DetLinear(fin, fout) if kind == "DetLinear" else nn.Linear(fin, fout)
    layer.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, fin, generator=g)
    gy = torch.randn(tokens, fout, generator=torch.Generator().manual_seed(2))
    layer = layer.to(device=device, dtype=dtype)
    x = x.to(device=device, dtype=dtype).requires_grad_(True)
    return layer, x, gy.to(device=device, dtype=dtype)


def step_fn(layer, x, gy):
    def step():
        layer.zero_grad(set_to_none=True)  # each call allocates its gradients, as a training step does
        x.grad = None
        layer(x).backward(gy)
    return step


def peak_memory(layer, x, step, device):
    """(peak_bytes, extra_bytes) of one call on CUDA; (None, None) elsewhere."""
    if device != "cuda":
        return None, None
    layer.zero_grad(set_to_none=True)  # "before" is then weights, x and gy alone
    x.grad = None
    return call_peak_memory(step, device)


def measure(kind, dtype, tokens, fin, fout, device, repeat):
    """{ms, peak_bytes, extra_bytes} of one variant, built alone on the device and freed after."""
    layer, x, gy = build(kind, dtype, tokens, fin, fout, device)
    step = step_fn(layer, x, gy)
    ms = 1e3 * time_fn(step, device, warmup=2, repeat=repeat)
    peak, extra = peak_memory(layer, x, step, device)
    del layer, x, gy, step
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"ms": ms, "peak_bytes": peak, "extra_bytes": extra}


def row(tokens, fin, fout, dtype, ours, base, base_bf16=None):
    r = {
        "op": "linear_fwd_bwd", "tokens": tokens, "in": fin, "out": fout, "dtype": _dt(dtype),
        "ours": f"DetLinear {_dt(dtype)}", "baseline": "nn.Linear float32 (TF32 off)",
        "ours_ms": ours["ms"], "baseline_ms": base["ms"], "ratio": base["ms"] / ours["ms"],
        "meets_target_0.5x": base["ms"] / ours["ms"] >= 0.5,
        "ours_peak_bytes": ours["peak_bytes"], "baseline_peak_bytes": base["peak_bytes"],
        "ours_extra_bytes": ours["extra_bytes"], "baseline_extra_bytes": base["extra_bytes"],
    }
    if base_bf16 is not None:
        r["nn_linear_bf16_ms"] = base_bf16["ms"]
        r["nn_linear_bf16_peak_bytes"] = base_bf16["peak_bytes"]
    return r


def show(r):
    mem = ""
    if r["ours_peak_bytes"] is not None:
        mem = (f"  peak {r['ours_peak_bytes'] / 2**20:8.1f} MiB vs {r['baseline_peak_bytes'] / 2**20:8.1f} MiB "
               f"(+{r['ours_extra_bytes'] / 2**20:.1f} vs +{r['baseline_extra_bytes'] / 2**20:.1f} in the call)")
    print(f"{r['ours']:18s} vs {r['baseline']:28s} tokens {r['tokens']:5d} {r['in']:5d}->{r['out']:<5d}  "
          f"{r['ours_ms']:10.3f} ms vs {r['baseline_ms']:8.3f} ms  ratio {r['ratio']:.4f}{mem}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=None, help="rows of x (default: 8192 on GPU, 512 on CPU)")
    p.add_argument("--shapes", default=None, help="comma-separated IN:OUT (default: 1024:4096,4096:1024 on GPU, "
                                                  "256:512 on CPU)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--gemm-path", default="auto",
                   help="DetLinear's exact GEMM route (lightning_det.ops.gemm_path), e.g. slices_crt")
    p.add_argument("--out", default=None, help="results path (default: benchmarks/results/<device>-linear.json)")
    args = p.parse_args(argv)
    # the fp32 baseline is true fp32: TF32 would make nn.Linear faster and less accurate
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokens, shapes = SHAPES[args.device]
    tokens = args.tokens or tokens
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    rows = []
    for fin, fout in shapes:
        with gemm_path(args.gemm_path):  # nn.Linear does not go through it
            m = {(k, d): measure(k, d, tokens, fin, fout, args.device, args.repeat)
                 for k in ("nn.Linear", "DetLinear") for d in (torch.float32, torch.bfloat16)}
        base = m[("nn.Linear", torch.float32)]
        for dtype in (torch.float32, torch.bfloat16):
            bf16 = m[("nn.Linear", torch.bfloat16)] if dtype == torch.bfloat16 else None
            rows.append(row(tokens, fin, fout, dtype, m[("DetLinear", dtype)], base, bf16))
            show(rows[-1])
    out = write("linear", args.device, rows, path=args.out,
                extra={"tf32": False, "timed": "layer(x).backward(gy), x.requires_grad, median after warm-up",
                       "repeat": args.repeat, "gemm_path": args.gemm_path})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
