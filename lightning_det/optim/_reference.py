"""Plain Python/NumPy/PyTorch reference of AdamWSR, used by the tests.

It follows the published Philox4x32-10 algorithm and the ldet-v1 stream layout and formula of
csrc/philox.h and csrc/adamw_sr.h, written independently of the C++ so the two check each other.
"""
from __future__ import annotations

import numpy as np
import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32 with 10 rounds on Python integers (one block)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK, p1 & _MASK, ((p0 >> 32) ^ c3 ^ k1) & _MASK, p0 & _MASK
        k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def _philox_np(c0, c1, c2, c3, k0: int, k1: int):
    """Vectorized Philox4x32-10 over uint64 arrays holding 32-bit words (wrapping uint64 math)."""
    m = np.uint64(_MASK)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = np.uint64(_M0) * c0
        p1 = np.uint64(_M1) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m
        k0, k1 = (k0 + np.uint64(_W0)) & m, (k1 + np.uint64(_W1)) & m
    return c0, c1, c2, c3


def draws16(seed: int, step: int, base_index: int, n: int) -> np.ndarray:
    """The 16-bit draws of global indices base_index .. base_index+n-1 (ldet-v1 layout)."""
    g = np.arange(n, dtype=np.uint64) + np.uint64(base_index)
    blk = g >> np.uint64(3)
    m = np.uint64(_MASK)
    st = np.uint64(step & ((1 << 64) - 1))
    words = _philox_np(
        blk & m, blk >> np.uint64(32),
        np.full(n, st & m, dtype=np.uint64), np.full(n, st >> np.uint64(32), dtype=np.uint64),
        seed & _MASK, (seed >> 32) & _MASK,
    )
    w = np.stack(words)[((g & np.uint64(7)) >> np.uint64(1)).astype(np.int64), np.arange(n)]
    return np.where((g & np.uint64(1)) == 1, w >> np.uint64(16), w & np.uint64(0xFFFF))


def sr_round_bf16(x: torch.Tensor, seed: int, step: int, base_index: int = 0) -> torch.Tensor:
    """fp32 -> bf16, stochastic rounding with the ldet-v1 draws (see csrc/adamw_sr.h)."""
    u = x.detach().contiguous().cpu().view(torch.int32).numpy().view(np.uint32).astype(np.uint64).ravel()
    r = draws16(seed, step, base_index, u.size)
    special = (u & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
    nan = special & ((u & np.uint64(0x007FFFFF)) != 0)
    out = np.where(special, u >> np.uint64(16), (u + r) >> np.uint64(16))
    out = np.where(nan, out | np.uint64(0x40), out).astype(np.uint16)
    return torch.from_numpy(out.view(np.int16).copy()).view(torch.bfloat16).reshape(x.shape)


def host_scalars(lr, beta1, beta2, eps, weight_decay, step) -> dict:
    """The fp64 host scalars, computed exactly as AdamWSR does (see its module docstring)."""
    from .adamw_sr import _host_scalars

    return _host_scalars(lr, beta1, beta2, eps, weight_decay, step)


def adamw_sr_step(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                  seed, base_index, rounding="stochastic"):
    """One reference step in place. rounding: "stochastic" | "nearest" (bf16 params only).

    Each fp32 operation is a separate torch op on fp32 tensors with fp32 0-dim scalars, so each
    is rounded once, as in the kernel.
    """
    s = host_scalars(lr, beta1, beta2, eps, weight_decay, step)
    f = {k: torch.tensor(v, dtype=torch.float32) for k, v in s.items()}
    g = grad.float()
    m = f["beta1"] * exp_avg + f["one_minus_beta1"] * g
    v = f["beta2"] * exp_avg_sq + f["one_minus_beta2"] * (g * g)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    p = param.float() * f["decay"]
    # A full tensor, not a 0-dim one: torch's CPU div by a scalar multiplies by its reciprocal,
    # which is not the correctly rounded quotient.
    # torch's vectorized CPU fp32 sqrt is not correctly rounded (measured: 1 ULP off on some
    # inputs); an fp64 sqrt rounded to fp32 is (53 >= 2 * 24 + 2, so no double-rounding error).
    denom = torch.sqrt(v.double()).float() / torch.full_like(v, s["bias_correction2_sqrt"]) + f["eps"]
    p = p - f["step_size"] * (m / denom)
    if param.dtype == torch.float32:
        param.copy_(p)
    elif rounding == "stochastic":
        param.copy_(sr_round_bf16(p, seed, step, base_index))
    else:
        param.copy_(p.to(torch.bfloat16))
    return param
