"""Deterministic causal attention forward + backward against F.scaled_dot_product_attention, one run.

    python benchmarks/attention.py                          # CUDA, the binding shapes (issue 31), bf16
    python benchmarks/attention.py --dtypes bfloat16,float32 --seqs 1024,2048
    python benchmarks/attention.py --tiny --out /tmp/att.json   # a few small shapes on the CPU (a smoke run)

Binding shapes: batch 8, d_model 768 as 12 heads of 64 and as 6 heads of 128, seq 1024, 2048,
4096, 8192, bf16; 2 warm-up calls, median of 5. --tiny: batch 1, 2 heads of 32 and 1 head of 64,
seq 64 and 128, 1 warm-up call, median of 3, on the CPU; a smoke run, never the binding result.

One timed call is ``fn(q, k, v, is_causal=True).backward(go)`` with q.grad, k.grad, v.grad cleared
first, where fn is lightning_det.nn.det_scaled_dot_product_attention (ours, the fused kernels,
called as a user would) or torch.nn.functional.scaled_dot_product_attention of the same dtype (the
baseline; on CUDA bf16/fp16 forced to the flash backend, fp32 left to PyTorch's choice, since
flash does not take fp32). q, k, v (B, H, L, E) and go ~ randn from fixed seeds, the same tensors
for both. ratio = baseline_ms / ours_ms, a speed ratio (higher is better; issue 31's target is
>= 0.3). Times: median of --repeats calls after --warmup (benchmarks/_common.py time_fn; CUDA
events). Memory (CUDA only; None on CPU): peak_bytes = torch.cuda.max_memory_allocated() over one
call after reset_peak_memory_stats(), extra_bytes = peak_bytes minus what was allocated before
the call (q, k, v, go). A variant that runs out of GPU memory is recorded as "oom" (its memory is
freed and the run goes on); the row's "oom" lists which did not fit. out_max_abs_diff: max
|ours - baseline| of the forward outputs, a check that both computed the same attention. TF32 off.

Writes benchmarks/results/<device>-attention.json (or --out) after every row, "complete": false
until the last one, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import call_peak_memory, time_fn, write  # noqa: E402

from lightning_det.nn import det_scaled_dot_product_attention  # noqa: E402

BINDING = {"batch": 8, "heads": [(12, 64), (6, 128)], "seqs": [1024, 2048, 4096, 8192], "warmup": 2, "repeats": 5}
TINY = {"batch": 1, "heads": [(2, 32), (1, 64)], "seqs": [64, 128], "warmup": 1, "repeats": 3}
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def _dt(dtype):
    return str(dtype).replace("torch.", "")


def baseline_backend(dtype, device):
    """(context, label) of the baseline: flash on CUDA for 16-bit dtypes, PyTorch's choice otherwise."""
    if device == "cuda" and dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION]), "flash"
    return contextlib.nullcontext(), "default"


def inputs(batch, heads, seq, hdim, dtype, device):
    """q, k, v (requires grad) and go, (batch, heads, seq, hdim), randn from fixed seeds on the device."""
    g = torch.Generator(device=device)
    out = []
    for seed in range(4):
        g.manual_seed(seed)
        t = torch.randn(batch, heads, seq, hdim, generator=g, device=device, dtype=torch.float32).to(dtype)
        out.append(t.requires_grad_(seed < 3))
    return out


def measure(fn, ctx, q, k, v, go, device, warmup, repeats):
    """{ms, peak_bytes, extra_bytes} of one variant, and its forward output (detached)."""
    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v, is_causal=True).backward(go)

    with ctx:
        ms = 1e3 * time_fn(step, device, warmup=warmup, repeat=repeats)
        q.grad = k.grad = v.grad = None  # "before" is then q, k, v alone
        peak, extra = call_peak_memory(step, device)
        q.grad = k.grad = v.grad = None
        with torch.no_grad():
            out = fn(q, k, v, is_causal=True)
    return {"ms": ms, "peak_bytes": peak, "extra_bytes": extra}, out


def free(device):
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def attempt(fn, ctx, q, k, v, go, device, warmup, repeats):
    """measure(), or ({ms, peak_bytes, extra_bytes: "oom"}, None) when the GPU runs out of memory."""
    try:
        return measure(fn, ctx, q, k, v, go, device, warmup, repeats)
    except torch.cuda.OutOfMemoryError:
        pass  # leave the except block first: its traceback holds the call's tensors
    q.grad = k.grad = v.grad = None
    free(device)
    return {"ms": "oom", "peak_bytes": "oom", "extra_bytes": "oom"}, None


