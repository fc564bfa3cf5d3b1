"""Side by side: torch.mm changes bits under K-splits and row counts; det_gemm does not.

    python examples/invariance_demo.py [--device cuda]
"""
from __future__ import annotations

import argparse
import hashlib

import torch

from lightning_det.ops import det_combine, det_finalize, det_gemm, det_gemm_partial


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", type=int, default=256)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    n = args.size
    x = torch.randn(n, 4 * n, generator=g).to(args.device)
    w = torch.randn(n, 4 * n, generator=g).to(args.device)
    cut = 3 * n // 2 + 7

    def mm_whole():
        return x @ w.T

    def mm_split():
        return x[:, :cut] @ w[:, :cut].T + x[:, cut:] @ w[:, cut:].T

    def det_whole():
        return det_gemm(x, w)

    def det_split():
        return det_finalize(det_combine([det_gemm_partial(x[:, cut:], w[:, cut:]), det_gemm_partial(x[:, :cut], w[:, :cut])]))

    print(f"x {tuple(x.shape)} @ w.T {tuple(w.T.shape)} on {args.device}; digests are SHA-256 of the fp32 bytes\n")
    print(f"{'computation':34s} {'torch.mm':18s} {'det_gemm':18s}")
    rows = [("whole K", mm_whole(), det_whole()), (f"K split at {cut}, summed", mm_split(), det_split())]
    for name, a, b in rows:
        print(f"{name:34s} {digest(a):18s} {digest(b):18s}")
    mm_same = torch.equal(rows[0][1], rows[1][1])
    det_same = torch.equal(rows[0][2], rows[1][2])
    print(f"{'K-split invariant?':34s} {str(mm_same):18s} {str(det_same):18s}\n")

    changed_mm = changed_det = 0
    ms = [1, 2, 3, 5, 8, 17, 33, 64]
    for m in ms:
        changed_mm += not torch.equal(x[:m] @ w.T, mm_whole()[:m])
        changed_det += not torch.equal(det_gemm(x[:m], w), det_whole()[:m])
    print(f"row-count: of {len(ms)} prefix sizes m, rows 0..m-1 changed bits in {changed_mm} (torch.mm) "
          f"and {changed_det} (det_gemm)")
    if not det_same or changed_det:
        raise SystemExit("det_gemm broke its contract")


if __name__ == "__main__":
    main()
