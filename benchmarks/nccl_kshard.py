"""A K-sharded exact GEMM reduced across processes equals the one-process GEMM.

    torchrun --standalone --nproc-per-node 8 benchmarks/nccl_kshard.py --out $OUT/nccl_kshard.json   # NCCL
    torchrun --standalone --nproc-per-node 2 benchmarks/nccl_kshard.py --device cpu                  # gloo

Every rank builds the same seeded x (M, K) and w (N, K) (values spread over 2^-24..2^24, so float
sums depend on their order) and cuts K at seeded, uneven boundaries, one shard per rank. Per
dtype (fp32, bf16):

  exact path   acc_r = det_gemm_partial(x[:, shard_r], w[:, shard_r]); det_all_reduce(acc_r) (one
               int64 SUM all-reduce of the digits) and det_all_reduce_windowed(acc_r); det_finalize.
               Both must be torch.equal to det_gemm(x, w) over the whole K in one process (every
               rank computes that reference), and the two reduced digit arrays must be equal.
  digests      every rank hashes its result (lightning_det.digest.tensor_digest, ldet-digest-v1);
               the digests are all-gathered and must be the same on every rank and equal to the
               reference's.
  control      torch.mm on each shard in the same dtype, fp32 SUM all-reduce, compared with
               torch.mm over the whole K: reported (differs or not, how many elements, largest
               difference); with one process there is nothing to differ.

Then it times, on a gradient-like payload of --time-elements elements per rank (CUDA-synchronized,
median of --repeat after warm-up): det_all_reduce of the digits (19 int64 = 152 bytes per
element), det_all_reduce_windowed (bytes per element as it reports), and an fp32 all_reduce of the
same element count (4 bytes per element, what plain DDP sends).

Rank 0 prints one PASS/FAIL line last and writes JSON (--out, default
benchmarks/results/<device>-nccl_kshard.json, its world size inside). Exit status 0 on PASS on every rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from lightning_det.digest import tensor_digest  # noqa: E402
from lightning_det.ops import det_finalize, det_gemm, det_gemm_partial, to_digits  # noqa: E402
from lightning_det.ops.distributed import det_all_reduce, det_all_reduce_windowed  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_inputs(m: int, n: int, k: int, seed: int, dtype: torch.dtype):
    """The same x (m, k), w (n, k) on every rank: mantissas from randn, exponents over +-24 bits."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return (torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 13, shape, generator=g).float()))

    return draw(m, k).to(dtype), draw(n, k).to(dtype)


def shard_bounds(k: int, world: int, seed: int) -> list:
    """``world`` uneven, non-empty K-ranges from seeded cut points (the same on every rank)."""
    if world == 1:
        return [(0, k)]
    g = torch.Generator().manual_seed(seed + 7919)
    cuts = sorted(torch.randperm(k - 1, generator=g)[: world - 1].add(1).tolist())
    edges = [0, *cuts, k]
    return list(zip(edges[:-1], edges[1:]))


