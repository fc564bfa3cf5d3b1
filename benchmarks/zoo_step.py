"""det_ddp against plain training on the model zoo (tests/zoo_models.py): step time per model.

    python benchmarks/zoo_step.py                              # CPU, 1 and 2 processes (gloo)
    python benchmarks/zoo_step.py --accelerator gpu --devices 1

Each strategy is --rounds launches, alternated with the other's, of tests/zoo_harness.py (the zoo test's harness, so the models,
data, det_transform and optimizer (AdamWSR; plain runs take torch's AdamW) are the tested ones), which fits every model for
--steps steps; rank 0 times each optimizer step (synchronized on CUDA). Reported: the median
step time after --warmup steps, per model, world size and strategy (the median over rounds), and the median over rounds
of their ratio. Plain is Lightning's
"ddp" (one device: "auto") on the unchanged model. On the GPU it also runs det_ddp on the CPU
(one process) and reports, per model, whether every step's parameters, buffers and optimizer
state have the same bytes on both devices (``cpu_equals_cuda``) and the first step that differs.
Writes benchmarks/results/<device>-zoo_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _common import write  # noqa: E402
from zoo_models import ZOO  # noqa: E402

HARNESS = HERE.parent / "tests" / "zoo_harness.py"


def launch(args, strategy: str, models: list, out: Path, devices: int, accelerator: str = None) -> None:
    cmd = [sys.executable, str(HARNESS), "--models", ",".join(models), "--devices", str(devices),
           "--accelerator", accelerator or args.accelerator, "--strategy", strategy, "--steps", str(args.steps),
           "--global-batch", str(args.global_batch), "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 and not out.exists():
        raise RuntimeError(f"{strategy} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def states(path: Path) -> dict:
    """{model: [(params, buffers, optimizer state) SHA-256 of every step]}."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "error" not in r:
            out.setdefault(r["model"], []).append((r["params_sha256"], r["buffers_sha256"], r["optim_sha256"]))
    return out


def medians(path: Path, warmup: int) -> dict:
    by_model, errors = {}, {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "error" in r:
            errors[r["model"]] = r["error"]
        elif r["step"] > warmup:
            by_model.setdefault(r["model"], []).append(r["step_s"])
    return {m: statistics.median(t) for m, t in by_model.items()}, errors


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--devices", default=None, help="world sizes, comma-separated; default: 1,2 on the CPU, 1 on the GPU")
    p.add_argument("--models", default=",".join(ZOO))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--timeout", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3,
                   help="launches of each strategy, alternated (plain, det, plain, det, ...); each model's figure "
                        "is the median over the rounds of its per-launch medians, and its ratio the median of "
                        "the rounds' ratios, so a shared machine's drifting load hits both alike")
    args = p.parse_args()
    world_sizes = [int(v) for v in (args.devices or ("1,2" if args.accelerator == "cpu" else "1")).split(",")]
    models = args.models.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="ldet-zoo-step-"))
    rows = []
    for ws in world_sizes:
        rows += measure(args, models, ws, tmp / f"ws{ws}")
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    path = write("zoo_step", device, rows, extra={
        "world_sizes": world_sizes, "global_batch": args.global_batch, "steps": args.steps, "warmup": args.warmup,
        "rounds": args.rounds,
        "threads_per_process": args.threads, "world_size_1_devices_compared": args.accelerator == "gpu",
        "det": "det_ddp (strict), det_transform, AdamWSR",
        "plain": "Lightning ddp (1 device: auto), the unchanged model, torch AdamW"})
    print(path)


def measure(args, models: list, ws: int, tmp: Path) -> list:
    """One row per model at world size ws; on the GPU at ws 1 also the CPU == CUDA comparison."""
    tmp.mkdir()
    rounds, errors = [], {}
    for r in range(max(1, args.rounds)):
        times = {}
        for strategy in ("ddp", "det_ddp"):
            out = tmp / f"{strategy}-{r}.jsonl"
            launch(args, strategy, models, out, devices=ws)
            times[strategy], errors[strategy] = medians(out, args.warmup)
        rounds.append(times)
    cross = {}
    if args.accelerator == "gpu" and ws == 1:
        launch(args, "det_ddp", models, tmp / "det_cpu.jsonl", accelerator="cpu", devices=1)
        on_cpu, on_gpu = states(tmp / "det_cpu.jsonl"), states(tmp / "det_ddp-0.jsonl")
        for m in models:
            a, b = on_cpu.get(m), on_gpu.get(m)
            if a and b:
                first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                cross[m] = {"cpu_equals_cuda": first is None and len(a) == len(b), "first_differing_step": first}
    rows = []
    for m in models:
        plains = [t["ddp"][m] for t in rounds if m in t["ddp"]]
        dets = [t["det_ddp"][m] for t in rounds if m in t["det_ddp"]]
        ratios = [t["det_ddp"][m] / t["ddp"][m] for t in rounds if m in t["ddp"] and m in t["det_ddp"]]
        plain = statistics.median(plains) if plains else None
        det = statistics.median(dets) if dets else None
        rows.append({"model": m, "devices": ws, "plain_step_ms": None if plain is None else plain * 1e3,
                     "det_step_ms": None if det is None else det * 1e3,
                     "ratio": statistics.median(ratios) if ratios else None, "rounds": len(ratios),
                     "error": errors["det_ddp"].get(m) or errors["ddp"].get(m), **cross.get(m, {})})
        print(f"{m:12s} ws {ws}  plain {rows[-1]['plain_step_ms']} ms  det {rows[-1]['det_step_ms']} ms  "
              f"ratio {rows[-1]['ratio']}" + (f"  ERROR {rows[-1]['error'][:200]}" if rows[-1]["error"] else ""))
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
