"""Host work per exact GEMM and per training step, counted: the aten ops each ldet op issues.

    python benchmarks/tools/host_ops.py                  # CPU
    python benchmarks/tools/host_ops.py --device cuda    # the GPU's routes (cuBLASLt GEMMs are no aten op)

Why counts, not times: a det_ddp step on one GPU can be host-bound, and each aten op costs the
host a few microseconds whatever the machine, so the counts say where host time goes without a
timed run. Reported: the aten ops directly under one slices det_gemm (one
N-chunk, and several), and the ops of one forward + backward of benchmarks/ddp_step.py's model
grouped by the op or autograd function that issued them. Prints them; --out also writes them as
JSON.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: _common
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))


def issuer(event) -> str | None:
    """The nearest ancestor that is not an aten op (an ldet op, an autograd function), or None."""
    p = event.cpu_parent
    while p is not None and p.name.startswith("aten::"):
        p = p.cpu_parent
    return None if p is None else p.name


def top_level_aten(events):
    """aten ops whose parent is not an aten op: the ones the caller issued itself."""
    return [e for e in events if e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))]


def profile(fn):
    fn()  # warm-up: plan caches, allocator
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return prof.events()


def gemm_counts(device: str, M: int, N: int, K: int) -> dict:
    from lightning_det.ops import det_gemm, gemm_path

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(M, K, generator=g).to(device), torch.randn(N, K, generator=g).to(device)
    with gemm_path("slices"):
        evs = profile(lambda: det_gemm(x, w))
    under = [e for e in top_level_aten(evs) if issuer(e) == "ldet::gemm"]
    c = collections.Counter(e.name for e in under)
    return {"shape": [M, N, K], "aten_ops_under_ldet_gemm": len(under), "by_name": dict(c.most_common())}


def step_counts(device: str, width: int, batch: int) -> dict:
    import torch.nn.functional as F

    from lightning_det import global_mean
    from _common import step_model
    from lightning_det.nn import det_function_mode, det_transform
    from lightning_det.parallel.loss import global_loss_reduce

    net = step_model(width)
    det_transform(net)
    net = net.to(device)
    x = torch.randint(0, 512, (batch,), device=device)
    y = (x * 7 + 3) % 512

    def step():
        with det_function_mode(strict=True, loss_reduce=global_loss_reduce):  # as det_ddp's training_step
            loss = global_mean(F.cross_entropy(net(x), y, reduction="none"))
        loss.backward()
        for p in net.parameters():  # the strategy's gradient sync is left out: ops of the model only
            p.grad = None

    evs = profile(step)
    tops = top_level_aten(evs)
    by = collections.Counter(issuer(e) or "(python)" for e in tops)
    ldet = collections.Counter(e.name for e in evs if e.name.startswith("ldet::"))
    return {"width": width, "batch": batch, "aten_ops": len(tops), "by_issuer": dict(by.most_common()),
            "ldet_ops": dict(ldet.most_common())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from _common import write

    torch.set_num_threads(1)
    rows = [gemm_counts(a.device, 512, 512, 256)]
    os.environ["LIGHTNING_DET_SLICES_CHUNK_MIB"] = "1"  # several N-chunks: per-chunk views and copies
    rows.append({**gemm_counts(a.device, 512, 512, 256), "chunk_mib": 1})
    del os.environ["LIGHTNING_DET_SLICES_CHUNK_MIB"]
    step = step_counts(a.device, 64 if a.device == "cpu" else 1024, 512 if a.device == "cpu" else 4096)
    for r in rows:
        print(f"det_gemm {r['shape']}{' (1 MiB chunks)' if 'chunk_mib' in r else ''}: "
              f"{r['aten_ops_under_ldet_gemm']} aten ops {r['by_name']}")
    print(f"forward + backward: {step['aten_ops']} aten ops; by issuer {step['by_issuer']}")
    if a.out:
        print(f"wrote {write('host_ops', a.device, rows, extra={'step': step}, path=a.out)}")


if __name__ == "__main__":
    main()
