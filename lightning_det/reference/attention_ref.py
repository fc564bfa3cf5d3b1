"""Plain-PyTorch reference of the fused deterministic attention (``ldet::attention_fwd`` /
``attention_bwd``; the definition is written out in csrc/attention.h).

Independent of the kernels' code: every chain is a Python loop over its index in ascending
order, one eager operation per step; the fp32 fused multiply-add, which PyTorch does not
offer, is formed from fp64 operations (:func:`fma32`), and the fp32 exp (:func:`exp32`) is the
kernels' sequence written out in eager ops. Slow by design: use it on small shapes.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["fma32", "exp32", "attention_forward_ref", "attention_backward_ref", "attention_weights_ref"]


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once (finite values), from fp64 operations.

    The fp32 product a * b is exact in fp64 (24 + 24 bits). TwoSum gives s + err == a * b + c
    exactly; rounding s to odd (where err != 0 the exact value lies strictly between s and its
    neighbour toward err: take the odd one of the two) keeps 53 >= 24 + 2 bits, so the final
    nearest-even conversion to fp32 is the single correct rounding.
    """
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bp = s - p
    err = (p - (s - bp)) + (cd - bp)
    bits = s.view(torch.int64)
    fix = (err != 0) & ((bits & 1) == 0)
    step = torch.where((err > 0) == (s > 0), 1, -1)  # int64 bits move the magnitude: sign-magnitude
    return torch.where(fix, bits + step, bits).view(torch.float64).float()


_LN2_HI, _LN2_LO, _LOG2E = float.fromhex("0x1.62e400p-1"), float.fromhex("0x1.7f7d1cp-20"), float.fromhex("0x1.715476p+0")
_INV_FACT = [1.0, 1.0, 0.5, float.fromhex("0x1.555556p-3"), float.fromhex("0x1.555556p-5"),
             float.fromhex("0x1.111112p-7"), float.fromhex("0x1.6c16c2p-10"), float.fromhex("0x1.a01a02p-13")]


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k exactly as fp32, k an integer-valued tensor in [-126, 127]."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def exp32(x: torch.Tensor) -> torch.Tensor:
    """csrc/attention.h's ``attn::exp32`` of fp32 ``x``: Cody-Waite with ln2 in two parts, the
    degree-7 Taylor polynomial in Horner form with fma, 2^k in two exact steps; 0 below -87.33,
    +inf above 88.72, NaN kept."""
    x = x.float()
    k = torch.round(x * _f32(_LOG2E))  # ties to even, as rint
    r = fma32(k, _f32(-_LN2_LO).expand_as(k), fma32(k, _f32(-_LN2_HI).expand_as(k), x))
    p = torch.full_like(x, _INV_FACT[7])
    for n in range(6, -1, -1):
        p = fma32(p, r, torch.full_like(x, _INV_FACT[n]))
    k = torch.where((x >= -87.33) & (x <= 88.72), k, torch.zeros_like(k))  # keep the shifts in range
    k1 = torch.trunc(k / 2)
    y = (p * _pow2(k1)) * _pow2(k - k1)
    y = torch.where(x < -87.33, _f32(0.0), y)
    y = torch.where(x > 88.72, _f32(float("inf")), y)
    return torch.where(x.isnan(), x, y)