def run_shape(batch, heads, hdim, seq, dtype, device, warmup, repeats):
    """One row: ours and the baseline on the same inputs."""
    ctx, backend = baseline_backend(dtype, device)
    row = {"op": "sdpa_causal_fwd_bwd", "batch": batch, "heads": heads, "hdim": hdim, "d_model": heads * hdim,
           "seq": seq, "dtype": _dt(dtype), "ours": "det_scaled_dot_product_attention",
           "baseline": f"F.scaled_dot_product_attention {_dt(dtype)} ({backend})"}
    try:
        q, k, v, go = inputs(batch, heads, seq, hdim, dtype, device)
    except torch.cuda.OutOfMemoryError:
        q = k = v = go = None
    if q is None:  # not even the inputs fit
        free(device)
        oom = {"ms": "oom", "peak_bytes": "oom", "extra_bytes": "oom"}
        base = ours = oom
        diff = None
    else:
        base, base_out = attempt(F.scaled_dot_product_attention, ctx, q, k, v, go, device, warmup, repeats)
        free(device)
        ours, ours_out = attempt(det_scaled_dot_product_attention, contextlib.nullcontext(), q, k, v, go, device,
                                 warmup, repeats)
        diff = None
        if base_out is not None and ours_out is not None:
            diff = float((ours_out.float() - base_out.float()).abs().max())
        del q, k, v, go, base_out, ours_out
        free(device)
    ok = isinstance(ours["ms"], float) and isinstance(base["ms"], float)
    row.update({"ours_ms": ours["ms"], "baseline_ms": base["ms"],
                "ratio": base["ms"] / ours["ms"] if ok else None,
                "meets_target_0.3x": base["ms"] / ours["ms"] >= 0.3 if ok else None,
                "ours_peak_bytes": ours["peak_bytes"], "baseline_peak_bytes": base["peak_bytes"],
                "ours_extra_bytes": ours["extra_bytes"], "baseline_extra_bytes": base["extra_bytes"],
                "out_max_abs_diff": diff,
                "oom": [name for name, m in (("ours", ours), ("baseline", base)) if m["ms"] == "oom"]})
    return row


def _ms(v):
    return f"{v:10.3f} ms" if isinstance(v, float) else f"{v:>13s}"


def _mib(v):
    return f"{v / 2**20:9.1f} MiB" if isinstance(v, int) else f"{str(v):>13s}"


def show(r):
    ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "  -   "
    mem = ""
    if r["ours_peak_bytes"] is not None:
        mem = f"  peak {_mib(r['ours_peak_bytes'])} vs {_mib(r['baseline_peak_bytes'])}"
    diff = f"  |diff| {r['out_max_abs_diff']:.3g}" if r["out_max_abs_diff"] is not None else ""
    print(f"{r['dtype']:8s} B {r['batch']} H {r['heads']:2d} E {r['hdim']:3d} L {r['seq']:5d}  "
          f"ours {_ms(r['ours_ms'])} vs {_ms(r['baseline_ms'])}  ratio {ratio}{mem}{diff}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda (cpu with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a few small shapes (a smoke run, not the binding shapes)")
    p.add_argument("--batch", type=int, default=None, help=f"default {BINDING['batch']} ({TINY['batch']} with --tiny)")
    p.add_argument("--heads", default=None,
                   help="comma-separated HEADS:HDIM (default 12:64,6:128; 2:32,1:64 with --tiny)")
    p.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 1024,2048,4096,8192; "
                                                "64,128 with --tiny)")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated, of bfloat16, float32, float16")
    p.add_argument("--warmup", type=int, default=None, help="calls before timing (default 2; 1 with --tiny)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls, median taken (default 5; 3 with --tiny)")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/<device>-attention.json)")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (--tiny runs on the CPU)")
    shapes = TINY if args.tiny else BINDING
    args.warmup = shapes["warmup"] if args.warmup is None else args.warmup
    args.repeats = shapes["repeats"] if args.repeats is None else args.repeats
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    batch = args.batch or shapes["batch"]
    heads = [tuple(int(x) for x in s.split(":")) for s in args.heads.split(",")] if args.heads else shapes["heads"]
    seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else shapes["seqs"]
    try:
        dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",")]
    except KeyError as err:
        p.error(f"--dtypes: unknown {err}; choose among {sorted(DTYPES)}")
    # the fp32 baseline is true fp32: TF32 would make it faster and less accurate
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    extra = {"tiny": args.tiny, "tf32": False, "causal": True, "warmup": args.warmup, "repeats": args.repeats,
             "timed": "fn(q, k, v, is_causal=True).backward(go), grads cleared, median after warm-up",
             "ratio": "baseline_ms / ours_ms (speed; higher is better; target >= 0.3)"}
    rows, out, t0 = [], None, time.perf_counter()
    for dtype in dtypes:
        for h, e in heads:
            for seq in seqs:
                rows.append(run_shape(batch, h, e, seq, dtype, args.device, args.warmup, args.repeats))
                show(rows[-1])
                out = write("attention", args.device, rows, path=args.out, extra={**extra, "complete": False})
    out = write("attention", args.device, rows, path=args.out,
                extra={**extra, "complete": True, "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
