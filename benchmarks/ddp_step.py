"""det_ddp against plain ddp on the same model, in one run: step time, peak memory, and the bytes
each gradient reduction moves per gradient element.

    python benchmarks/ddp_step.py                          # CPU, 2 processes (gloo)
    python benchmarks/ddp_step.py --accelerator gpu --devices 1

Each strategy runs as its own subprocess (Lightning's launcher starts the other ranks); rank 0
reports the median step time after warm-up (--timing per-step, a synchronization around each
step) or the mean over the steps after warm-up between two synchronizations (--timing window:
steady-state training, where the host may queue a step while the GPU finishes the last one), and
its peak memory (CUDA: max_memory_allocated;
CPU: peak RSS of the process). Writes benchmarks/results/<device>-ddp_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


WARM_STEPS = 3  # steps before the timed ones (plans, caches, cuBLASLt descriptors)


def _sync(args) -> None:
    if torch.cuda.is_available() and args.accelerator == "gpu":
        torch.cuda.synchronize()


def child(args):
    import lightning as L
    import torch.nn.functional as F

    import lightning_det  # noqa: F401
    from lightning_det import global_mean
    from _common import step_model, token_loader
    from lightning_det.nn import det_transform

    torch.set_num_threads(1 if args.accelerator == "cpu" else 4)
    det = args.strategy.startswith("det_ddp")
    strategy = args.strategy
    if det:
        from lightning_det.strategy import DeterministicStrategy

        # the strategy plans its steps' GEMMs itself (gemm_plans; "default" = its "auto");
        # det_ddp_no_eager: the same strategy holding every gradient as digits
        plans = {"default": "auto"}.get(args.slices_guess, args.slices_guess)
        strategy = DeterministicStrategy(eager_rounding=args.strategy != "det_ddp_no_eager", gemm_plans=plans)
    breakdown = args.breakdown and args.accelerator == "gpu"
    if breakdown:  # before the model exists, so the replayed total matches the allocator's
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = step_model(args.width)
            if det:
                det_transform(self.net)
            self.times = []

        def training_step(self, batch, _):
            x, y = batch
            logits = self.net(x)
            if det:
                return global_mean(F.cross_entropy(logits, y, reduction="none"))
            return F.cross_entropy(logits, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Timer(L.Callback):
        def __init__(self):
            self.prof = None
            self.tables: dict = {}

        def on_train_batch_start(self, trainer, *a):
            if args.profile and trainer.global_step == 4 and trainer.global_rank == 0:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if args.accelerator == "gpu" else []),
                    with_stack=args.profile_stacks)
                self.prof.__enter__()
            if args.timing == "window":  # one synchronization before the window's first step
                if trainer.global_step == WARM_STEPS:
                    _sync(args)
                    self.w0 = time.perf_counter()
                return
            _sync(args)
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer, pl_module):
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                avg = self.prof.key_averages()
                keys = [("cpu", "self_cpu_time_total")]
                if args.accelerator == "gpu":  # the key's name changed across torch versions
                    keys.insert(0, ("device", "self_device_time_total" if hasattr(avg[0], "self_device_time_total")
                                    else "self_cuda_time_total"))
                for what, key in keys:
                    self.tables[what] = avg.table(sort_by=key, row_limit=30, max_name_column_width=60).splitlines()
                if args.profile_stacks:  # which Python lines launch the most ops (host time)
                    by_stack = self.prof.key_averages(group_by_stack_n=6)
                    self.tables["cpu_by_stack"] = by_stack.table(sort_by="cpu_time_total", row_limit=40,
                                                                 max_name_column_width=40).splitlines()

        def on_train_batch_end(self, trainer, pl_module, *a):
            if args.timing == "window":  # ... and one after its last (global_step counts it already;
                # on_train_end would add Lightning's end-of-fit work to the window)
                if trainer.global_step == args.steps:
                    _sync(args)
                    pl_module.times = [(time.perf_counter() - self.w0) / (args.steps - WARM_STEPS)]
                return
            _sync(args)
            pl_module.times.append(time.perf_counter() - self.t0)

    if args.no_fill:  # an experiment, not a product setting: PyTorch's NaN fill of new
        # allocations under use_deterministic_algorithms (the strict environment turns it on)
        from torch.utils import deterministic  # (not `import torch.utils...`: torch would turn local)

        deterministic.fill_uninitialized_memory = False
    g = torch.Generator().manual_seed(1)
    n = args.batch * (args.steps + 2)
    x = torch.randint(0, 512, (n,), generator=g)
    # batched fetch: the default per-sample collate of 4096 tokens took ~60 ms of host time a
    # batch, which --timing window counted (it made both strategies read 60-90 ms a step)
    dl = token_loader(x, (x * 7 + 3) % 512, args.batch // args.devices, shuffle=True)
    model = Net()
    timer = Timer()
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    if args.accelerator == "gpu":
        torch.cuda.reset_peak_memory_stats()
    from lightning_det.ops import gemm_path

    # gemm_path: e.g. the slices' CRT way, forced
    with gemm_path(args.gemm_path):
        trainer.fit(model, dl)
    if trainer.global_rank == 0:
        warm = model.times if args.timing == "window" else (model.times[WARM_STEPS:] or model.times)
        if args.accelerator == "gpu":
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        sync = getattr(trainer.strategy, "det_last_sync", None) or {}
        params = sum(p.numel() for p in model.parameters())
        bytes_per_elem = (sync["bytes"] / sync["elements"]) if sync.get("elements") else 4.0
        row = {
            "strategy": args.strategy, "devices": args.devices, "params": params,
            "step_ms": 1e3 * statistics.median(warm), "peak_bytes": peak,
            "allreduce_bytes_per_grad_element": bytes_per_elem,
            "allreduce_bytes_per_step": sync.get("bytes", 4 * params), "slices_guess": args.slices_guess,
            "gemm_path": args.gemm_path, "timing": args.timing, "fill_uninitialized_memory": not args.no_fill,
        }
        if det:
            row["eager_rounded_params"] = sync.get("eager", 0)
        if args.profile:
            row["profile_steps"] = (f"steps 5..{args.steps} ran under torch.profiler: this run's step_ms "
                                    "includes its overhead")
            row["profile"] = timer.tables
        if breakdown:
            from memory_peak import peak_breakdown

            try:
                row["peak_breakdown"] = peak_breakdown(torch.cuda.memory._snapshot())
            except Exception as e:  # the numbers above stand without it
                row["peak_breakdown"] = f"failed: {e!r}"
            torch.cuda.memory._record_memory_history(enabled=None)
        Path(args.out).write_text(json.dumps(row))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=256, help="global batch")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--child", action="store_true")
    p.add_argument("--strategy", default="det_ddp")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of the steps after the 4th")
    p.add_argument("--strategies", default="", help="comma-separated subset, e.g. det_ddp,ddp (baseline last)")
    p.add_argument("--profile-stacks", action="store_true", help="with --profile: also group host time by Python stack")
    p.add_argument("--breakdown", action="store_true",
                   help="CUDA: record allocations and report what is alive at each run's peak (slower steps)")
    p.add_argument("--slices-guess", default="default", choices=["default", "sync", "cached"],
                   help="how the det strategies' slice GEMMs plan: DeterministicStrategy(gemm_plans=...), "
                        "default meaning its 'auto' (cached on CUDA)")
    p.add_argument("--gemm-path", default="auto",
                   help="exact GEMM route for the det strategies (lightning_det.ops.gemm_path), e.g. slices_crt")
    p.add_argument("--out", default="", help="(internal) the child's row file")
    p.add_argument("--no-fill", action="store_true",
                   help="experiment: torch.utils.deterministic.fill_uninitialized_memory off in the child")
    p.add_argument("--timing", default="per-step", choices=["per-step", "window"],
                   help="per-step: a synchronization at each step's start and end, the median step; "
                        "window: one before the first timed step and one after the last, their mean "
                        "(steady-state training, where the host may queue the next step while the GPU "
                        "finishes the last)")
    p.add_argument("--results", default=None, help="results path (default: benchmarks/results/<device>-ddp_step.json)")
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    from _common import write

    rows = []
    # det_ddp_no_eager: the same run holding all gradients as digits until the step (one process
    # only: with several, nothing is rounded in the backward anyway)
    strategies = ("det_ddp", "det_ddp_no_eager", "ddp") if args.devices == 1 else ("det_ddp", "ddp")
    if args.strategies:  # e.g. a profile of det_ddp and its baseline only
        strategies = tuple(args.strategies.split(","))
    for strategy in strategies:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, __file__, "--child", "--strategy", strategy, "--out", out,
               "--accelerator", args.accelerator, "--devices", str(args.devices), "--width", str(args.width),
               "--batch", str(args.batch), "--steps", str(args.steps)]
        cmd += (["--breakdown"] if args.breakdown else []) + (["--profile"] if args.profile else [])
        cmd += ["--profile-stacks"] if args.profile_stacks else []
        cmd += ["--slices-guess", args.slices_guess, "--gemm-path", args.gemm_path, "--timing", args.timing]
        cmd += ["--no-fill"] if args.no_fill else []
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
        subprocess.run(cmd, check=True, env=env, timeout=1800)
        rows.append(json.loads(Path(out).read_text()))
        print(json.dumps(rows[-1]), flush=True)
    det, ddp = rows[0], rows[-1]
    summary = {"step_time_ratio": det["step_ms"] / ddp["step_ms"], "peak_memory_ratio": det["peak_bytes"] / ddp["peak_bytes"]}
    if len(rows) == 3:
        summary["no_eager_step_time_ratio"] = rows[1]["step_ms"] / ddp["step_ms"]
        summary["no_eager_peak_memory_ratio"] = rows[1]["peak_bytes"] / ddp["peak_bytes"]
    print(f"det_ddp / ddp: step time {summary['step_time_ratio']:.2f}x, peak memory {summary['peak_memory_ratio']:.2f}x, "
          f"all-reduce {det['allreduce_bytes_per_grad_element']:.1f} vs {ddp['allreduce_bytes_per_grad_element']:.1f} "
          "bytes per gradient element")
    device = "cuda" if args.accelerator == "gpu" else "cpu"
    path = write("ddp_step", device, rows, extra={"summary": summary, "world_size": args.devices,
                                                 "slices_guess": args.slices_guess,
                                                 "gemm_path": args.gemm_path, "timing": args.timing,
                                                 "model": f"emb-LN-MLP width {args.width}", "global_batch": args.batch},
                 path=args.results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