def _f32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _allowed(b, h, lq, lk, mask, causal) -> torch.Tensor:
    ok = torch.ones(b, h, lq, lk, dtype=torch.bool)
    if causal:
        ok &= torch.ones(lq, lk, dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        ok &= mask.expand(b, h, lq, lk)
    return ok


def _heads(t: torch.Tensor, h: int) -> torch.Tensor:
    """k or v (B, Hkv, L, E) as fp32 per query head (B, H, L, E)."""
    return t.float().repeat_interleave(h // t.shape[1], dim=1)


def _chain_c(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = chain_c a[..., i, c] * b[..., j, c]."""
    acc = torch.zeros(*a.shape[:-1], b.shape[-2], dtype=torch.float32)
    for c in range(a.shape[-1]):
        acc = fma32(a[..., :, None, c], b[..., None, :, c], acc)
    return acc


def _end(chain: torch.Tensor) -> torch.Tensor:
    """A chain's end + 0: -0 becomes +0."""
    return chain + torch.zeros_like(chain)


def _forward_parts(q, k, mask, scale, causal):
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    kf = _heads(k, h)
    s = _end(_chain_c(q.float(), kf)) * _f32(scale)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.float().expand(b, h, lq, lk)
    ok = _allowed(b, h, lq, lk, mask, causal)
    m = torch.where(ok & ~s.isnan(), s, float("-inf")).amax(-1, keepdim=True)
    m = torch.where(m == float("-inf"), _f32(0.0), m)
    e = torch.where(ok, exp32(s - m), _f32(0.0))
    l = torch.zeros(b, h, lq, 1)
    for j in range(lk):
        l = torch.where(ok[..., j:j + 1], l + e[..., j:j + 1], l)
    r = torch.where(l == 0, _f32(0.0), torch.ones_like(l) / l)
    return ok, m, e, r


def attention_weights_ref(q, k, mask: Optional[torch.Tensor] = None, scale: float = 1.0,
                          causal: bool = False) -> torch.Tensor:
    """The weights p = e * r (0 where a key is not allowed), as ``attention_probs`` returns them."""
    _, _, e, r = _forward_parts(q, k, mask, scale, causal)
    return e * r


def _keep(shape, dropout) -> torch.Tensor:
    if dropout is None:
        return torch.ones(shape)
    from ..ops.dropout import dropout_multiplier

    b = shape[0]
    return dropout_multiplier(torch.empty(b, shape[1] * shape[2] * shape[3]), dropout.p, dropout.key).view(shape)


def attention_forward_ref(q, k, v, mask: Optional[torch.Tensor] = None, scale: float = 1.0, causal: bool = False,
                          dropout=None):
    """``(o, stats)`` as ``lightning_det.ops.attention.attention_forward`` returns them."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    ok, m, e, r = _forward_parts(q, k, mask, scale, causal)
    keep = _keep((b, h, lq, lk), dropout)
    t = e * keep if dropout is not None else e
    vf = _heads(v, h)
    u = torch.zeros(b, h, lq, v.shape[-1])
    for j in range(lk):
        u = torch.where(ok[..., j:j + 1], fma32(t[..., j:j + 1], vf[..., j:j + 1, :], u), u)
    return u * r, torch.cat([m, r], dim=-1)


def attention_backward_ref(dout, q, k, v, o, mask: Optional[torch.Tensor] = None, scale: float = 1.0,
                           causal: bool = False, dropout=None):
    """``(dq, dk, dv)`` as ``lightning_det.ops.attention.attention_backward`` returns them."""
    b, h, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    g = h // hkv
    ok, _, e, r = _forward_parts(q, k, mask, scale, causal)
    do = dout.float()
    d = torch.zeros(b, h, lq, 1)
    for c in range(do.shape[-1]):
        d = fma32(do[..., c:c + 1], o[..., c:c + 1], d)
    keep = _keep((b, h, lq, lk), dropout)
    p = e * r
    dp = _end(_chain_c(do, _heads(v, h)))
    pk, dpk = (p * keep, dp * keep) if dropout is not None else (p, dp)
    ds = torch.where(ok, (p * (dpk - d)) * _f32(scale), _f32(0.0))
    kf, qf = _heads(k, h), q.float()
    dq = torch.zeros(b, h, lq, q.shape[-1])
    for j in range(lk):
        dq = torch.where(ok[..., :, j:j + 1], fma32(ds[..., :, j:j + 1], kf[..., j:j + 1, :], dq), dq)
    dk = torch.zeros(b, hkv, lk, k.shape[-1])
    dv = torch.zeros(b, hkv, lk, v.shape[-1])
    for hh in range(g):  # the definition's order: query heads of the group, then rows
        heads = list(range(hh, h, g))  # member hh of every group: query head hk * g + hh
        for i in range(lq):
            okh = ok[:, heads, i, :, None]  # (B, Hkv, Lk, 1)
            dk = torch.where(okh, fma32(ds[:, heads, i, :, None], qf[:, heads, i, None, :], dk), dk)
            dv = torch.where(okh, fma32(pk[:, heads, i, :, None], do[:, heads, i, None, :], dv), dv)
    return dq, dk, dv
