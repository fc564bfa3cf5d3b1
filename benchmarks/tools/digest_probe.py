"""Where DigestCallback's cost in gpt_step's det-bf16-digest run goes: host time per step of each
of its hooks, and the device time of the step's digests alone.

    python benchmarks/tools/digest_probe.py [--steps 16] [--gpt-layers 12]
    python benchmarks/tools/digest_probe.py --tiny        # a smoke run on the CPU

Runs benchmarks/gpt_step.py's det-bf16-digest run (its shape, fewer steps) with the callback's
methods timed on the host (perf_counter around each call; nested calls are counted in both). Then
times ``digest_many_async`` + ``result()`` over the same tensors (parameters, gradients, optimizer
state) with the device synchronized: the hashing itself.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--gpt-layers", type=int, default=12)
    p.add_argument("--tiny", action="store_true", help="gpt_step's tiny shape on the CPU (a smoke run)")
    args = p.parse_args()
    import gpt_step
    from lightning_det.callbacks import digest as cb
    from lightning_det import digest as dg

    spent = collections.defaultdict(list)

    def timed(owner, name, label):
        real = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[label].append((time.perf_counter() - t) * 1e3)

        setattr(owner, name, wrapper)

    for name in ("_after_optimizer_step", "on_train_batch_end", "_finish", "_drain", "_sections"):
        timed(cb.DigestCallback, name, f"DigestCallback.{name}")
    timed(cb, "rng_digests", "rng_digests")
    timed(cb, "digest_many_async", "digest_many_async")
    timed(cb.DigestCallback, "_write", "DigestCallback._write")

    seen = {}
    real_async = cb.digest_many_async

    def keep(tensors):
        seen["tensors"] = list(tensors)
        return real_async(seen["tensors"])

    cb.digest_many_async = keep
    shape = {**(gpt_step.TINY if args.tiny else gpt_step.GPT2_SMALL), "steps": args.steps}
    if not args.tiny:
        shape["n_layers"] = args.gpt_layers
    cuda = not args.tiny
    ids, _ = gpt_step.stdlib_tokens(shape["max_chars"], shape["vocab"])
    ds = gpt_step.Windows(ids, shape["seq_len"])
    run_args = argparse.Namespace(device="cuda" if cuda else "cpu", seed=0, lr=3e-4)
    restore = gpt_step.plain_settings()
    rows = [gpt_step.run(name, det, prec, opt, shape, ds, shape["vocab"], run_args, restore)
            for name, det, prec, opt in gpt_step.RUNS if name in ("det-bf16", "det-bf16-digest")]
    for r in rows:
        print(f"{r['run']}: step {r['step_ms']} ms, window min {min(r['step_ms_window'])} ms")
    half = args.steps // 2
    for label, ms in sorted(spent.items()):
        tail = ms[half:] or ms
        print(f"{label:40s} calls {len(ms):4d}  median {statistics.median(tail):8.3f} ms  max {max(tail):8.3f} ms")
    tensors = seen["tensors"]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    for _ in range(3):
        dg.digest_many_async(tensors).result()
    if cuda:
        torch.cuda.synchronize()
    reps, t = 10, time.perf_counter()
    for _ in range(reps):
        dg.digest_many_async(tensors).result()
    ms = (time.perf_counter() - t) / reps * 1e3
    print(f"digest_many of the step's {len(tensors)} tensors ({nbytes / 2**30:.2f} GiB): {ms:.2f} ms "
          f"({nbytes / ms / 1e6:.0f} GB/s), synchronized")


if __name__ == "__main__":
    main()
