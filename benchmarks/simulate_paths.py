"""How often the CUDA GEMM kernel (v3, v4) leaves its fast path, computed from the data alone.

    python benchmarks/simulate_paths.py                      # randn, K = 4096, fp32 and bf16
    python benchmarks/simulate_paths.py --k 1024 --size 512
    python benchmarks/simulate_paths.py --split piece12       # fp32 as the earlier 12-bit pieces

No GPU needed: this recomputes the kernel's per-(row, 32-wide K-block) exponent statistics
(max hi, min lo, as csrc/gemm_common.h's StatAcc) on the operands as the kernel sees them (fp32:
the four piece segments of csrc/split.h, cut at 2^(E - --bits) per row block), forms the same thread groups as
csrc/cuda/gemm_cuda.cu (a thread's 4 rows fr, fr+8, fr+16, fr+24 of a 32-row warp half and its 8
columns 8jj + 2fc + i of a 32-column half) and reports:

  warp_blocks_output_by_output   fraction of (warp, K-block) pairs in which at least one thread's
                                 block fails on its own ((hi - lo) of its rows + of its columns
                                 > LDET_FAST_SPREAD), so the whole warp goes output by output;
  pairs_product_by_product       fraction of (output, K-block) pairs whose own check fails
                                 (the exact path: product by product);
  warp_blocks_with_an_exact_pair fraction of (warp, K-block) pairs holding such a pair.

It does not model the chunk bound (whose failures only close a chunk with one TwoSum).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

FAST_SPREAD = 53 - 2 - 5  # LDET_FAST_SPREAD (csrc/longacc.h)
BK = 32                   # LDET_KBLOCK


def split_pieces(t: torch.Tensor):
    """x = xh + xl: the top 12 significand bits and the rest (csrc/split.h)."""
    hi = (t.contiguous().view(torch.int32) & (0xFFFFF000 - (1 << 32))).view(torch.float32)
    return hi, t - hi


def split_aligned(t: torch.Tensor, bits: int):
    """x = xh + xl with xh = x's bits of weight >= 2^(E - bits), E the exponent of the largest |x|
    of its (row, 32-wide K-block): csrc/split.h's block-aligned split, in the float domain."""
    rows, k = t.shape
    nkb = -(-k // BK)
    pad = torch.nn.functional.pad(t.abs(), (0, nkb * BK - k)).view(rows, nkb, BK).amax(2)
    E = torch.frexp(pad)[1] - 1  # floor(log2 max|x|); zero blocks give -1 (their pieces are all 0)
    q = torch.pow(2.0, (E - bits).double()).repeat_interleave(BK, 1)[:, :k]
    hi = (torch.trunc(t.double() / q) * q).float()  # exact in fp64 for fp32 data
    return hi, t - hi


def block_stats(a: torch.Tensor, block: int = BK):
    """(max hi, min lo) per (row, K-block of `block`; a ragged tail is left out); empty blocks get
    (-10^6, 10^6)."""
    v = np.abs(a.double().numpy())
    nz = v > 0
    m, e = np.frexp(v)
    hi = e - 1
    mant = np.where(nz, np.ldexp(m, 53).astype(np.int64), 1)
    lowest = mant & -mant
    lo = hi - 52 + (np.frexp(lowest.astype(np.float64))[1] - 1)
    rows, k = v.shape
    nkb = k // block
    H = np.where(nz, hi, -(10 ** 6))[:, : nkb * block].reshape(rows, nkb, block).max(2)
    L = np.where(nz, lo, 10 ** 6)[:, : nkb * block].reshape(rows, nkb, block).min(2)
    return H, L


def simulate(x: torch.Tensor, w: torch.Tensor, split: str = "aligned", bits: int = 17) -> dict:
    if x.dtype == torch.float32:
        piece = split_pieces if split == "piece12" else (lambda t: split_aligned(t, bits))
        xh, xl = piece(x)
        wh, wl = piece(w)
        assert torch.equal(xh + xl, x) and torch.equal(wh + wl, w)
        x, w = torch.cat([xh, xh, xl, xl], 1), torch.cat([wh, wl, wh, wl], 1)
    Hx, Lx = block_stats(x)
    Hw, Lw = block_stats(w)
    sx, sw = Hx - Lx, Hw - Lw  # per-row spreads (empty blocks: very negative, they always pass)
    halves_m, halves_n = x.shape[0] // 32, w.shape[0] // 32

    def group_spread(H, L, idx):  # the kernel's aggregate: max hi over the group - min lo over it
        return H[idx].max(0) - L[idx].min(0)

    rg = np.stack([group_spread(Hx, Lx, list(range(h * 32 + fr, (h + 1) * 32, 8)))
                   for h in range(halves_m) for fr in range(8)])
    cg = np.stack([group_spread(Hw, Lw, [h * 32 + 8 * jj + 2 * fc + i for jj in range(4) for i in range(2)])
                   for h in range(halves_n) for fc in range(4)])
    warp_fail = warp_exact = total = 0
    for hm in range(halves_m):
        r = rg[hm * 8:(hm + 1) * 8]
        pr = sx[hm * 32:(hm + 1) * 32]
        for hn in range(halves_n):
            thread_ok = (r[:, None, :] + cg[hn * 4:(hn + 1) * 4][None, :, :]) <= FAST_SPREAD
            warp_fail += int((~thread_ok.all((0, 1))).sum())
            pair_bad = (pr[:, None, :] + sw[hn * 32:(hn + 1) * 32][None, :, :]) > FAST_SPREAD
            warp_exact += int(pair_bad.any((0, 1)).sum())
            total += thread_ok.shape[-1]
    pairs_bad = ((sx[:, None, :] + sw[None, :, :]) > FAST_SPREAD).mean()
    return {"warp_blocks_output_by_output": warp_fail / total, "pairs_product_by_product": float(pairs_bad),
            "warp_blocks_with_an_exact_pair": warp_exact / total}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--size", type=int, default=256, help="M = N (a multiple of 32: whole warp halves)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--split", default="aligned", choices=["aligned", "piece12"],
                   help="fp32 split: block-aligned pieces (csrc/split.h) or the earlier 12-bit pieces")
    p.add_argument("--bits", type=int, default=17,
                   help="aligned split: xh keeps weights >= 2^(E - bits) (csrc/split.h's kSplitBits)")
    a = p.parse_args(argv)
    if a.size % 32:
        p.error("--size: expected a multiple of 32")
    g = torch.Generator().manual_seed(a.seed)
    x, w = torch.randn(a.size, a.k, generator=g), torch.randn(a.size, a.k, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        r = simulate(x.to(dtype), w.to(dtype), a.split, a.bits)  # fp32 is split into pieces inside, bf16 is not
        print(f"{str(dtype).replace('torch.', ''):9s} randn {a.size}x{a.size}x{a.k}: " +
              ", ".join(f"{k} {v:.4%}" for k, v in r.items()))


if __name__ == "__main__":
    main()
