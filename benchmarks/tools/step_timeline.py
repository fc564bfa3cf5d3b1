"""Where a det_ddp training step on one GPU leaves the GPU idle, and what the host does meanwhile.

    python benchmarks/tools/step_timeline.py --out /tmp/timeline.json             # CUDA only
    python benchmarks/tools/step_timeline.py --model gpt --out /tmp/gpt.json     # gpt_step's det-bf16 run

The model is benchmarks/ddp_step.py's (embedding, LayerNorm, MLP, LayerNorm, head), or with
--model gpt benchmarks/gpt_step.py's GPT-2-small det_ddp bf16 run (its shape; --gpt-layers
shortens it). Steps 10-12 run under torch.profiler. Per step (the span of Lightning's Optimizer.step, which holds the
forward, backward and update; its GPU work counted to its end): the GPU's busy time (the union
of its kernel and copy intervals)
and its idle gaps. Then, over the gaps longer than 20 us, the host ops they overlap, by name:
what the GPU was waiting for. Nested ops are all counted (an aten::zeros and the aten::fill_
inside it), so the list ranks causes; it does not add up to the idle time. Profiler overhead
inflates host time: compare the busy time with ddp_step.py's unprofiled step time. Also the
device time and launches per kernel name per step (25 largest), to see which kernels a change moved.
Between steps (from a step's end, its GPU work included, to the next step's start): each
interval, and the host ops in it by name (the batch, Lightning's and the strategy's hooks, the
callbacks; the profiling callback's own synchronization is among them).
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: _common
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

PROFILED = (10, 13)  # global steps [first, end)
MIN_GAP_US = 20


def _profiler_callback():
    import lightning as L

    class Profile(L.Callback):
        prof = None
        done = None

        def on_train_batch_start(self, trainer, *a):
            torch.cuda.synchronize()
            if trainer.global_step == PROFILED[0]:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.__enter__()

        def on_train_batch_end(self, trainer, *a):
            torch.cuda.synchronize()
            if self.prof is not None and trainer.global_step == PROFILED[1]:
                self.prof.__exit__(None, None, None)
                self.done, self.prof = self.prof, None

    return Profile()


def run_profiled(width: int, batch: int, guess: str):
    import lightning as L

    from _common import det_step_module, det_strategy, token_loader

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (batch * (PROFILED[1] + 3),), generator=g)
    dl = token_loader(x, (x * 7 + 3) % 512, batch)
    cb = _profiler_callback()
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=det_strategy(guess), max_steps=PROFILED[1] + 1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb])
    trainer.fit(det_step_module(width), dl)
    return cb.done.events()


def run_profiled_gpt(layers: int, gemm_route: str = "auto"):
    import gpt_step

    shape = {**gpt_step.GPT2_SMALL, "steps": PROFILED[1] + 1, "n_layers": layers}
    ids, _ = gpt_step.stdlib_tokens(shape["max_chars"], shape["vocab"])
    args = argparse.Namespace(device="cuda", seed=0, lr=3e-4, gemm_route=gemm_route)
    cb = _profiler_callback()
    gpt_step.run("det-bf16", True, "bf16-true", "adamwsr", shape, gpt_step.Windows(ids, shape["seq_len"]),
                 shape["vocab"], args, gpt_step.plain_settings(), extra_callbacks=[cb])
    return cb.done.events()


def host_time_in_gaps(spans, gaps) -> collections.Counter:
    """Per name, the time its (name, start, end) spans overlap the sorted, disjoint (start, end)
    gaps: each span bisects to its first gap, O((spans + overlaps) log gaps) rather than
    spans x gaps, which a GPT-2-small step's hundreds of thousands of host ops make minutes long."""
    ends = [g1 for _, g1 in gaps]
    host = collections.Counter()
    for name, s, e in spans:
        i = bisect.bisect_right(ends, s)  # the first gap that ends after the span starts
        while i < len(gaps) and gaps[i][0] < e:
            overlap = min(e, gaps[i][1]) - max(s, gaps[i][0])
            if overlap > 0:
                host[name] += overlap
            i += 1
    return host


