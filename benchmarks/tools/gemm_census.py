"""Every exact GEMM of gpt_step's det_ddp step, by shape: the route it took and its device time.

    python benchmarks/tools/gemm_census.py                    # CUDA, GPT-2-small, bf16
    python benchmarks/tools/gemm_census.py --tiny --device cpu

Runs benchmarks/gpt_step.py's det run (bf16-true, AdamWSR; --precision 32-true for fp32) for
--steps steps and, on the last one, wraps the ldet GEMM calls of det_linear (every Linear's
forward, dgrad and wgrad): each is synchronized and timed on its own, and the plan it ran
(lightning_det.ops.last_gemm_plan, last_slices_plan) recorded. Prints one line per (M, N, K,
output, route) with the calls, the total milliseconds, the slice counts and the rows left to the
long-accumulator kernel (-1: a guessed plan, which does not count them). Timing each call alone
adds synchronizations: compare shares, not the sum, with the step time.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


class _TimedOps:
    """Stands in for torch.ops.ldet inside lightning_det.ops.linear while ``on``."""

    def __init__(self, ops, device: str):
        self.ops, self.device, self.on = ops, device, False
        self.calls = collections.defaultdict(lambda: {"calls": 0, "ms": 0.0, "slices": set(), "kernel_rows": set()})

    def __getattr__(self, name):
        fn = getattr(self.ops, name)
        if name not in ("gemm", "gemm_partial"):
            return fn
        return lambda x, w, *a: self._timed(name, fn, x, w, *a)

    def _sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def _timed(self, name, fn, x, w, *a):
        if not self.on:
            return fn(x, w, *a)
        from lightning_det.ops import last_gemm_plan, last_slices_plan

        self._sync()
        t0 = time.perf_counter()
        out = fn(x, w, *a)
        self._sync()
        ms = (time.perf_counter() - t0) * 1e3
        plan, sl = last_gemm_plan(), last_slices_plan()
        key = (x.shape[0], w.shape[0], x.shape[1], str(x.dtype).replace("torch.", ""),
               "digits" if name == "gemm_partial" else "rounded", plan.route)
        rec = self.calls[key]
        rec["calls"] += 1
        rec["ms"] += ms
        if plan.route == "slices":
            rec["slices"].add((sl["slices_x"], sl["slices_w"]))
            rec["kernel_rows"].add((sl["kernel_rows_x"], sl["kernel_rows_w"]))
        return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="gpt_step's tiny shape")
    p.add_argument("--precision", default="bf16-true", choices=["bf16-true", "32-true"])
    p.add_argument("--steps", type=int, default=4, help="the last one is counted")
    a = p.parse_args(argv)
    import gpt_step
    import lightning as L

    import lightning_det.ops.linear as linear

    timed = _TimedOps(linear._ops(), a.device)
    linear._ops = lambda: timed

    class CountLast(L.Callback):
        def on_train_batch_start(self, trainer, *args):
            timed.on = trainer.global_step == a.steps - 1

    shape = {**(gpt_step.TINY if a.tiny else gpt_step.GPT2_SMALL), "steps": a.steps}
    ids, _ = gpt_step.stdlib_tokens(shape["max_chars"], shape["vocab"])
    args = argparse.Namespace(device=a.device, seed=0, lr=3e-4)
    optimizer = "adamwsr" if a.precision == "bf16-true" else "adamw"
    gpt_step.run("det", True, a.precision, optimizer, shape, gpt_step.Windows(ids, shape["seq_len"]),
                 shape["vocab"], args, gpt_step.plain_settings(), extra_callbacks=[CountLast()])
    total = sum(r["ms"] for r in timed.calls.values())
    print(f"{'M':>6} {'N':>6} {'K':>6} {'dtype':9} {'output':7} {'route':7} {'calls':>5} {'ms':>8} {'share':>6}  "
          "slices (x, w); kernel rows (x, w)")
    for key, r in sorted(timed.calls.items(), key=lambda kv: -kv[1]["ms"]):
        m, n, k, dt, out, route = key
        extra = f"{sorted(r['slices'])}; {sorted(r['kernel_rows'])}" if r["slices"] else ""
        print(f"{m:6d} {n:6d} {k:6d} {dt:9} {out:7} {route:7} {r['calls']:5d} {r['ms']:8.1f} "
              f"{r['ms'] / total:6.1%}  {extra}")
    print(f"total {total:.1f} ms of exact GEMMs in one step (each call synchronized)")


if __name__ == "__main__":
    main()
