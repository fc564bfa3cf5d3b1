"""Where the det_ddp step makes the host wait for the GPU: every synchronizing CUDA call of one
Lightning step, with the Python line that asked for it.

    python benchmarks/tools/sync_sites.py --out sync.json          # CUDA only

A host synchronization drains the GPU's queue; the host then has to launch the next kernels while
the GPU idles, so a step with many of them is host-bound even when its GPU work is far shorter
than its wall time. This runs ddp_step.py's model (width 1024, batch 4096)
under DeterministicStrategy on one GPU, once per slice-plan mode (its gemm_plans: "sync", each
GEMM reads its plan; "cached", guessed plans (det_gemm's plans= argument); "default", the
strategy's "auto": cached on CUDA), and during step 4 turns on
torch.cuda.set_sync_debug_mode("warn"): PyTorch then warns at each synchronizing call it
makes (copies to the host, .item(), .tolist(), torch.unique, nonzero, ...), and each warning's
stack is recorded. A raw cudaMemcpy in an extension would not be seen; ours go through PyTorch.
Prints one line per site (count, the innermost lightning_det frame, the outermost model frame).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: _common
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def _site(stack) -> str:
    """The innermost frame in lightning_det (or in benchmarks/, else the innermost at all)."""
    frames = [f for f in stack if "warnings.py" not in f.filename and "sync_sites.py" not in f.filename]
    ours = [f for f in frames if "lightning_det" in f.filename]
    f = (ours or frames or list(stack))[-1]
    where = f"{Path(f.filename).name}:{f.lineno} {f.name}"
    callers = [f"{Path(g.filename).name}:{g.lineno}" for g in ours[-3:-1]]
    return where + (f"  (via {' <- '.join(reversed(callers))})" if callers else "")


def run(mode: str, width: int, batch: int, steps: int = 6) -> dict:
    import lightning as L

    import lightning_det  # noqa: F401  (registers strategy="det_ddp")
    from _common import det_step_module, det_strategy

    sites: collections.Counter = collections.Counter()
    times: list[float] = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, *a):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            if trainer.global_step == 4:
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == 5:  # global_step is already incremented: step 4 ended
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            sites[_site(traceback.extract_stack())] += 1

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (batch * (steps + 2),), generator=g)
    ds = torch.utils.data.TensorDataset(x, (x * 7 + 3) % 512)
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=det_strategy(mode), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Watch()])
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = show
        trainer.fit(det_step_module(width), dl)
    return {"mode": mode, "syncs_in_step_4": sum(sites.values()), "sites": dict(sites.most_common()),
            "step_ms": [round(1e3 * t, 2) for t in times]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--modes", default="default,cached")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sync_sites.py: needs a CUDA device (set_sync_debug_mode sees CUDA synchronizations only)")
    from _common import commit, device_name

    rows = []
    for mode in a.modes.split(","):
        r = run(mode, a.width, a.batch)
        rows.append(r)
        print(f"{mode}: {r['syncs_in_step_4']} synchronizations in step 4; step ms {r['step_ms']}")
        for site, n in r["sites"].items():
            print(f"  {n:3d}  {site}")
    if a.out:
        Path(a.out).write_text(json.dumps({"device": device_name("cuda"), "torch": torch.__version__,
                                           "commit": commit(), "width": a.width, "batch": a.batch,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
