"""Inputs of the fused attention tests (tests/test_fused_attention.py and its emulated-CUDA twin)."""
from __future__ import annotations

import torch

from lightning_det.ops.attention import AttentionDropout
from lightning_det.ops.dropout import DropoutKey


def attention_inputs(b, h, hkv, lq, lk, e, ev, dtype, mask=None, seed=0):
    """(q, k, v, dout, mask): randn operands of one dtype; mask None, "bool" (a (B, 1, Lq, Lk)
    mask with one query row that may attend nothing) or "float" (an (Lq, Lk) additive mask whose
    last key is -inf)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, e, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, e, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, ev, generator=g).to(dtype)
    do = torch.randn(b, h, lq, ev, generator=g).to(dtype)
    m = None
    if mask == "bool":
        m = torch.rand(b, 1, lq, lk, generator=g) > 0.35
        m[0, 0, min(2, lq - 1)] = False
    elif mask == "float":
        m = torch.randn(lq, lk, generator=g)
        m[:, -1] = float("-inf")
    return q, k, v, do, m


def attention_dropout(on: bool, batch: int):
    """An AttentionDropout of p = 0.3 for a batch of ``batch`` samples, or None."""
    return AttentionDropout(0.3, DropoutKey(seed=7, step=3, offset=5, samples=batch, site=11)) if on else None
