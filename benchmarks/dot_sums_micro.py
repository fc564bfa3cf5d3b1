"""Kernel times of the exact dot sums (det_row_sums / det_col_sums) at the det_ddp step's
LayerNorm shape (4096 x 1024, fp32, CUDA), the column sums of DetLinear's bias gradient
(8192 x 4096), and of det_gelu on 4096 x 4096 when GELU=1.

    python benchmarks/dot_sums_micro.py        # CUDA only

Prints mean microseconds per call (CUDA events, 30 calls after one warm-up) and a digest of the
row sums (the same on every build: the kernels' bytes must not move). A kernel diagnostic for
benchmarks/NOTES.md (session 11), not a README figure: there is no PyTorch baseline for an exact
sum. Session 11 ran it with LDET_DOT_THREADS / LDET_DOT_MINCHUNK read by a scratch build of
dot_chunks (not in the package) to sweep the chunking: results/logs/h200-dot-sums-e666ce7.txt.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lightning_det.nn.functional import det_col_sums, det_gelu, det_row_sums  # noqa: E402


def mean_us(f, n=30):
    """Mean CUDA-event time of f() in microseconds over n calls, after one warm-up call."""
    f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1e3


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 1024, device="cuda", generator=g)
    b = torch.randn(4096, 1024, device="cuda", generator=g)
    h = torch.randn(4096, 4096, device="cuda", generator=g)
    gy = torch.randn(8192, 4096, device="cuda", generator=g)  # DetLinear's bias gradient (8192 tokens)
    rows = det_row_sums(a, b)
    res = dict(rows_ab=mean_us(lambda: det_row_sums(a, b)), rows_a=mean_us(lambda: det_row_sums(a)),
               cols_ab=mean_us(lambda: det_col_sums(a, b)), cols_a=mean_us(lambda: det_col_sums(a)),
               cols_8192x4096=mean_us(lambda: det_col_sums(gy)))
    if os.environ.get("GELU"):
        res["gelu_4096x4096"] = mean_us(lambda: det_gelu(h))
    digest = hash(tuple(rows.flatten()[:1000].tolist())) % 10**8  # Python's int hash: stable
    print(os.environ.get("LDET_DOT_THREADS", "default"), os.environ.get("LDET_DOT_MINCHUNK", "default"),
          " ".join(f"{k} {v:.1f}us" for k, v in res.items()), "digest", digest, flush=True)


if __name__ == "__main__":
    main()
