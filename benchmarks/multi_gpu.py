"""World-size and accumulation invariance over NCCL (gloo on CPU): examples/gpt_char.py under det_ddp at several world sizes (same global
batch), with accumulation, and plain ddp as the control; digests compared with `lightning-det diff`;
step time, peak memory and the gradient all-reduce per run.

    python benchmarks/multi_gpu.py --accelerator cuda --out $OUT/multi_gpu     # 1, 2, 4, 8 GPUs (as present)
    python benchmarks/multi_gpu.py --accelerator cpu                           # 1, 2 gloo processes

--out is the working folder of the runs (default: a new temporary folder); the results file is
--results (default benchmarks/results/<device>-multi_gpu.json).

Runs (each a subprocess of this file with a clean environment and a timeout; Lightning's own
launcher starts the other ranks, NCCL on CUDA, gloo on CPU):

  det-wsN        det_ddp, N processes, global batch B (B/N per rank), DigestCallback     (sharding)
  ddp-wsN        Lightning's ddp (nn.Linear + F.scaled_dot_product_attention), the same  (control)
  det-wsA-accK   det_ddp at world size A with accumulate_grad_batches=K                  (accumulation)

A (``--accum-world-size``) defaults to the largest world size at which B / (A * K) is a whole
number, so accumulation is checked together with sharding (B=16 with 1, 2, 4, 8 GPUs: A=4).
The accumulate_grad_batches=1 run at A is det-wsA itself.

Comparisons (``lightning_det.digest.compare.diff_runs``, the function behind `lightning-det diff`,
whose text is printed and stored; the equivalent command line is stored too):
  det-wsN vs det-ws1 for every N: must be identical at every step (loss, grads, params, optimizer
  state, RNG states);
  det-wsA-accK vs det-wsA and vs det-ws1: every section but the loss must be identical (Lightning
  records the last micro-batch's loss divided by K, a different quantity; `lightning-det diff`
  therefore reports the loss, and the verdict here leaves it out, as tests/test_gpt_char.py does);
  control: ddp-wsN vs ddp-ws1, ddp-wsN vs the previous ddp world size (the same samples per global
  batch under DistributedSampler for N >= 2: arithmetic alone), det-ws1 vs ddp-ws1.

Per run (rank 0's step times, the largest peak memory over the ranks): median optimizer-step time
after warm-up (the interval between consecutive optimizer steps, DigestCallback included, which
both strategies carry), peak memory (CUDA: torch.cuda.max_memory_allocated; CPU: peak RSS),
gradient all-reduce bytes per gradient element and per step (det_ddp: what the strategy's
`det_last_sync` reports the windowed digit reduce moved; ddp: 4 bytes per fp32 gradient), and
under det_ddp the median time of the whole gradient sync (digits -> reduce -> rounding) and of its
collectives alone (CUDA-synchronized around each torch.distributed.all_reduce issued inside
the sync; plain ddp's bucketed all-reduce runs inside DDP's C++ reducer, overlapped with the
backward, and is not timed: benchmarks/nccl_kshard.py times an fp32 all-reduce of the same size).

Writes the results file (benchmarks/_common.write) and per-run folders
<out>/<run>/{digests/, metrics-rank*.json, log.txt}, and prints the summary table; the results
file is rewritten after every run, so a command stopped by a time limit leaves what it finished. Exit status 0 when every det_ddp pair
is identical (accumulation: all but the loss) and the control differs; 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

WARMUP_STEPS = 5  # optimizer-step intervals left out of the median (first steps: audit, allocator, caches)


# ---- the child: one training run (every rank runs this) --------------------------------------
def child(run_dir: Path, gpt_argv: list) -> None:
    import resource

    import lightning as L
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt_char

    from lightning_det.parallel.env import run_then_destroy_process_group

    on_cuda = "gpu" in gpt_argv

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    class Bench(L.Callback):
        """Optimizer-step intervals, peak memory, and (det_ddp) the gradient sync's time and bytes."""

        def __init__(self) -> None:
            self.step_s: list = []
            self.sync_s: list = []
            self.collective_s: list = []
            self.sync_stats: dict = {}

        def on_train_start(self, trainer, pl_module) -> None:
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()
            self.last_step, self.t_prev = trainer.global_step, time.perf_counter()
            strategy = trainer.strategy
            if getattr(strategy, "strategy_name", "") == "det_ddp":
                self._wrap_sync(strategy)

        def _wrap_sync(self, strategy) -> None:
            inner_sync, inner_all_reduce = strategy.sync_gradients, dist.all_reduce
            state = {"in_sync": False, "collective": 0.0}

            def timed_all_reduce(tensor, *args, **kwargs):
                if not state["in_sync"]:
                    return inner_all_reduce(tensor, *args, **kwargs)
                sync()
                t0 = time.perf_counter()
                out = inner_all_reduce(tensor, *args, **kwargs)
                sync()
                state["collective"] += time.perf_counter() - t0
                return out

            def timed_sync(optimizer):
                sync()
                state["in_sync"], state["collective"] = True, 0.0
                t0 = time.perf_counter()
                try:
                    stats = inner_sync(optimizer)
                    sync()
                finally:
                    state["in_sync"] = False
                self.sync_s.append(time.perf_counter() - t0)
                self.collective_s.append(state["collective"])
                self.sync_stats = dict(stats)
                return stats

            # lightning_det.ops.distributed calls dist.all_reduce through the module attribute
            dist.all_reduce = timed_all_reduce
            strategy.sync_gradients = timed_sync

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step != self.last_step:  # an optimizer step finished (accumulation: every K)
                sync()
                t = time.perf_counter()
                self.step_s.append(t - self.t_prev)
                self.t_prev, self.last_step = t, trainer.global_step

        def on_train_end(self, trainer, pl_module) -> None:
            sync()
            if on_cuda:
                peak, kind = torch.cuda.max_memory_allocated(), "cuda.max_memory_allocated"
            else:
                peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"
            warm = self.step_s[WARMUP_STEPS:] or self.step_s
            params = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            rec = {
                "rank": trainer.global_rank, "world_size": trainer.world_size, "steps": trainer.global_step,
                "params": params, "step_ms": 1e3 * statistics.median(warm) if warm else None,
                "step_ms_all": [round(1e3 * s, 3) for s in self.step_s],
                "peak_bytes": int(peak), "peak_kind": kind,
                "det_verified": getattr(trainer.strategy, "det_verified", None),
            }
            if self.sync_s:
                n = self.sync_stats.get("elements") or params
                rec.update(sync_ms=1e3 * statistics.median(self.sync_s[WARMUP_STEPS:] or self.sync_s),
                           allreduce_ms=1e3 * statistics.median(self.collective_s[WARMUP_STEPS:] or self.collective_s),
                           allreduce_bytes_per_step=self.sync_stats.get("bytes", 0),
                           allreduce_bytes_per_element=self.sync_stats.get("bytes", 0) / n if n else None,
                           allreduce_fallback_elements=self.sync_stats.get("fallback_elements"),
                           allreduce_what="det_ddp windowed int64 digit all-reduce (agreement + packed SUM)")
            else:
                rec.update(sync_ms=None, allreduce_ms=None, allreduce_bytes_per_step=4 * params,
                           allreduce_bytes_per_element=4.0 if trainer.world_size > 1 else 0.0,
                           allreduce_fallback_elements=None,
                           allreduce_what="DDP fp32 gradient buckets (4 bytes per element; time not measured)")
                if trainer.world_size == 1:
                    rec["allreduce_bytes_per_step"] = 0
            (run_dir / f"metrics-rank{trainer.global_rank}.json").write_text(json.dumps(rec, indent=1) + "\n")

    run_then_destroy_process_group(gpt_char.main, gpt_argv, callbacks=[Bench()])


