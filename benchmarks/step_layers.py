"""What each layer of the det_ddp step adds to a bare forward + backward, without Lightning.

    python benchmarks/step_layers.py --batch 4096            # CUDA (the default device)
    python benchmarks/step_layers.py --device cpu --width 16 --batch 16

The model is benchmarks/ddp_step.py's (det_transform'ed). Levels, each timed as the mean step
time of 20 steps after 4 warm-up steps, in one process, under torch.use_deterministic_algorithms
(as det_ddp runs):
  0  bare: net(x), PyTorch's F.cross_entropy(reduction='none'), global_mean, backward;
  1  + det_function_mode (F.cross_entropy becomes det_cross_entropy, as det_ddp's training_step);
  2  + digit mode with eager rounding, sync_gradients and an SGD step (the strategy's
     optimizer_step at world size 1);
  3  + a device synchronization at the step's start and end (ddp_step.py's timer);
  4  the same step through Lightning (Trainer(strategy="det_ddp"), ddp_step.py's timer callback),
     in this process after the others (--lightning; once, with the default plans).
Each of 0-3 once with slice plans from the summaries ("default") and once with guessed plans
("cached"). Level 4 minus level 3 is Lightning's loop (session 10: ~4.5 ms for det_ddp on the
GPU, none on the CPU). --profile L prints torch.profiler's host-op table (self CPU time) over 4
steps of level L (3 or 4): diff the two tables to see what Lightning adds (on CUDA also the
kernels' device time). --after re-times level 3 after level 4 in the same process, --nccl sets up
a one-rank process group first, --no-gc turns Python's cyclic GC off: each separates Lightning's
loop from the state it leaves in the process. --phases times level 3 once more (and level 4) with
host-time marks between forward, backward, gradient sync, optimizer step and the final wait.
Prints one line per level, with the GC, cudaMalloc and CPU time of its timed steps (session 10's
log: results/logs/h200-step-layers-d9e711b.txt, from a scratch script with these levels; session
11's: logs/h200-step-layers-lightning-281e7ee.txt, logs/h200-step-layers-profile-281e7ee.txt).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

NAMES = {0: "bare (plain CE, global_mean)", 1: "+ det_function_mode (det CE)",
         2: "+ eager rounding, sync_gradients, SGD", 3: "+ synchronize at step start/end"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--lightning", action="store_true", help="also level 4, the step through Lightning")
    p.add_argument("--profile", type=int, choices=[3, 4], action="append", default=[],
                   help="print the host-op profile of level 3 and/or 4")
    p.add_argument("--after", action="store_true", help="re-time level 3 after level 4, in the same process")
    p.add_argument("--nccl", action="store_true", help="set up a one-rank process group before timing")
    p.add_argument("--no-gc", action="store_true", help="gc.disable() for the whole run")
    p.add_argument("--phases", action="store_true", help="host time between the step's phases, level 3 (and 4)")
    p.add_argument("--cprofile", action="store_true",
                   help="cProfile of 4 level-3 steps with guessed plans: host time by Python function and op")
    p.add_argument("--levels", default="0,1,2,3", help="which of levels 0-3 to time (comma-separated)")
    a = p.parse_args(argv)
    import torch.nn.functional as F

    from _common import step_model
    from lightning_det import global_mean
    from lightning_det.nn import StepState, det_function_mode, det_transform, set_grad_digits
    from lightning_det.parallel.grad_sync import sync_gradients
    from lightning_det.parallel.loss import global_loss_reduce

    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = a.device

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 512, (a.batch,), generator=g) for _ in range(8)]
    net = step_model(a.width)
    det_transform(net)
    net = net.to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)

    phases = Phases()
    state = StepState()  # its plans: the mode time_level runs

    def step(i, level):
        # digit mode from level 2; the GEMM plan mode reaches the det modules through the state
        # they are bound to, so levels 0 and 1 run the default plans
        set_grad_digits(net, state if level >= 2 else None)
        x = xs[i % 8].to(dev)
        y = (x * 7 + 3) % 512
        if level >= 3:
            sync()
            phases.mark("start")
        if level >= 1:
            with det_function_mode(strict=True, loss_reduce=global_loss_reduce, state=state):
                with state.eager_rounding(enabled=level >= 2):
                    loss = global_mean(F.cross_entropy(net(x), y, reduction="none"))
                    phases.mark("forward queued")
                    loss.backward()
                    phases.mark("backward returned")
        else:
            global_mean(F.cross_entropy(net(x), y, reduction="none")).backward()
        if level >= 2:
            sync_gradients(list(net.parameters()), state)
            phases.mark("gradients synced")
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for q in net.parameters():
                q.grad = None
        if level >= 3:
            phases.mark("optimizer stepped")
            sync()
            phases.mark("synchronized")

    def time_level(mode, level, label=None):
        state.plans = mode
        for i in range(4):
            step(i, level)
        sync()
        with ProcessCosts(dev) as costs:
            t, n = time.perf_counter(), 20
            for i in range(n):
                step(i, level)
            sync()
        print(f"B={a.batch} {mode:8s} {label or NAMES[level]:40s} {(time.perf_counter() - t) / n * 1e3:7.2f} ms/step"
              f"  {costs.line(n)}", flush=True)

    if a.nccl:  # a one-rank NCCL group first, as Lightning's ddp set-up makes one
        import os

        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=0, world_size=1)
    if a.no_gc:
        import gc

        gc.disable()
    for mode in ("default", "cached"):
        for level in (int(v) for v in a.levels.split(",") if v):
            time_level(mode, level)
    if 3 in a.profile:
        with profiled("level 3", cuda=dev == "cuda"):
            for i in range(4):
                step(i, 3)
    if a.lightning or 4 in a.profile:
        lightning_level(a, xs, dev, 4 in a.profile)
        if a.after:  # the same loop as level 3, now in a process Lightning has set up
            time_level("default", 3, "level 3 again, after the Lightning run")
    if a.phases:
        for mode in ("default", "cached"):
            phases.reset()
            time_level(mode, 3, "level 3, phases timed")
            print(phases.line(f"level 3, {mode}"))
    if a.cprofile:  # where the host's time goes when no plan read waits for the GPU
        import cProfile
        import pstats

        state.plans = "cached"
        for i in range(4):
            step(i, 3)
        prof = cProfile.Profile()
        prof.enable()
        for i in range(4):
            step(i, 3)
        prof.disable()
        print("--- cProfile, 4 level-3 steps, guessed plans (times in s over the 4 steps) ---")
        pstats.Stats(prof).sort_stats("tottime").print_stats(45)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


class Phases:
    """Host time between named marks of a step, averaged over steps (a mark named "start"
    begins a step): where the host spends the step, and how long it waits at the end."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.sums, self.steps, self.last = {}, 0, None

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        if name == "start":
            self.steps += 1
        elif self.last is not None:
            key = f"{self.last[0]} -> {name}"
            self.sums[key] = self.sums.get(key, 0.0) + now - self.last[1]
        self.last = (name, now)

    def line(self, what: str) -> str:
        n = max(1, self.steps)
        return f"phases, {what} (ms/step): " + "; ".join(f"{k} {v / n * 1e3:.2f}" for k, v in self.sums.items())


