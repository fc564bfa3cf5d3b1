"""Deterministic scaled dot-product attention: one fused kernel per direction, nothing of size
(Lq, Lk) kept.

``det_scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
scale=None, enable_gqa=False)`` has the semantics of ``F.scaled_dot_product_attention`` (dropout
with keyed masks, the same for a sample at every world size). It runs
:func:`lightning_det.ops.attention.attention_forward` / ``attention_backward``, whose arithmetic
is written out in csrc/attention.h: per (batch, head) slice, every sum is a fixed chain of fp32
fused multiply-adds in ascending index order (scores over the head dimension, the output and the
gradients over keys or queries), the softmax takes an exact row max and detmath's exp, and the
backward recomputes the scores from q and k. Each result is therefore a fixed function of its
own slice: row r of sequence b, head h depends only on that slice's q row r and its k, v, not on
the other sequences or heads computed with it, the tiling, the thread count or the device (CPU
and CUDA give the same bytes). Memory is O(B H L E): the (Lq, Lk) scores exist one tile at a
time.

These sums are fp32 chains, not exact sums rounded once: attention sums never cross a slice, so
no world-size or micro-batch split can reorder them, and exactness would buy no invariance.
Their accuracy is that of fp32 attention (tests compare with fp64).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..ops import det_finalize
from ..ops.attention import AttentionDropout, attention_backward, attention_forward, attention_probs
from ..ops.dropout import DropoutKey, dropout_multiplier
from ..ops.longacc import det_bmm
from ..ops.sums import det_row_sums
from ..ops.trust import trusted_fn
from .broadcast_grads import _ExactExpand
from .linear import DetLinear

__all__ = ["det_scaled_dot_product_attention", "DetMultiheadSelfAttention"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _FusedSDPA(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, q, k, v, mask, scale, causal, dropout):
        # q (B, H, Lq, E), k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev); mask None or (B, H, Lq, Lk)-broadcastable
        o, stats = attention_forward(q, k, v, mask, scale, causal, dropout)
        ctx.save_for_backward(q, k, v, o, stats, mask)
        ctx.scale, ctx.causal, ctx.dropout = scale, causal, dropout
        ctx.mark_non_differentiable(stats)
        # a fresh output tensor, never o itself: an in-place op on the output must not change what
        # the backward reads
        return (o.to(q.dtype) if q.dtype != torch.float32 else o.clone()), stats.clone()

    @staticmethod
    @trusted_fn
    def backward(ctx, d_out, _d_stats):
        q, k, v, o, stats, mask = ctx.saved_tensors
        dq, dk, dv = attention_backward(d_out, q, k, v, o, stats, mask, ctx.scale, ctx.causal, ctx.dropout)
        need = ctx.needs_input_grad
        dmask = _mask_grad(d_out, q, k, v, stats, mask, ctx.scale, ctx.causal, ctx.dropout) if need[3] else None
        return (dq.to(q.dtype) if need[0] else None, dk.to(k.dtype) if need[1] else None,
                dv.to(v.dtype) if need[2] else None, dmask, None, None, None)


def _mask_grad(d_out, q, k, v, stats, mask, scale, causal, dropout) -> torch.Tensor:
    """The gradient of a float mask (B, H, Lq, Lk), which is added to the scores:

        g_ij = exact(dO_i . v_j) rounded once, times the dropout multiplier k_ij,
        d_i  = exact(sum_j p_ij g_ij) rounded once,
        dmask_ij = p_ij * (g_ij - d_i),

    p the forward's weights (attention_probs: 0 where a key is not allowed). Elementwise IEEE
    operations on exact sums: the same bytes on every device and in any batch. O(B H Lq Lk)
    memory, which only a mask that needs a gradient costs."""
    b, h, lq, _ = q.shape
    hkv, lk, ev = v.shape[1], v.shape[2], v.shape[3]
    p = attention_probs(q, k, stats, mask.detach(), scale, causal)
    vh = v if hkv == h else v.unsqueeze(2).expand(b, hkv, h // hkv, lk, ev).reshape(b, h, lk, ev)
    g = det_bmm(d_out.to(q.dtype).reshape(b * h, lq, ev), vh.reshape(b * h, lk, ev)).view(b, h, lq, lk)
    if dropout is not None:
        g = g * dropout_multiplier(p, dropout.p, dropout.key)
    d = det_finalize(det_row_sums(p.reshape(-1, lk), g.reshape(-1, lk))).view(b, h, lq, 1)
    return (p * (g - d)).to(mask.dtype)


def _dropout_arg(dropout_p, dropout_key, batch: int) -> Optional[AttentionDropout]:
    """None (no dropout) or the kernel's AttentionDropout, checked."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}")
    if dropout_p == 0:
        return None
    if not isinstance(dropout_key, DropoutKey):
        raise ValueError(
            f"dropout_key: dropout_p={dropout_p} needs the call's DropoutKey (keyed masks, the same for a sample "
            "at every world size); under det_ddp det_function_mode passes it, got "
            f"{type(dropout_key).__name__}")
    if batch != dropout_key.samples:
        raise ValueError(f"query: expected its first dimension to be the batch of {dropout_key.samples} samples "
                         f"(dropout_key.samples), got {batch}")
    return AttentionDropout(float(dropout_p), dropout_key)


