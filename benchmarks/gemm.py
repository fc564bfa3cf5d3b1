"""det_gemm throughput against torch.mm, same shapes, same device, one run.

    python benchmarks/gemm.py                # CPU at 512^3
    python benchmarks/gemm.py --device cuda  # GPU at 1024^3 and 4096^3 (and CPU rows too)

Writes benchmarks/results/<device>-gemm.json with rows of
{op, dtype, data, M, N, K, ours_tflops, baseline_tflops, ratio, baseline, fp32_mm_tflops}.
The baseline is torch.mm in the same dtype (fp32 with TF32 off); fp32_mm_tflops is torch.mm in
fp32 on the same shape, the yardstick of the performance issue.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import time_fn, write  # noqa: E402

from lightning_det.ops import det_gemm  # noqa: E402


def make(kind, shape, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "normal":
        t = torch.randn(shape, generator=g)
    elif kind == "wide":  # adversarial: exponents spread over [-40, 40] defeat the fast path
        t = (torch.rand(shape, generator=g) + 1) * torch.pow(2.0, torch.randint(-40, 41, shape, generator=g).float())
        t = t * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    else:
        raise ValueError(kind)
    return t.to(dtype).to(device)


def bench(device, M, N, K, dtype, kind, repeat):
    x, w = make(kind, (M, K), dtype, device, 1), make(kind, (N, K), dtype, device, 2)
    flops = 2.0 * M * N * K
    ours = time_fn(lambda: det_gemm(x, w), device, warmup=1, repeat=repeat)
    base = time_fn(lambda: torch.mm(x, w.T), device, warmup=2, repeat=max(repeat, 5))
    xf, wf = x.float(), w.float()
    fp32 = time_fn(lambda: torch.mm(xf, wf.T), device, warmup=2, repeat=max(repeat, 5))
    row = {
        "op": "det_gemm", "dtype": str(dtype).replace("torch.", ""), "data": kind, "M": M, "N": N, "K": K,
        "ours_tflops": flops / ours / 1e12, "baseline_tflops": flops / base / 1e12,
        "ratio": base / ours, "baseline": f"torch.mm {str(dtype).replace('torch.', '')}",
        "fp32_mm_tflops": flops / fp32 / 1e12, "ratio_vs_fp32_mm": fp32 / ours,
    }
    print(f"{row['op']:9s} {row['dtype']:9s} {kind:7s} {M:5d}x{N:5d}x{K:5d}  ours {row['ours_tflops']:9.4f} TF/s  "
          f"torch.mm {row['baseline_tflops']:9.3f}  ratio {row['ratio']:.4f}  vs fp32 mm {row['ratio_vs_fp32_mm']:.4f}",
          flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default=None, help="comma-separated cube sizes (default: 512 on CPU, 1024,4096 on GPU)")
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = []
    if args.device == "cpu":
        sizes = [int(s) for s in (args.sizes or "512").split(",")]
        for n in sizes:
            for dt in (torch.float32, torch.bfloat16):
                rows.append(bench("cpu", n, n, n, dt, "normal", repeat=3))
    else:
        sizes = [int(s) for s in (args.sizes or "1024,4096").split(",")]
        for n in sizes:
            for dt in (torch.float32, torch.bfloat16):
                rows.append(bench("cuda", n, n, n, dt, "normal", repeat=3))
            rows.append(bench("cuda", n, n, n, torch.bfloat16, "wide", repeat=3))
    out = write("gemm", args.device, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
