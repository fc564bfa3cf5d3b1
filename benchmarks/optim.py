"""AdamWSR step time and optimizer memory against torch.optim.AdamW.

    python benchmarks/optim.py                 # CPU (~10M params) and, if present, CUDA (~100M)
    python benchmarks/optim.py --devices cpu --cpu-params 10e6 --repeats 7

For each device: one optimizer step over a model-like list of 8 tensors (same shapes, same fixed
gradients for every row), median of --repeats timed steps after --warmup steps. Ratios are
against torch.optim.AdamW(fused=True) on fp32 parameters in the same run (foreach=True where
fused is not available on that device, said in the row). Writes
benchmarks/results/<device>-optim.json per device (benchmarks/_common.results_path; --out DIR
writes DIR/<device>-optim.json instead).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _common import results_path  # noqa: E402

from lightning_det.optim import AdamWSR  # noqa: E402


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _shapes(total: float) -> list[tuple[int, int]]:
    rows = max(1, int(total) // (8 * 1024))
    return [(rows, 1024)] * 8


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _time_interleaved(steps: list, dev: str, warmup: int, repeats: int) -> list[float]:
    # Round-robin over the optimizers, so load drift on a shared machine hits all rows alike.
    for step in steps:
        for _ in range(warmup):
            step()
    _sync(dev)
    times = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            t0 = time.perf_counter()
            step()
            _sync(dev)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _torch_adamw(params, dev: str):
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        for p in params:  # fused support is only checked at the first step on some versions
            p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
        return opt, "fused=True"
    except (RuntimeError, ValueError) as exc:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True), f"foreach=True (fused unsupported: {exc})"


def bench_device(dev: str, total: float, warmup: int, repeats: int) -> dict:
    shapes = _shapes(total)
    n = sum(r * c for r, c in shapes)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g).to(dev) for s in shapes]
    grads = [(torch.randn(s, generator=g) * 1e-3).to(dev) for s in shapes]
    def make(dtype):
        ps = [p.clone().to(dtype) for p in init]
        for p, gr in zip(ps, grads):
            p.grad = gr.to(dtype)
        return ps

    rows, steps = [], []

    # Baseline: torch fused AdamW on fp32 parameters.
    ps = make(torch.float32)
    base_opt, base_mode = _torch_adamw(ps, dev)
    steps.append(base_opt.step)
    rows.append(dict(name=f"torch.optim.AdamW({base_mode.split(' ')[0]}) fp32 params", mode=base_mode,
                     optimizer_bytes_per_param=_state_bytes, weight_bytes_per_param=4, opt=base_opt))

    # The usual bf16 recipe: bf16 model, fp32 master + fp32 moments; step = AdamW on the master
    # plus the copy back into the bf16 weights.
    master = make(torch.float32)
    model = [p.detach().to(torch.bfloat16) for p in master]
    m_opt, m_mode = _torch_adamw(master, dev)

    def master_step():
        m_opt.step()
        torch._foreach_copy_(model, master)

    steps.append(master_step)
    rows.append(dict(name="fp32-master AdamW for a bf16 model (step + copy to bf16)", mode=m_mode,
                     optimizer_bytes_per_param=lambda o: _state_bytes(o) + 4 * n, weight_bytes_per_param=2, opt=m_opt))

    for dtype, label in ((torch.float32, "fp32"), (torch.bfloat16, "bf16 (stochastic rounding)")):
        ps = make(dtype)
        opt = AdamWSR(ps, lr=1e-4, weight_decay=0.01, seed=1)
        steps.append(opt.step)
        rows.append(dict(name=f"AdamWSR {label} params", mode="fused per-parameter kernel",
                         optimizer_bytes_per_param=_state_bytes,
                         weight_bytes_per_param=2 if dtype == torch.bfloat16 else 4, opt=opt))

    times = _time_interleaved(steps, dev, warmup, repeats)
    for row, t in zip(rows, times):
        opt = row.pop("opt")
        row["optimizer_bytes_per_param"] = row["optimizer_bytes_per_param"](opt) / n
        row["step_ms"] = t * 1e3
        row["ratio_vs_torch_fp32"] = t / times[0]

    if dev == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{_cpu_name()} ({torch.get_num_threads()} threads)"
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True).strip()
        dirty = bool(subprocess.check_output(["git", "status", "--porcelain", "--", "csrc", "lightning_det", "benchmarks/optim.py"], cwd=ROOT, text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = "unknown", None
    return dict(
        benchmark="optim", device=name, device_type=dev, torch=torch.__version__, cuda=torch.version.cuda,
        commit=commit, uncommitted_changes=dirty,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        params=n, shapes=[list(s) for s in shapes], warmup=warmup, repeats=repeats, statistic="median, rows timed round-robin",
        load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
        rows=rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cpu,cuda", help="comma list; cuda is skipped where absent")
    ap.add_argument("--cpu-params", type=float, default=10e6)
    ap.add_argument("--cuda-params", type=float, default=100e6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads (torch.set_num_threads); 0 keeps torch's default")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for dev in args.devices.split(","):
        if dev == "cuda" and not torch.cuda.is_available():
            print("cuda: no GPU here, skipped")
            continue
        res = bench_device(dev, args.cpu_params if dev == "cpu" else args.cuda_params, args.warmup, args.repeats)
        path = results_path("optim", dev)
        if args.out:
            path = Path(args.out) / path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"{res['device']}  torch {res['torch']}  {res['params'] / 1e6:.1f}M params  -> {path}")
        for r in res["rows"]:
            print(f"  {r['name']:<58} {r['step_ms']:9.2f} ms  {r['ratio_vs_torch_fp32']:5.2f}x  "
                  f"optimizer {r['optimizer_bytes_per_param']:4.1f} B/param  weights {r['weight_bytes_per_param']} B/param")
            if "unsupported" in r["mode"]:
                print(f"    note: {r['mode']}")


if __name__ == "__main__":
    main()