def analyse(events) -> dict:
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    cpu_names = {e.name for e in cpu}
    # GPU-side user annotations (the Optimizer.step range shows there too) are not GPU work
    work = sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in cpu_names
                  and not e.name.startswith(("Optimizer.", "ProfilerStep")))
    steps, gaps, ends = [], [], []
    for t0, t1 in sorted((e.time_range.start, e.time_range.end) for e in cpu if e.name.startswith("Optimizer.step")):
        # work queued in the step runs to its end: once the host runs ahead of the GPU, the
        # kernels of the step's last ops end after Optimizer.step has returned, and a window
        # clipped there would under-count the step's busy time
        spans = [(max(s, t0), e) for s, e in work if e > t0 and s < t1]
        if not spans:
            continue
        busy, cur_s, cur_e = 0.0, *spans[0]
        step_gaps = [(t0, cur_s)]
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                step_gaps.append((cur_e, s))
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        if cur_e < t1:
            step_gaps.append((cur_e, t1))
        steps.append({"window_us": round(t1 - t0), "gpu_busy_us": round(busy)})
        gaps += step_gaps
        ends.append((t0, max(t1, cur_e)))
    # from one step's end (its GPU work included) to the next step's start: the loop's own work
    # (the batch, Lightning's and the strategy's hooks, the callbacks), outside every window above
    between = [(a[1], b[0]) for a, b in zip(ends, ends[1:]) if b[0] > a[1]]
    outside = host_time_in_gaps(((e.name, e.time_range.start, e.time_range.end) for e in cpu
                                 if not e.name.startswith(("ProfilerStep", "Optimizer.step"))), between)
    big = sorted(g for g in gaps if g[1] - g[0] > MIN_GAP_US)
    named = [e for e in cpu if not e.name.startswith(("ProfilerStep", "Optimizer.step", "enumerate("))]
    host = host_time_in_gaps(((e.name, e.time_range.start, e.time_range.end) for e in named), big)
    n = max(1, len(steps))
    # device time per kernel name in the profiled steps: which kernels a change made faster
    kernels, launches = collections.Counter(), collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in cpu_names and \
                not e.name.startswith(("Optimizer.", "ProfilerStep")):
            kernels[e.name[:100]] += e.time_range.end - e.time_range.start
            launches[e.name[:100]] += 1
    return {"gpu_kernels_us_per_step": [(k, round(v / n), round(launches[k] / n, 1)) for k, v in kernels.most_common(25)],
            "steps": steps,
            "gpu_busy_us_per_step": sum(s["gpu_busy_us"] for s in steps) / n,
            "gaps_over_20us_per_step": len(big) / n, "idle_in_those_gaps_us_per_step": sum(b - a for a, b in big) / n,
            "host_ops_during_those_gaps_us_per_step": [(k, round(v / n)) for k, v in host.most_common(40)],
            "between_steps_us": [round(b - a) for a, b in between],
            "host_ops_between_steps_us_per_interval": [(k, round(v / max(1, len(between))))
                                                       for k, v in outside.most_common(30)]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--slices-guess", default="default", choices=["default", "sync", "cached"])
    p.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    p.add_argument("--gpt-layers", type=int, default=12, help="with --model gpt: layers (12: GPT-2-small)")
    p.add_argument("--gemm-route", default="auto", choices=["auto", "kernel", "slices", "fp64"],
                   help="with --model gpt: the exact GEMMs' route (gpt_step.py --gemm-route)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_timeline.py needs a CUDA GPU")
    from _common import header

    if a.model == "gpt":
        res = {**header("cuda"), "model": f"gpt_step det-bf16, {a.gpt_layers} layers",
               **analyse(run_profiled_gpt(a.gpt_layers, a.gemm_route))}
    else:
        res = {**header("cuda"), "width": a.width, "batch": a.batch, "slices_guess": a.slices_guess,
               **analyse(run_profiled(a.width, a.batch, a.slices_guess))}
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_per_step") or k.startswith("gpu_busy")}))
    for name, us, calls in res["gpu_kernels_us_per_step"][:15]:
        print(f"{us:9d} us/step of GPU in {calls:7.1f} launches  {name[:80]}")
    for name, us in res["host_ops_during_those_gaps_us_per_step"][:30]:
        print(f"{us:9d} us/step  {name[:90]}")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
