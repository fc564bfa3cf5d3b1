"""Time overhead of DigestCallback (params, grads, optimizer state every step) on a Lightning run.

Compares step times of the same run with and without the callback, alternating the two several
times, and reports the median step time of each (after warm-up) and the overhead in percent.
Also reports the raw digest throughput over all parameters.

  python benchmarks/digest_overhead.py --device cpu          # small model (CI machine)
  python benchmarks/digest_overhead.py --device cuda         # >= 50M parameters (goal: < 3%)

Writes benchmarks/results/<device>-digest_overhead.json (or --out).
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from _common import results_path  # noqa: E402

from lightning_det.callbacks import DigestCallback  # noqa: E402
from lightning_det.digest import digest_many  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StepTimer(Callback):
    """Wall time between consecutive batch starts: the whole step, every callback included."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.t = cuda, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.cuda:
            torch.cuda.synchronize()
        self.t.append(time.perf_counter())


def one_run(width, depth, batch, steps, device, digest: bool, tmp: str) -> list[float]:
    torch.manual_seed(0)
    model = Net(width, depth)
    data = torch.utils.data.TensorDataset(torch.randn(batch * 4, width))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    timer = StepTimer(device == "cuda")
    cbs = [timer]
    if digest:
        cbs.append(DigestCallback(tmp, include=("params", "grads", "optim")))
    trainer = pl.Trainer(max_steps=steps + 1, accelerator=device, devices=1, callbacks=cbs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    return [b - a for a, b in zip(timer.t, timer.t[1:])]


def bench(width, depth, batch, steps, warmup, repeats, device) -> dict:
    base, dig = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            base += one_run(width, depth, batch, steps, device, False, tmp)[warmup:]
            dig += one_run(width, depth, batch, steps, device, True, os.path.join(tmp, str(r)))[warmup:]
    model = Net(width, depth).to(device)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    digest_many(params)
    times = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        digest_many(params)
        times.append(time.perf_counter() - t0)
    b, d = statistics.median(base), statistics.median(dig)
    return {"model": f"mlp {depth}x{width}", "params": n, "batch": batch, "steps_timed": len(base),
            "include": ["params", "grads", "optim"], "baseline_step_ms": round(b * 1e3, 3),
            "digest_step_ms": round(d * 1e3, 3), "overhead_pct": round(100 * (d - b) / b, 2),
            "digest_all_params_ms": round(statistics.median(times) * 1e3, 3),
            "digest_GBps": round(4 * n / statistics.median(times) / 1e9, 2)}


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or "cpu"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/<device>-digest_overhead.json)")
    a = p.parse_args()
    if a.device == "cuda":
        # 50.3M and 56.6M parameters; batches large enough for a realistic step (tens of ms).
        configs = [(4096, 3, 4096), (3072, 6, 4096)]
        steps, warmup = a.steps or 30, 5
    else:
        configs = [(512, 4, 64), (1024, 4, 64)]  # 1.05M, 4.2M parameters
        steps, warmup = a.steps or 20, 3
    torch.set_float32_matmul_precision("highest")
    rows = [bench(w, d, b, steps, warmup, a.repeats, a.device) for w, d, b in configs]
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:  # noqa: BLE001
        commit = None
    dev = device_name(a.device)
    out = {"benchmark": "digest_overhead", "device": dev, "torch": torch.__version__, "cuda": torch.version.cuda,
           "lightning": pl.__version__, "threads": torch.get_num_threads(), "commit": commit,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
           "method": "median wall time between consecutive batch starts, after warm-up, runs with and without "
                     "DigestCallback alternated", "rows": rows}
    path = Path(a.out) if a.out else results_path("digest_overhead", a.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
