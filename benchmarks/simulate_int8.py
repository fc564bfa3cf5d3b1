"""How many int8 slices an exact integer-tensor-core GEMM would need, from the data alone.

    python benchmarks/simulate_int8.py                 # randn and gpt_char's real operands, bf16 and fp32
    python benchmarks/simulate_int8.py --block 32 --size 512

No GPU needed, nothing built: this measures the data for a design that does not exist yet (the
route to target 1 that benchmarks/NOTES.md sketches). In it, every (row, K-block) of an operand
shares the exponent E of its largest |value|, so each value becomes an integer in units of
2^(E + 1 - 7 s) when it has no bits below that unit; s signed 7-bit slices hold it, int8 x int8
products accumulate exactly in int32, and a block needs s_x * s_w slice products. A value with
bits below the unit cannot be held by s slices: its (row, block) needs more slices, or a residual
pass. For each operand this prints the share of (row, K-block)s and of 64-row tiles (the rows one
thread block would slice together) that s = 1..4 slices hold exactly.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simulate_paths import block_stats  # noqa: E402  (the kernels' per-(row, block) exponent statistics)

SLICE_BITS = 7  # magnitude bits per signed int8 slice


def bits_needed(a: torch.Tensor, block: int) -> np.ndarray:
    """Per (row, K-block): E + 1 - (lowest set bit over the block's values), 0 for all-zero blocks."""
    H, L = block_stats(a, block)
    return np.where(H > -(10 ** 6), H + 1 - L, 0)


def shares(need: np.ndarray, tile_rows: int = 64) -> dict:
    rows = need.shape[0] - need.shape[0] % tile_rows
    tiles = need[:rows].reshape(rows // tile_rows, tile_rows, -1).max(1) if rows else need[:0]
    out = {}
    for s in range(1, 5):
        out[f"s<={s}"] = (float((need <= SLICE_BITS * s).mean()), float((tiles <= SLICE_BITS * s).mean()) if rows else None)
    return out


def report(name: str, t: torch.Tensor, block: int) -> None:
    r = shares(bits_needed(t, block))
    print(f"{name:40s} " + "  ".join(f"{k}: {a:7.3%} rows, {b:7.3%} tiles" for k, (a, b) in r.items()), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", type=int, default=64, help="K-block width sharing one exponent per row")
    p.add_argument("--size", type=int, default=512, help="rows of the randn operand")
    p.add_argument("--k", type=int, default=2048, help="K (a ragged last block is left out)")
    p.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                   help="also the gpt_char operands of benchmarks/gemm.py's real data (a short CPU training run)")
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(a.size, a.k, generator=g)
    for dt in (torch.bfloat16, torch.float32):
        report(f"randn {str(dt)[6:]}", x.to(dt), a.block)
    if a.real:
        import gemm  # noqa: E402  (benchmarks/gemm.py: the real-data capture)

        for xr, wr, src in gemm.cases("real", 256, 256, a.k, ["blocks.1.mlp.0", "blocks.0.attn.qkv"]):
            for dt in (torch.bfloat16, torch.float32):
                for role, t in (("x", xr), ("w", wr)):
                    report(f"{src['layer']} {src['gemm']} {role} {str(dt)[6:]}", t.to(dt), a.block)


if __name__ == "__main__":
    main()
