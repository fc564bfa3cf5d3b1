"""Quality parity of gpt_char: the same number of steps in four configurations, one run.

    python benchmarks/quality.py --accelerator gpu --steps 300

  fp32 plain        strategy ddp (one process), torch AdamW
  fp32 det_ddp      exact arithmetic, torch AdamW
  bf16 AdamWSR      precision bf16-true, det_ddp, stochastic rounding, no fp32 master copy
  bf16 AdamW (RNE)  precision bf16-true, det_ddp, torch AdamW rounding to nearest, no master copy

Writes benchmarks/results/<device>-quality.json (validation-loss curves and final values) and
<device>-quality.png.
"""
from __future__ import annotations

import argparse
import csv
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

CONFIGS = [
    ("fp32 plain", ["--strategy", "ddp", "--precision", "32-true"]),
    ("fp32 det_ddp", ["--strategy", "det_ddp", "--precision", "32-true"]),
    ("bf16 AdamWSR", ["--strategy", "det_ddp", "--precision", "bf16-true", "--optimizer", "adamwsr"]),
    ("bf16 AdamW (RNE)", ["--strategy", "det_ddp", "--precision", "bf16-true", "--optimizer", "adamw"]),
]


def read_val_curve(log_dir: Path):
    rows = []
    for f in sorted(log_dir.rglob("metrics.csv")):
        with open(f) as fh:
            for r in csv.DictReader(fh):
                if r.get("val_loss"):
                    rows.append((int(r["step"]), float(r["val_loss"])))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--val-every", type=int, default=50)
    p.add_argument("--extra", default="", help='more gpt_char arguments for every run, one string: "--d-model 128"')
    args = p.parse_args(argv)
    import shlex

    args.extra = shlex.split(args.extra)
    import gpt_char
    from _common import RESULTS, write

    rows = []
    for name, cfg in CONFIGS:
        log_dir = Path(tempfile.mkdtemp(prefix="quality-"))
        t0 = time.perf_counter()
        gpt_char.main(["--accelerator", args.accelerator, "--steps", str(args.steps), "--val-every",
                       str(args.val_every), "--log-dir", str(log_dir), "--no-progress-bar", *cfg, *args.extra])
        curve = read_val_curve(log_dir)
        rows.append({"config": name, "args": cfg, "val_curve": curve, "final_val_loss": curve[-1][1] if curve else None,
                     "wall_s": time.perf_counter() - t0})
        print(f"{name:18s} final val loss {rows[-1]['final_val_loss']}  ({rows[-1]['wall_s']:.0f} s)", flush=True)
        device = "cuda" if args.accelerator == "gpu" else "cpu"
        # written after every configuration, so a run cut short still leaves what it measured
        out = write("quality", device, rows, extra={"steps": args.steps, "extra_args": args.extra})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in rows:
            if r["val_curve"]:
                xs, ys = zip(*r["val_curve"])
                ax.plot(xs, ys, marker="o", label=f"{r['config']} ({r['final_val_loss']:.4f})")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats/char)")
        ax.set_title(f"gpt_char quality parity ({out.stem.split('-')[0]})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
