"""The det activations' kernels against PyTorch's, same tensors, one run.

    python benchmarks/activations.py                  # CPU, 2^20 elements
    python benchmarks/activations.py --device cuda    # GPU, 4096 x 4096 (the det_ddp step's MLP activation)

For each activation (det_gelu erf and tanh, det_silu, det_tanh; gelu_erf_series: erf-GELU with
the CUDA fast way of csrc/cuda/gelu_fast.cuh switched off, the series alone): the forward (ldet::act) and the
backward (ldet::act_backward, the op alone) against F.gelu / F.silu / torch.tanh and their backward
through torch.autograd.grad (so the autograd engine's overhead per call, tens of microseconds, is
in the baseline's backward and not in ours), in the input's dtype, in microseconds per call and as
a ratio. Inputs: torch.randn * 1.5 (the step
model's pre-activations are of that size), fp32. Writes benchmarks/results/<device>-activations.json.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import time_fn, write  # noqa: E402

from lightning_det import _build  # noqa: E402

KINDS = {  # name: (ldet ActKind, the PyTorch forward)
    "gelu_erf": (0, lambda x: F.gelu(x)),
    # the same op with its CUDA fast way off (csrc/cuda/gelu_fast.cuh): the series alone
    "gelu_erf_series": (0, lambda x: F.gelu(x)),
    "gelu_tanh": (1, lambda x: F.gelu(x, approximate="tanh")),
    "silu": (2, F.silu),
    "tanh": (3, torch.tanh),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--numel", type=int, default=None, help="elements (default: 4096 * 4096 on GPU, 2^20 on CPU)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    _build.load()
    dev = args.device
    n = args.numel or (4096 * 4096 if dev == "cuda" else 1 << 20)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, generator=g) * 1.5).to(dev)
    gy = torch.randn(n, generator=g).to(dev)
    repeat = 20 if dev == "cuda" else 5
    rows = []
    for name in args.kinds.split(","):
        kind, ref = KINDS[name]
        if name == "gelu_erf_series":
            os.environ["LIGHTNING_DET_GELU_SERIES"] = "1"  # read by the op at every call
        else:
            os.environ.pop("LIGHTNING_DET_GELU_SERIES", None)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        t = {
            "ours_fwd_us": time_fn(lambda: torch.ops.ldet.act(x, kind), dev, repeat=repeat),
            "ours_bwd_us": time_fn(lambda: torch.ops.ldet.act_backward(gy, x, kind), dev, repeat=repeat),
            "torch_fwd_us": time_fn(lambda: ref(x), dev, repeat=repeat),
            "torch_bwd_us": time_fn(lambda: torch.autograd.grad(yr, xr, gy, retain_graph=True), dev, repeat=repeat),
        }
        t = {k: v * 1e6 for k, v in t.items()}
        row = {"op": name, "dtype": "float32", "numel": n, "data": "randn * 1.5", **t,
               "fwd_time_ratio": t["ours_fwd_us"] / t["torch_fwd_us"],
               "bwd_time_ratio": t["ours_bwd_us"] / t["torch_bwd_us"]}
        rows.append(row)
        print(f"{name}: fwd {t['ours_fwd_us']:.0f} us ({row['fwd_time_ratio']:.1f}x torch), "
              f"bwd {t['ours_bwd_us']:.0f} us ({row['bwd_time_ratio']:.1f}x torch)", flush=True)
    print(f"wrote {write('activations', dev, rows, path=args.out)}")


if __name__ == "__main__":
    main()
