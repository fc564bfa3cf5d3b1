"""det_gemm throughput against torch.mm, same shapes, same device, one run.

    python benchmarks/gemm.py                # CPU at 512^3, normal data
    python benchmarks/gemm.py --device cuda  # GPU at 1024^3 and 4096^3 (normal, real and wide data),
                                             # then GPT-2-small's GEMMs on real data
    python benchmarks/gemm.py --device cuda --sizes "" --shapes gpt2 --routes ""   # those GEMMs alone
    python benchmarks/gemm.py --sizes 256 --data normal,real --out /tmp/gemm.json
    python benchmarks/gemm.py --device cuda --sizes 4096 --data wide --dtypes float32 --routes fp64,kernel

Writes benchmarks/results/<device>-gemm.json (or --out) after every row ("complete": false until the
last) with rows of
{op, dtype, data, M, N, K, ours_tflops, baseline_tflops, ratio, baseline, fp32_mm_tflops, source,
x_log2_span, w_log2_span}. ratio and ratio_vs_fp32_mm (speed ratios, above 1 faster than the
baseline) are medians over rounds that time the baseline and det_gemm back to back; the
throughputs are separate medians.
The baseline is torch.mm in the same dtype (fp32 with TF32 off); fp32_mm_tflops is torch.mm in
fp32 on the same shape, the yardstick of the performance issue. ours_* is det_gemm as users get it
(route "auto"); kernel_* and slices_* time each exact route on its own (lightning_det.ops.gemm_path,
the slices in the way the device's cost model picks), diagonals_* and crt_* the slices' two ways
forced: one int8 GEMM per diagonal of slice pairs, or per CRT modulus (csrc/crt.h; crt_moduli 0:
they cannot cover the products and the diagonals ran), fp64_* the fp64 route (csrc/fp64_bound.h;
fp64_undecided / fp64_exact: the shares of outputs its bound left to the compensated sum / of those
to the long accumulator), and routes_same_bytes checks that all of them returned the same bits on
these operands. --routes times only some of those routes (the others' fields are then absent).

Data kinds (--data), each an (M, K) x and an (N, K) w for det_gemm(x, w) = x @ w.T:
  normal  torch.randn, seeds 1 and 2 (fp32 and bf16).
  wide    adversarial: |values| in [1, 2) * 2^e, e uniform in [-40, 40], random signs; defeats the
          slices' fast path (bf16 by default; --dtypes float32 for the fp64 route's own row, best with
          --routes fp64,kernel: the slices take seconds a call there).
  real    values of the example model (examples/gpt_char.py after a short fp32 CPU training run;
          benchmarks/_real_data.py says exactly how they are captured), one layer per --layers
          entry and one row per GEMM of that layer (fp32 and bf16, rounded to nearest from fp32):
            fwd    x = input activations (tokens x in),   w = weight (out x in)
            dgrad  x = output gradients (tokens x out),   w = weight transposed (in x out)
            wgrad  x = output gradients^T (out x tokens), w = activations^T (in x tokens)
          Each operand: rows sampled with replacement (seeded) from the source matrix's rows;
          column j is source column j mod C (so K beyond the source width tiles each row; the
          capture has 4096 tokens, so wgrad's K up to 4096 is real tokens, untiled).
          The row's "source" says which layer, GEMM, source matrices and fill rule.
--shapes gpt2 (the GPU's default; "" none): the 15 GEMMs of a GPT-2-small step at 8192 tokens,
bf16, on real data: forward, dgrad and wgrad of each Linear (qkv 768 -> 2304, attention projection
768 -> 768, MLP 768 -> 3072 and 3072 -> 768, head 768 -> 50304), each with the values of the
gpt_char Linear of the same role (blocks.1.attn.qkv, blocks.1.attn.proj, blocks.1.mlp.0,
blocks.1.mlp.2, head) filled to the shape as above. Rounded to bf16 (out_dtype) like the step's
forward and dgrad GEMMs and like torch.mm bf16, the baseline; the row's "shape" names the Linear.
x_log2_span / w_log2_span: log2(max |v|) - log2(min nonzero |v|) of the operand as benchmarked,
the exponent spread the exact fast path has to cover.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import interleaved_ratio, time_fn, write  # noqa: E402

import _real_data  # noqa: E402

from lightning_det.ops import det_gemm, gemm_path, last_fp64_counts, last_slices_plan  # noqa: E402


DTYPES = {"normal": (torch.float32, torch.bfloat16), "wide": (torch.bfloat16,), "real": (torch.float32, torch.bfloat16)}
# GPT-2-small's Linears at 8192 tokens: (name, gpt_char layer of the same role, in, out)
GPT2_TOKENS = 8192
GPT2_LINEARS = (("qkv", "blocks.1.attn.qkv", 768, 2304), ("attn_proj", "blocks.1.attn.proj", 768, 768),
                ("mlp_up", "blocks.1.mlp.0", 768, 3072), ("mlp_down", "blocks.1.mlp.2", 3072, 768),
                ("head", "head", 768, 50304))


def gpt2_cases(tokens=GPT2_TOKENS):
    """(x, w, source) per GEMM of GPT-2-small's step: each Linear's fwd, dgrad and wgrad as (M, N, K)."""
    for name, layer, d_in, d_out in GPT2_LINEARS:
        for gemm, (M, N, K) in (("fwd", (tokens, d_out, d_in)), ("dgrad", (tokens, d_in, d_out)),
                                ("wgrad", (d_out, d_in, tokens))):
            x, w, source = _real_data.operands(layer, gemm, M, N, K)
            yield x, w, {**source, "shape": f"gpt2 {name} {gemm}"}


def synthetic(kind, shape, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "normal":
        return torch.randn(shape, generator=g)
    if kind == "wide":  # adversarial: exponents spread over [-40, 40] defeat the fast path
        t = (torch.rand(shape, generator=g) + 1) * torch.pow(2.0, torch.randint(-40, 41, shape, generator=g).float())
        return t * (torch.randint(0, 2, shape, generator=g) * 2 - 1)
    raise ValueError(kind)


def cases(kind, M, N, K, layers):
    """(x, w, source) fp32 CPU operand pairs of one data kind, made one at a time (4096^2 fp32 is 64 MiB)."""
    if kind == "real":
        return (_real_data.operands(layer, gemm, M, N, K) for layer in layers for gemm in _real_data.GEMMS)
    how = {"normal": "torch.randn", "wide": "wide exponents [-40, 40]"}[kind]
    return [(synthetic(kind, (M, K), 1), synthetic(kind, (N, K), 2), {"x": f"{how} seed 1", "w": f"{how} seed 2"})]


def log2_span(t):
    """Bits between the largest and the smallest nonzero magnitude (None if all zero)."""
    a = t.abs().float()
    nz = a[a > 0]
    return None if nz.numel() == 0 else float(torch.log2(nz.max()) - torch.log2(nz.min()))


ROUTES = ("kernel", "slices", "slices_diagonals", "slices_crt", "fp64")


def bench(device, x, w, dtype, kind, source, repeat, timed_routes=ROUTES, out_dtype=torch.float32):
    x, w = x.to(dtype).to(device), w.to(dtype).to(device)
    (M, K), N = x.shape, w.shape[0]
    flops = 2.0 * M * N * K

    def ours_fn():
        return det_gemm(x, w, out_dtype=out_dtype)

    ours = time_fn(ours_fn, device, warmup=3, repeat=repeat)  # the first timed: the most warm-up
    # each exact route on its own, and the proof that they agree on these operands
    routes, outs, plans = {}, {"auto": ours_fn()}, {}
    fp64_counts = {}
    for route in timed_routes:
        with gemm_path(route):
            routes[route] = time_fn(ours_fn, device, warmup=1, repeat=repeat)
            outs[route] = ours_fn()
            if route == "fp64":
                fp64_counts = last_fp64_counts()
            if route.startswith("slices"):
                det_gemm(x, w, out_dtype=out_dtype, plans="sync")  # how the slices cut these operands
                plans[route] = last_slices_plan()  # (a guessed plan has no counts)
    # compare the outputs' bits (NaN == NaN)
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16
    same = all(torch.equal(o.view(bits), outs["auto"].view(bits)) for o in outs.values())
    base = time_fn(lambda: torch.mm(x, w.T), device, warmup=2, repeat=max(repeat, 5))
    xf, wf = x.float(), w.float()
    fp32 = time_fn(lambda: torch.mm(xf, wf.T), device, warmup=2, repeat=max(repeat, 5))
    # the headline ratios: ours against each baseline in interleaved rounds (the throughputs above
    # come from separate timings, which a drifting load can skew against one another)
    rounds = max(repeat, 5)
    ratio = interleaved_ratio(lambda: torch.mm(x, w.T), ours_fn, device, rounds)
    ratio_fp32 = interleaved_ratio(lambda: torch.mm(xf, wf.T), ours_fn, device, rounds)
    row = {
        "op": "det_gemm", "dtype": str(dtype).replace("torch.", ""), "data": kind, "M": M, "N": N, "K": K,
        "out_dtype": str(out_dtype).replace("torch.", ""),
        "ours_tflops": flops / ours / 1e12, "baseline_tflops": flops / base / 1e12,
        "ratio": ratio, "baseline": f"torch.mm {str(dtype).replace('torch.', '')}",
        "fp32_mm_tflops": flops / fp32 / 1e12, "ratio_vs_fp32_mm": ratio_fp32,
        "ratio_method": f"median over {rounds} interleaved rounds of baseline time / det_gemm time",
        "source": source, "x_log2_span": log2_span(x), "w_log2_span": log2_span(w),
        "routes_timed": list(timed_routes), "routes_same_bytes": same,
    }
    if "kernel" in routes:
        row.update(kernel_tflops=flops / routes["kernel"] / 1e12, kernel_ratio_vs_fp32_mm=fp32 / routes["kernel"])
    if "slices" in routes:
        row.update(slices_tflops=flops / routes["slices"] / 1e12, slices_ratio_vs_fp32_mm=fp32 / routes["slices"],
                   slices_plan=plans["slices"])
    # the slices' two ways on their own: one int8 GEMM per diagonal of slice pairs, or per CRT
    # modulus (csrc/crt.h; 0 moduli: they cannot cover these products and the diagonals ran)
    if "slices_diagonals" in routes:
        row["diagonals_ratio_vs_fp32_mm"] = fp32 / routes["slices_diagonals"]
    if "slices_crt" in routes:
        row.update(crt_moduli=plans["slices_crt"]["moduli"], crt_ratio_vs_fp32_mm=fp32 / routes["slices_crt"])
    if "fp64" in routes:  # the fp64 route (csrc/fp64_bound.h) and the share of outputs its bound left undecided
        row.update(fp64_ratio_vs_fp32_mm=fp32 / routes["fp64"],
                   fp64_undecided=fp64_counts.get("undecided", 0) / (M * N),
                   fp64_exact=fp64_counts.get("exact", 0) / (M * N))
    what = source.get("shape") or (f"{kind} {source['layer']} {source['gemm']}" if kind == "real" else kind)
    parts = [f"{r} {fp32 / t:.4f}" for r, t in routes.items()]
    if "slices" in plans:
        p = plans["slices"]
        parts.append(f"slices {p['slices_x']}x{p['slices_w']}, residues {p['residues_x']}/{p['residues_w']}")
    if "slices_crt" in plans:
        parts.append(f"crt moduli {plans['slices_crt']['moduli']}")
    if "fp64" in routes:
        parts.append(f"fp64 undecided {row['fp64_undecided']:.2e}, exact {row['fp64_exact']:.2e}")
    print(f"{row['op']:9s} {row['dtype']:9s} {what:28s} {M:5d}x{N:5d}x{K:5d}  ours {row['ours_tflops']:9.4f} TF/s  "
          f"torch.mm {row['baseline_tflops']:9.3f}  ratio {row['ratio']:.4f}  vs fp32 mm {row['ratio_vs_fp32_mm']:.4f}  "
          f"same bytes {same}  (vs fp32 mm: {'; '.join(parts)})", flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default=None, help="comma-separated cube sizes (default: 512 on CPU, 1024,4096 on GPU)")
    p.add_argument("--data", default=None,
                   help="comma-separated data kinds among normal, real, wide (default: normal on CPU, "
                        "normal,real,wide on GPU)")
    p.add_argument("--layers", default="blocks.1.mlp.0",
                   help="comma-separated gpt_char nn.Linear names whose values the real kind uses "
                        "(e.g. blocks.1.attn.qkv, blocks.1.mlp.2, head)")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated float32, bfloat16: the element types to run (default: each data kind's own; "
                        "normal and real run both, wide bf16)")
    p.add_argument("--routes", default=",".join(ROUTES),
                   help=f"comma-separated exact routes to time on their own besides auto, among {','.join(ROUTES)} "
                        "(default: all; '' none)")
    p.add_argument("--shapes", default=None, choices=["gpt2", ""],
                   help="gpt2: GPT-2-small's 15 GEMMs at 8192 tokens, bf16, real data (default on GPU; '' none)")
    p.add_argument("--out", default=None, help="results path (default: benchmarks/results/<device>-gemm.json)")
    args = p.parse_args(argv)
    timed_routes = tuple(r for r in args.routes.split(",") if r)
    if set(timed_routes) - set(ROUTES):
        p.error(f"--routes: unknown route(s) {sorted(set(timed_routes) - set(ROUTES))}; choose among {list(ROUTES)}")
    dtypes = None
    if args.dtypes:
        names = {"float32": torch.float32, "bfloat16": torch.bfloat16}
        if set(args.dtypes.split(",")) - set(names):
            p.error(f"--dtypes: expected a comma-separated subset of {sorted(names)}, got {args.dtypes!r}")
        dtypes = tuple(names[d] for d in args.dtypes.split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = args.device == "cuda"
    sizes = [int(s) for s in (("1024,4096" if gpu else "512") if args.sizes is None else args.sizes).split(",") if s]
    shapes = ("gpt2" if gpu else "") if args.shapes is None else args.shapes
    kinds = (args.data or ("normal,real,wide" if gpu else "normal")).split(",")
    unknown = set(kinds) - set(DTYPES)
    if unknown:
        p.error(f"--data: unknown kind(s) {sorted(unknown)}; choose among {sorted(DTYPES)}")
    layers = args.layers.split(",")
    extra = {}
    if "real" in kinds or shapes:  # captured once, on the CPU, before any timing
        meta = _real_data.capture()["meta"]
        missing = set(layers) - set(meta["layers"])
        if missing:
            p.error(f"--layers: {sorted(missing)} not in the model; it has {sorted(meta['layers'])}")
        extra["real_capture"] = meta
        print(f"real data: gpt_char d_model {meta['d_model']}, {meta['steps']} fp32 steps on the CPU "
              f"(loss {meta['first_loss']:.3f} -> {meta['last_loss']:.3f}), {meta['tokens']} tokens captured "
              f"in {meta['seconds']} s", flush=True)
    rows = []
    t0 = time.perf_counter()
    # a shared 2-core CPU's timings move by 20-40% from one repeat to the next: more repeats there,
    # whose median holds still
    repeat = 3 if gpu else 15

    def add(row):  # written after every row, "complete": false until the last, so a run cut short keeps them
        rows.append(row)
        write("gemm", args.device, rows, extra={**extra, "complete": False}, path=args.out)

    for n in sizes:
        for kind in kinds:
            for x, w, source in cases(kind, n, n, n, layers):
                for dt in dtypes or DTYPES[kind]:
                    add(bench(args.device, x, w, dt, kind, source, repeat=repeat, timed_routes=timed_routes))
    if shapes == "gpt2":
        for x, w, source in gpt2_cases():
            add(bench(args.device, x, w, torch.bfloat16, "real", source, repeat=repeat, timed_routes=timed_routes,
                      out_dtype=torch.bfloat16))
    out = write("gemm", args.device, rows, path=args.out,
                extra={**extra, "complete": True, "wall_s": round(time.perf_counter() - t0, 1)})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