class ProcessCosts:
    """Costs the process's state adds to a timed block: Python's cyclic GC (collections per
    generation and their time, through gc.callbacks), the CUDA caching allocator's device
    allocations (cudaMalloc calls, which synchronize) and CPU time (this thread's, and all the
    process's threads': other threads compete with the one queueing the GPU work)."""

    def __init__(self, dev: str):
        self.dev = dev
        self.gc_s, self.gc_n, self.mallocs, self.thread_s, self.process_s = 0.0, [0, 0, 0], 0, 0.0, 0.0

    def _gc_hook(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._t
            self.gc_n[info["generation"]] += 1

    def _mallocs(self):
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if self.dev == "cuda" else 0

    def __enter__(self):  # may be entered again: the costs add up
        import gc

        self.m0 = self._mallocs()
        self.t0 = (time.thread_time(), time.process_time())
        gc.callbacks.append(self._gc_hook)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self._gc_hook)
        self.mallocs += self._mallocs() - self.m0
        self.thread_s += time.thread_time() - self.t0[0]
        self.process_s += time.process_time() - self.t0[1]

    def line(self, steps: int) -> str:
        return (f"gc {self.gc_s / steps * 1e3:5.2f} ms/step ({'/'.join(map(str, self.gc_n))} collections by "
                f"generation), cudaMalloc {self.mallocs}, CPU ms/step: this thread "
                f"{self.thread_s / steps * 1e3:.1f}, all threads {self.process_s / steps * 1e3:.1f}")