def timed(fn, device: torch.device, warmup: int, repeat: int) -> float:
    """Median seconds of fn() after warm-up; every rank starts together (barrier), CUDA synchronized."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_dtype(name: str, args, device: torch.device, rank: int, world: int) -> dict:
    dtype = DTYPES[name]
    x_cpu, w_cpu = make_inputs(args.m, args.n, args.k, args.seed, dtype)
    x, w = x_cpu.to(device), w_cpu.to(device)
    bounds = shard_bounds(args.k, world, args.seed)
    lo, hi = bounds[rank]
    xs, ws = x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous()

    # exact path: digits of this rank's shard, one int64 SUM all-reduce, one rounding
    acc = det_gemm_partial(xs, ws)
    summed = det_all_reduce(acc)
    y = det_finalize(summed)
    summed_w, bpe_windowed = det_all_reduce_windowed(acc)
    y_windowed = det_finalize(summed_w)
    ref = det_gemm(x, w)  # one process, the whole K
    checks = {
        "all_reduce_equals_single_process": torch.equal(y, ref),
        "windowed_equals_single_process": torch.equal(y_windowed, ref),
        "windowed_digits_equal_full_digits": torch.equal(summed_w, summed),
    }

    # the digests of the result on every rank
    digest = tensor_digest(y)
    gathered = [None] * world
    dist.all_gather_object(gathered, digest)
    ref_digest = tensor_digest(ref)
    checks["digests_equal_on_every_rank"] = len(set(gathered)) == 1
    checks["digest_equals_reference"] = gathered[0] == ref_digest

    # control: float partial sums + float all-reduce against the float GEMM over the whole K
    part = torch.mm(xs, ws.t())
    part32 = part.float()
    dist.all_reduce(part32, op=dist.ReduceOp.SUM)
    ctl = part32.to(dtype)
    full = torch.mm(x, w.t())
    diff = ctl.float() != full.float()
    control = {
        "differs": bool(diff.any()),
        "elements_differing": int(diff.sum()),
        "elements": diff.numel(),
        "max_abs_difference": float((ctl.float() - full.float()).abs().max()),
        "what": f"torch.mm per shard ({name}), fp32 SUM all-reduce, rounded to {name}; vs torch.mm over the whole K",
    }
    return {"dtype": name, "m": args.m, "n": args.n, "k": args.k, "shards": [list(b) for b in bounds],
            "checks": checks, "pass": all(checks.values()), "digests": gathered, "reference_digest": ref_digest,
            "windowed_bytes_per_element": bpe_windowed, "control": control}


def timings(args, device: torch.device, rank: int) -> dict:
    e = args.time_elements
    g = torch.Generator().manual_seed(args.seed + 1000 + rank)  # each rank its own gradient-like values
    grad = (torch.randn(e, generator=g) * 1e-3).to(device)
    digits = to_digits(grad)
    stats: dict = {}
    det_all_reduce_windowed(digits, stats=stats)
    buf32 = grad.clone()
    t_full = timed(lambda: det_all_reduce(digits), device, args.warmup, args.repeat)
    t_win = timed(lambda: det_all_reduce_windowed(digits), device, args.warmup, args.repeat)
    t_f32 = timed(lambda: dist.all_reduce(buf32, op=dist.ReduceOp.SUM), device, args.warmup, args.repeat)
    full_bpe = digits.shape[-1] * digits.element_size()
    return {
        "elements": e,
        "det_all_reduce": {"ms": 1e3 * t_full, "bytes_per_element": full_bpe,
                           "note": "clone + int64 SUM all-reduce + normalize"},
        "det_all_reduce_windowed": {"ms": 1e3 * t_win, "bytes_per_element": stats.get("bytes", 0) / e,
                                    "fallback_elements": stats.get("fallback_elements"),
                                    "note": "window agreement (MAX) + packed int64 SUM + unpack, local work included"},
        "fp32_all_reduce": {"ms": 1e3 * t_f32, "bytes_per_element": 4, "note": "what plain DDP sends per element"},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if present")
    p.add_argument("--m", type=int, help="rows of x (default 256 on cuda, 16 on cpu)")
    p.add_argument("--n", type=int, help="rows of w (default 256 on cuda, 12 on cpu)")
    p.add_argument("--k", type=int, help="the sharded dimension (default 8191 on cuda, 301 on cpu)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-elements", type=int, help="all-reduce timing payload (default 4M on cuda, 64k on cpu)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", help="JSON path (default benchmarks/results/<device>-nccl_kshard.json)")
    args = p.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    args.m = args.m or (256 if use_cuda else 16)
    args.n = args.n or (256 if use_cuda else 12)
    args.k = args.k or (8191 if use_cuda else 301)
    args.time_elements = args.time_elements or ((4 << 20) if use_cuda else (64 << 10))

    if "RANK" not in os.environ:  # a plain `python` call: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        from lightning_det.parallel.env import apply_strict_environment

        apply_strict_environment()  # NCCL settings (no NVLink multicast) before NCCL starts
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.k < world:
        raise SystemExit(f"--k {args.k} must be at least the world size {world} (one non-empty shard per rank)")
    try:
        results = [check_dtype(d, args, device, rank, world) for d in args.dtypes.split(",") if d]
        timing = timings(args, device, rank)
        ok = all(r["pass"] for r in results)
        oks = [None] * world
        dist.all_gather_object(oks, ok)
        ok = all(oks)
        if rank == 0:
            from _common import write

            dev = "cuda" if use_cuda else "cpu"
            backend = "nccl" if use_cuda else "gloo"
            path = write("nccl_kshard", dev, results, path=args.out,
                         extra={"world_size": world, "backend": backend, "timing": timing, "pass": ok,
                                "ranks_pass": oks})
            for r in results:
                c = r["control"]
                print(f"{r['dtype']}: M={r['m']} N={r['n']} K={r['k']} shards {r['shards']}: "
                      + ", ".join(f"{k}={v}" for k, v in r["checks"].items()))
                print(f"  digest {r['digests'][0][:16]}... on all {world} ranks; windowed reduce "
                      f"{r['windowed_bytes_per_element']:.2f} bytes/element")
                print(f"  control (float partial sums + fp32 all-reduce vs torch.mm over K): "
                      f"{'DIFFERS' if c['differs'] else 'same'} ({c['elements_differing']}/{c['elements']} elements, "
                      f"max |diff| {c['max_abs_difference']:.3g})")
            for name, t in timing.items():
                if isinstance(t, dict):
                    print(f"timing {name}: {t['ms']:.3f} ms for {timing['elements']} elements, "
                          f"{t['bytes_per_element']:.2f} bytes/element")
            print(f"wrote {path}")
            print(f"nccl_kshard {'PASS' if ok else 'FAIL'}: world size {world}, backend {backend}, "
                  f"exact K-sharded GEMM + det_all_reduce == single-process det_gemm, digests equal on every rank")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
