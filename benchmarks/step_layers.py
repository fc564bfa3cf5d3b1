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
steps of level L (3 or 4): diff the two tables to see what Lightning adds.
Prints one line per level (session 10's log: results/logs/h200-step-layers-d9e711b.txt, from a
scratch script with these levels and timing that also printed a profile table).
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
    a = p.parse_args(argv)
    import torch.nn.functional as F

    from _common import step_model
    from lightning_det import global_mean
    from lightning_det.nn import det_function_mode, det_transform
    from lightning_det.nn.grad_digits import eager_rounding, set_grad_digits
    from lightning_det.ops import slices_guess
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

    def step(i, level):
        set_grad_digits(net, level >= 2)
        x = xs[i % 8].to(dev)
        y = (x * 7 + 3) % 512
        if level >= 3:
            sync()
        if level >= 1:
            with det_function_mode(strict=True, loss_reduce=global_loss_reduce):
                with eager_rounding(net, enabled=level >= 2):
                    loss = global_mean(F.cross_entropy(net(x), y, reduction="none"))
                    loss.backward()
        else:
            global_mean(F.cross_entropy(net(x), y, reduction="none")).backward()
        if level >= 2:
            sync_gradients(list(net.parameters()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for q in net.parameters():
                q.grad = None
        if level >= 3:
            sync()

    for mode in ("default", "cached"):
        with slices_guess(mode):
            for level in NAMES:
                for i in range(4):
                    step(i, level)
                sync()
                t, n = time.perf_counter(), 20
                for i in range(n):
                    step(i, level)
                sync()
                print(f"B={a.batch} {mode:8s} {NAMES[level]:40s} {(time.perf_counter() - t) / n * 1e3:7.2f} ms/step",
                      flush=True)
    if 3 in a.profile:
        with profiled("level 3"):
            for i in range(4):
                step(i, 3)
    if a.lightning or 4 in a.profile:
        lightning_level(a, xs, dev, 4 in a.profile)


class profiled:
    """torch.profiler around a block; prints the host ops by self CPU time at the end."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.prof.__enter__()

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        print(f"--- host ops, {self.what} ---")
        print(self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))


def lightning_level(a, xs, dev: str, profile: bool) -> None:
    """Level 4: the det_ddp step through Lightning, timed between synchronizations as ddp_step.py."""
    import statistics

    import lightning as L

    from _common import det_step_module

    class Timer(L.Callback):
        def __init__(self):
            self.times, self.prof = [], None

        def on_train_batch_start(self, trainer, *_):
            if profile and trainer.global_step == 20:
                self.prof = profiled("level 4 (Lightning)")
                self.prof.__enter__()
            if dev == "cuda":
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, *_):
            if dev == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
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
    print(f"B={a.batch} default  {'the step through Lightning (det_ddp)':40s} {statistics.mean(steps) * 1e3:7.2f} ms/step",
          flush=True)


if __name__ == "__main__":
    main()