def _check(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() < 3:
        raise ValueError(f"{name}: expected shape (..., L, E) with at least 3 dimensions, e.g. (B, H, L, E), "
                         f"got {tuple(t.shape)}")


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                    causal: bool, dropout: Optional[AttentionDropout]):
    """``(out, stats)`` of the fused kernel on 4-D (B, H, L, E) operands, differentiable in q, k,
    v; ``stats`` (the rows' m and r, no gradient) lets :func:`lightning_det.ops.attention.attention_probs`
    give the forward's own weights."""
    return _FusedSDPA.apply(q, k, v, mask, scale, causal, dropout)


def _as_4d(t: torch.Tensor, b: int, h: int) -> torch.Tensor:
    return t.reshape(b, h, *t.shape[-2:])


def det_scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    dropout_key: Optional[DropoutKey] = None,
) -> torch.Tensor:
    """Deterministic, batch- and head-invariant ``F.scaled_dot_product_attention`` (see the
    module docstring).

    Args:
        query: (..., Lq, E), e.g. (B, H, Lq, E); float32, bfloat16 or float16; E <= 256.
        key: (..., Lk, E), the same leading dims and dtype as ``query`` (with ``enable_gqa``,
            fewer heads in dimension -3: a divisor of query's).
        value: (..., Lk, Ev), the same leading dims and dtype as ``key``; Ev <= 256.
        attn_mask: optional, broadcastable to (..., Lq, Lk): bool (True = may attend) or float
            (added to the scores). A float mask that requires grad gets its gradient (see
            ``_mask_grad``; summed exactly over the dimensions it is broadcast along, rounded
            once). A query row that may attend nothing gets 0, as PyTorch's SDPA gives.
        dropout_p: attention dropout, applied to the weights as PyTorch does (``P * m`` before
            ``P @ V``, ``m`` = 1/(1-p) where kept, 0 where dropped; the backward uses the same
            ``m``). The mask is keyed (:mod:`lightning_det.ops.dropout`) over each sample's
            (head, query, key) elements: ``dropout_key`` is required when dropout_p > 0, and the
            first dimension of query is the batch (its size is ``dropout_key.samples``).
        is_causal: query r attends keys j <= r (upper-left aligned, as PyTorch). Not with attn_mask.
        scale: score scale, default ``1 / sqrt(E)`` (rounded to fp32).
        enable_gqa: grouped-query attention, as PyTorch's: query head h reads key/value head
            h // (H / Hkv); dK and dV are chains over the group's heads.
        dropout_key: the call's :class:`~lightning_det.ops.dropout.DropoutKey` (det_function_mode
            makes one from the step state's position); ignored when dropout_p is 0.

    Returns:
        (..., Lq, Ev) of ``query``'s dtype.
    """
    _check(query, "query")
    _check(key, "key")
    _check(value, "value")
    lead = tuple(query.shape[:-2])
    lq, e = query.shape[-2:]
    lk = key.shape[-2]
    klead = tuple(key.shape[:-2])
    if enable_gqa and klead != lead:
        heads, kv_heads = query.shape[-3], key.shape[-3]
        if klead[:-1] != lead[:-1] or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"key, value: with enable_gqa the query heads ({heads}) must be a multiple of the "
                             f"key/value heads, got key {tuple(key.shape)} for query {tuple(query.shape)}")
    elif klead != lead:
        raise ValueError(f"key: expected shape {(*lead, 'Lk', e)} matching query {tuple(query.shape)}, "
                         f"got {tuple(key.shape)}")
    if key.shape[-1] != e:
        raise ValueError(f"key: expected shape {(*klead, lk, e)} (query's last dimension {e}), got {tuple(key.shape)}")
    if tuple(value.shape[:-1]) != (*klead, lk):
        raise ValueError(f"value: expected shape {(*klead, lk, 'Ev')} matching key {tuple(key.shape)}, "
                         f"got {tuple(value.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype or t.device != query.device:
            raise ValueError(f"{name}: expected dtype {query.dtype} on {query.device} like query, "
                             f"got {t.dtype} on {t.device}")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (as F.scaled_dot_product_attention)")
    # (B, H): the batch first (dropout keys each sample), the rest of the leading dims as heads;
    # an unbatched grouped-query call (H, L, E) is one sample of H heads
    b = 1 if len(lead) == 1 and klead != lead else lead[0]
    h, hkv = math.prod(lead) // max(b, 1), math.prod(klead) // max(b, 1)
    mask = None
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a tensor or None, got {type(attn_mask).__name__}")
        full = torch.Size((*lead, lq, lk))
        try:
            if torch.broadcast_shapes(attn_mask.shape, full) != full:
                raise RuntimeError("larger than the scores")
            mask = attn_mask.to(query.device)
        except RuntimeError as err:
            raise ValueError(f"attn_mask: expected a shape broadcastable to {tuple(full)}, "
                             f"got {tuple(attn_mask.shape)}") from err
        if mask.is_floating_point() and mask.requires_grad and torch.is_grad_enabled():
            mask = mask if mask.shape == full else _ExactExpand.apply(mask, full)
        else:
            mask = mask.detach().expand(full)
        mask = _as_4d(mask, b, h)
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    dropout = _dropout_arg(dropout_p, dropout_key, b)
    out, _ = fused_attention(_as_4d(query, b, h), _as_4d(key, b, hkv), _as_4d(value, b, hkv), mask, scale,
                             bool(is_causal), dropout)
    return out.reshape(*lead, lq, value.shape[-1])


class DetMultiheadSelfAttention(nn.Module):
    """Multi-head self-attention from DetLinear projections and det attention.

    Args:
        dim: model width (input and output features); must be divisible by ``n_heads``.
        n_heads: number of heads; head size ``dim // n_heads``.
        bias: bias in the ``qkv`` and ``proj`` projections.
        device, dtype: for the parameters.

    Parameters are ``qkv`` (DetLinear dim -> 3 dim, laid out [q | k | v], each head-major) and
    ``proj`` (DetLinear dim -> dim): the layout of the usual nanoGPT-style module, so a plain
    module with ``nn.Linear`` attributes of the same names loads the same ``state_dict``.

    Shapes: x (B, L, dim) float32/bfloat16 -> (B, L, dim), same dtype. ``forward(x,
    attn_mask=None, is_causal=False)``.
    """

    def __init__(self, dim: int, n_heads: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"n_heads: expected a divisor of dim={dim}, got {n_heads}")
        self.dim, self.n_heads = dim, n_heads
        self.qkv = DetLinear(dim, 3 * dim, bias=bias, device=device, dtype=dtype)
        self.proj = DetLinear(dim, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False):
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected shape (B, L, {self.dim}), got {tuple(x.shape)}")
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.n_heads, self.dim // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = det_scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.proj(y.transpose(1, 2).reshape(b, l, self.dim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_heads={self.n_heads}, exact=True"