# ---- the parent ------------------------------------------------------------------------------
def child_env(accelerator: str) -> dict:
    """A clean environment: no inherited torch/Lightning/pytest state; what CUDA, NCCL and the
    GPU image's OpenMPI need is kept (Lightning imports mpi4py where it is installed)."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "LD_LIBRARY_PATH", "LIGHTNING_DET_BUILD_DIR",
            "LIGHTNING_DET_NO_CUDA", "LDET_COMMIT", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES",
            "TORCH_CUDA_ARCH_LIST", "MAX_JOBS", "CC", "CXX", "TORCH_EXTENSIONS_DIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("OMPI_", "PMIX_", "OPAL_", "PRTE_", "NVIDIA_"))})
    env.update(PYTHONPATH=str(ROOT), PYTHONHASHSEED="0", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1" if accelerator == "cpu" else "2",
               # NVLink multicast stays off for both strategies (some multi-GPU hosts require it;
               # det_ddp would set the NCCL one itself, the ddp control would not)
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    return env


def plan_runs(world_sizes: list, accum: list, accum_ws: int) -> list:
    """(name, strategy, devices, accum) in an order that completes comparisons early."""
    runs = []
    for n in world_sizes:
        runs += [(f"det-ws{n}", "det_ddp", n, 1), (f"ddp-ws{n}", "ddp", n, 1)]
    runs += [(f"det-ws{accum_ws}-acc{k}", "det_ddp", accum_ws, k) for k in accum if k != 1]
    return runs


def launch(spec, args, out: Path, deadline: float) -> dict:
    name, strategy, devices, accum = spec
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in list(run_dir.glob("metrics-rank*.json")) + list((run_dir / "digests").glob("*")):
        f.unlink()
    gpt_argv = ["--strategy", strategy, "--devices", str(devices), "--accum", str(accum),
                "--accelerator", "gpu" if args.accelerator == "cuda" else "cpu", "--steps", str(args.steps),
                "--batch-size", str(args.batch_size), "--seed", str(args.seed), "--digests", str(run_dir / "digests"),
                "--no-progress-bar", *args.gpt_args]
    if args.accelerator == "cpu":
        gpt_argv += ["--threads", "1"]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(run_dir), "--", *gpt_argv]
    row = {"run": name, "strategy": strategy, "world_size": devices, "accum": accum, "cmd": " ".join(cmd[1:])}
    timeout = min(args.run_timeout, deadline - time.monotonic())
    if timeout < 20:
        row.update(status="skipped", why="total time budget (--budget-s) spent")
        return row
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=child_env(args.accelerator), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
        log, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        log = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")) + \
              ((exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
        rc = "timeout"
    row["wall_s"] = round(time.monotonic() - t0, 1)
    (run_dir / "log.txt").write_text(log)
    ranks = [json.loads(p.read_text()) for p in sorted(run_dir.glob("metrics-rank*.json"))]
    if rc != 0 or not ranks:
        row.update(status="failed", why=f"exit {rc}", log_tail=log[-3000:])
        print(f"--- {name} failed ({rc}); last lines of {run_dir / 'log.txt'}:\n{log[-3000:]}", flush=True)
        return row
    r0 = next(r for r in ranks if r["rank"] == 0)
    row.update(status="ok", steps=r0["steps"], params=r0["params"], step_ms=r0["step_ms"],
               peak_bytes=max(r["peak_bytes"] for r in ranks), peak_bytes_rank0=r0["peak_bytes"],
               peak_kind=r0["peak_kind"], det_verified=r0["det_verified"],
               **{k: r0[k] for k in ("sync_ms", "allreduce_ms", "allreduce_bytes_per_step",
                                      "allreduce_bytes_per_element", "allreduce_fallback_elements",
                                      "allreduce_what")})
    final = [ln for ln in log.splitlines() if ln.startswith("gpt_char: steps=")]
    row["final"] = final[-1] if final else None
    return row


def compare(out: Path, a: str, b: str, kind: str, rows: dict) -> dict:
    from lightning_det.cli.diff import format_result
    from lightning_det.digest.compare import diff_runs, diff_step, load_run

    rec = {"a": a, "b": b, "kind": kind,
           "cli": f"lightning-det diff {out / a / 'digests'} {out / b / 'digests'}"}
    if rows.get(a, {}).get("status") != "ok" or rows.get(b, {}).get("status") != "ok":
        rec.update(verdict="missing", text="one of the runs did not finish")
        return rec
    ra, rb = load_run(out / a / "digests"), load_run(out / b / "digests")
    res = diff_runs(ra, rb)
    rec.update(text=format_result(res, max_tensors=6), identical=bool(res["identical"]),
               common_steps=res["common_steps"], first_step=res.get("step"),
               sections=sorted({d["section"] for d in res.get("differences", [])}))
    if kind == "accum":
        # every step, every rank both have, every section but the loss
        bad = None
        for r in sorted(set(ra.ranks) & set(rb.ranks)):
            for s in sorted(set(ra.steps[r]) & set(rb.steps[r])):
                diffs = [d for d in diff_step(ra.steps[r][s], rb.steps[r][s]) if d["section"] != "loss"]
                if diffs and (bad is None or s < bad[0]):
                    bad = (s, r, sorted({d["section"] for d in diffs}))
                    break
        rec["identical_except_loss"] = bad is None
        rec.update(first_step=bad[0], sections=bad[2]) if bad else rec.update(first_step=None, sections=[])
        ok = bad is None and res["common_steps"] > 0
        rec["verdict"] = "identical except the recorded loss" if ok else f"DIFFERS at step {bad and bad[0]}"
        rec["pass"] = ok
    elif kind == "det":
        rec["pass"] = bool(res["identical"])
        rec["verdict"] = "identical" if res["identical"] else f"DIFFERS at step {res.get('step')}"
    else:  # control: expected to differ
        rec["verdict"] = "identical" if res["identical"] else f"differs from step {res.get('step')}"
    return rec


def comparisons(out: Path, rows: dict, world_sizes: list, accum: list, accum_ws: int) -> list:
    pairs = [(f"det-ws1", f"det-ws{n}", "det") for n in world_sizes if n != 1]
    for k in accum:
        if k != 1:
            pairs += [(f"det-ws{accum_ws}", f"det-ws{accum_ws}-acc{k}", "accum")]
            if accum_ws != 1:
                pairs += [("det-ws1", f"det-ws{accum_ws}-acc{k}", "accum")]
    pairs += [("ddp-ws1", f"ddp-ws{n}", "control") for n in world_sizes if n != 1]
    pairs += [(f"ddp-ws{a}", f"ddp-ws{b}", "control") for a, b in zip(world_sizes[1:], world_sizes[2:])]
    pairs += [("det-ws1", "ddp-ws1", "control")]
    return [compare(out, a, b, kind, rows) for a, b, kind in pairs]


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def table(rows: list, comps: list, header: str) -> str:
    lines = [header, "", "| run | status | steps | step ms (median) | peak MiB (max over ranks) | sync ms | "
             "all-reduce ms | all-reduce bytes/elem | all-reduce MB/step | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['status']} | {r.get('steps', '-')} | {_f(r.get('step_ms'))} | "
                     f"{_mb(r.get('peak_bytes'))} | {_f(r.get('sync_ms'))} | {_f(r.get('allreduce_ms'), '{:.3f}')} | "
                     f"{_f(r.get('allreduce_bytes_per_element'))} | {_mb(r.get('allreduce_bytes_per_step'))} | "
                     f"{r.get('wall_s', '-')} |")
    by = {r["run"]: r for r in rows if r["status"] == "ok"}
    ratios = []
    for name, det in by.items():
        ddp = by.get(name.replace("det-", "ddp-"))
        if name.startswith("det-") and "-acc" not in name and ddp:
            ratios.append(f"| {det['world_size']} | {det['step_ms'] / ddp['step_ms']:.2f}x | "
                          f"{det['peak_bytes'] / ddp['peak_bytes']:.2f}x | {_f(det.get('allreduce_bytes_per_element'))}"
                          f" vs {_f(ddp.get('allreduce_bytes_per_element'))} |")
    if ratios:
        lines += ["", "| world size | det_ddp / ddp step time | det_ddp / ddp peak memory | all-reduce bytes/elem "
                  "(det vs ddp) |", "|---|---|---|---|", *ratios]
    lines += ["", "| pair | kind | verdict | first differing step | sections |", "|---|---|---|---|---|"]
    for c in comps:
        lines.append(f"| {c['a']} vs {c['b']} | {c['kind']} | {c['verdict']} | {c.get('first_step') or '-'} | "
                     f"{', '.join(c.get('sections') or []) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        rest = argv[2:]
        child(Path(argv[1]), rest[1:] if rest[:1] == ["--"] else rest)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--world-sizes", help="comma list (default: 1,2,4,8 up to the GPUs present on cuda; 1,2 on cpu)")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 200 on cuda, 8 on cpu)")
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch, the same in every run")
    p.add_argument("--accum", default="1,4", help="accumulate_grad_batches values of the accumulation runs (1 = det-wsA itself)")
    p.add_argument("--accum-world-size", type=int,
                   help="world size A of the accumulation runs (default: the largest one where batch/(A*K) is whole)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="working folder of the runs: digests, metrics, logs (default: a new temporary folder)")
    p.add_argument("--results", help="results file (default benchmarks/results/<device>-multi_gpu.json)")
    p.add_argument("--run-timeout", type=float, default=420, help="seconds per run")
    p.add_argument("--budget-s", type=float, default=0,
                   help="stop starting runs when this many seconds have passed (0: none); under a limit on "
                        "the command's time, leave margin (e.g. 560 for 600 s)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time (1 for timings; more only to save wall time in CPU tests)")
    p.add_argument("--gpt-args", default="", help="extra examples/gpt_char.py arguments, one string (model size etc.)")
    args = p.parse_args(argv)
    args.gpt_args = args.gpt_args.split()

    import torch
    from _common import results_path, write

    if args.accelerator == "cuda":
        if not torch.cuda.is_available():
            p.error("--accelerator cuda: no CUDA GPU here")
        present = torch.cuda.device_count()
        default_ws = [n for n in (1, 2, 4, 8) if n <= present]
    else:
        present, default_ws = os.cpu_count(), [1, 2]
    world_sizes = [int(x) for x in args.world_sizes.split(",")] if args.world_sizes else default_ws
    if world_sizes[0] != 1:
        world_sizes = [1] + [n for n in world_sizes if n != 1]  # everything is compared with world size 1
    if args.accelerator == "cuda" and max(world_sizes) > present:
        p.error(f"--world-sizes {world_sizes}: only {present} GPU(s) here")
    accum = [int(x) for x in args.accum.split(",") if x]
    for n in world_sizes:
        if args.batch_size % n:
            p.error(f"--batch-size {args.batch_size} must be divisible by every world size ({world_sizes})")
    kmax = max(accum) if accum else 1
    fits = [n for n in world_sizes if args.batch_size % (n * kmax) == 0]
    accum_ws = args.accum_world_size or (max(fits) if fits else None)
    if accum_ws is None or args.batch_size % (accum_ws * kmax):
        p.error(f"--batch-size {args.batch_size}: no world size A with a whole micro-batch at accum {kmax}")
    if accum_ws not in world_sizes:
        p.error(f"--accum-world-size {accum_ws} must be one of --world-sizes {world_sizes}")
    args.steps = args.steps or (200 if args.accelerator == "cuda" else 8)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="multi_gpu-"))
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results) if args.results else results_path("multi_gpu", args.accelerator)
    t_start = time.monotonic()
    deadline = t_start + (args.budget_s or 1e9)

    specs = plan_runs(world_sizes, accum, accum_ws)
    config = {"model": "examples/gpt_char.py (defaults: 115k parameters, seq 32)" +
                       (f" + {' '.join(args.gpt_args)}" if args.gpt_args else ""),
              "global_batch": args.batch_size, "steps": args.steps, "world_sizes": world_sizes, "accum": accum,
              "accum_world_size": accum_ws, "seed": args.seed, "accelerator": args.accelerator,
              "backend": "nccl" if args.accelerator == "cuda" else "gloo", "warmup_steps_left_out": WARMUP_STEPS,
              "step_time": "median interval between optimizer steps on rank 0 (DigestCallback included)",
              "peak_memory": "max over ranks: torch.cuda.max_memory_allocated (cuda) / peak RSS (cpu)"}
    print(f"multi_gpu: {len(specs)} runs, world sizes {world_sizes}, accum {accum} at world size {accum_ws}, "
          f"global batch {args.batch_size}, {args.steps} steps, out {out}", flush=True)
    rows: dict = {}

    def finish(rows_now: dict) -> tuple:
        comps = comparisons(out, rows_now, world_sizes, accum, accum_ws)
        det_ok = all(c.get("pass") for c in comps if c["kind"] in ("det", "accum"))
        control = [c for c in comps if c["kind"] == "control" and c["verdict"] != "missing"]
        control_differs = any(not c.get("identical", True) for c in control)
        ok = det_ok and control_differs and all(r["status"] == "ok" for r in rows_now.values()) \
            and len(rows_now) == len(specs)
        verdict = {"det_identical": det_ok, "control_differs": control_differs, "pass": ok,
                   "complete": len(rows_now) == len(specs), "elapsed_s": round(time.monotonic() - t_start, 1)}
        ordered = [rows_now[s[0]] for s in specs if s[0] in rows_now]
        write("multi_gpu", args.accelerator, ordered, path=results,
              extra={"config": config, "comparisons": comps, "verdict": verdict})
        head = (f"multi_gpu ({args.accelerator}, {config['backend']}): global batch {args.batch_size}, "
                f"{args.steps} steps, world sizes {world_sizes}, accum {accum} at world size {accum_ws}")
        return comps, verdict, ordered, head

    def one(spec):
        row = launch(spec, args, out, deadline)
        print(f"{spec[0]}: {row['status']} ({row.get('wall_s', '-')} s) step {_f(row.get('step_ms'))} ms, "
              f"peak {_mb(row.get('peak_bytes'))} MiB", flush=True)
        return row

    if args.jobs > 1:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for spec, row in zip(specs, pool.map(one, specs)):
                rows[spec[0]] = row
    else:
        for spec in specs:
            rows[spec[0]] = one(spec)
            finish(rows)
    comps, verdict, ordered, head = finish(rows)
    for c in comps:
        print(f"\n$ {c['cli']}\n{c.get('text', '')}")
    print()
    print(table(ordered, comps, head))
    print(f"\nwrote {results}; the runs are in {out}")
    print(f"multi_gpu {'PASS' if verdict['pass'] else 'FAIL'}: det_ddp identical across world sizes and accumulation: "
          f"{verdict['det_identical']}; ddp control differs: {verdict['control_differs']}; "
          f"all runs finished: {verdict['complete'] and all(r['status'] == 'ok' for r in ordered)}")
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