class profiled:
    """torch.profiler around a block; prints the host ops by self CPU time at the end and, on
    CUDA, the kernels by device time and the summed device time (to tell extra GPU work from
    host time the GPU waits for)."""

    def __init__(self, what: str, cuda: bool = False):
        self.what, self.cuda = what, cuda

    def __enter__(self):
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        avg = self.prof.key_averages()
        print(f"--- host ops, {self.what} ---")
        print(avg.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
        if self.cuda:
            print(f"--- device time, {self.what} ---")
            print(avg.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
            total = sum(e.self_device_time_total for e in avg)
            print(f"{self.what}: summed self device time {total / 1e3:.2f} ms over the profiled steps")


def lightning_level(a, xs, dev: str, profile: bool) -> None:
    """Level 4: the det_ddp step through Lightning, timed between synchronizations as ddp_step.py."""
    import statistics

    import lightning as L

    from _common import det_step_module

    class Timer(L.Callback):
        def __init__(self):
            self.times, self.prof, self.costs, self.phases = [], None, ProcessCosts(dev), Phases()

        def _mark(self, trainer, name):
            if 4 <= trainer.global_step < 20:
                self.phases.mark(name)

        def on_before_backward(self, trainer, *_):
            self._mark(trainer, "forward queued")

        def on_after_backward(self, trainer, *_):
            self._mark(trainer, "backward returned")

        def on_before_optimizer_step(self, trainer, *_):
            self._mark(trainer, "gradients synced")

        def on_train_batch_start(self, trainer, *_):
            if profile and trainer.global_step == 20:
                self.prof = profiled("level 4 (Lightning)", cuda=dev == "cuda")
                self.prof.__enter__()
            if dev == "cuda":
                torch.cuda.synchronize()
            if 4 <= trainer.global_step < 20:
                self.costs.__enter__()
            self._mark(trainer, "start")
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            if 4 < trainer.global_step <= 20:  # global_step has moved on by one
                self.phases.mark("optimizer stepped")
            if dev == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            if 4 < trainer.global_step <= 20:
                self.phases.mark("synchronized")
                self.costs.__exit__()
            if self.prof is not None and trainer.global_step == 24:
                self.prof.__exit__(None, None, None)
                self.prof = None

    x = torch.cat(xs * 4)  # 32 batches: 24 steps in one epoch
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x * 7 + 3) % 512), batch_size=a.batch)
    timer = Timer()
    trainer = L.Trainer(accelerator="gpu" if dev == "cuda" else "cpu", devices=1, strategy="det_ddp", max_steps=24,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(det_step_module(a.width), dl)
    steps = timer.times[4:20]  # after warm-up, before the profiled steps
    print(f"B={a.batch} default  {'the step through Lightning (det_ddp)':40s} {statistics.mean(steps) * 1e3:7.2f} ms/step"
          f"  {timer.costs.line(len(steps))}",
          flush=True)
    print(timer.phases.line("level 4 (Lightning)"))


if __name__ == "__main__":
    main()
