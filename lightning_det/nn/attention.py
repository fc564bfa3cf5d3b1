"""Deterministic scaled dot-product attention: exact GEMMs, a row-wise exact softmax, exact backward.

``det_scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
scale=None)`` has the semantics of ``F.scaled_dot_product_attention`` (dropout with keyed masks:
``P`` below is multiplied by the mask times 1/(1-p) before ``P V``, and ``dP`` by the same). Per
(batch, head) slice ``i`` and query row ``r``, all in fp32 (bf16/fp16 inputs are widened exactly):

    S   = round(exact Q K^T) * scale            (det_bmm, then one correctly rounded multiply)
    S   = S + attn_mask | S masked to -inf       (bool mask False / causal: key j > query r)
    m   = max_j S[r, j]                          (exact; 0 for a row masked entirely, whose P is 0)
    e   = det_exp(S - m)                         (fp64 detmath exp, rounded once)
    P   = e / round(exact sum_j e[r, j])         (exact row sum, one rounding, IEEE division)
    O   = round_to_out_dtype(exact P V)          (det_bmm straight to q's dtype: one rounding)

Backward, with dO the output gradient:

    dV  = exact P^T dO                           rounded once to v's dtype
    dP  = round(exact dO V^T)
    D   = round(exact sum_j P[r, j] dP[r, j])    (== rowsum(dO * O) in exact arithmetic; formed
                                                  from P and dP so a bf16-rounded O does not
                                                  leak its rounding into every gradient)
    dS  = P * (dP - D) * scale                   (elementwise, fp32)
    dQ  = exact dS K,  dK = exact dS^T Q         rounded once to q's / k's dtype

Every reduction is an exact long-accumulator sum rounded once, every other op is elementwise
and correctly rounded, and each (batch, head) slice is computed on its own: row r of sequence b,
head h depends only on that slice's q row r and its k, v. So results do not depend on the other
sequences in the batch, the number of heads computed together, thread count or device.

Limit: the (Lq, Lk) score matrix of each slice is materialised in fp32 (plus P, dP, dS in the
backward): memory is about 16 * N * Lq * Lk bytes for N = batch * heads, and the GEMMs run one
slice at a time. Fine for the example sizes (sequence length up to a few hundred on CPU, a few
thousand on GPU); not a replacement for flash attention at long context.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..ops import det_bmm, det_finalize
from ..ops.dropout import DropoutKey, dropout_multiplier
from ..ops.trust import trusted_fn
from .functional import det_exp, det_row_sums
from .linear import DetLinear

__all__ = ["det_scaled_dot_product_attention", "DetMultiheadSelfAttention"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _row_sum(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """round(exact sum over the last dim of a (* b)): (N, M, W) fp32 -> (N, M, 1) fp32."""
    n, m, w = a.shape
    b2 = None if b is None else b.reshape(n * m, w)
    return det_finalize(det_row_sums(a.reshape(n * m, w), b2)).reshape(n, m, 1)


class _DetSDPA(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, q, k, v, mask, scale, plans, dropout):
        # q (N, Lq, E), k (N, Lk, E), v (N, Lk, Ev); mask None, bool (N, Lq, Lk) or float (N, Lq, Lk);
        # dropout None or (p, DropoutKey, B): N = B * heads, sample b owns slices b * N/B ...
        qf, kf, vf = q.float(), k.float(), v.float()  # exact widening
        scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)  # rounded once, fixed
        s = det_bmm(qf, kf, out_dtype=torch.float32, plans=plans) * scale_t
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
        # a fully masked query row (HF's left padding) gets p = 0, so output 0 and no gradient: the
        # bytes of PyTorch's SDPA, whose math path uses a safe softmax
        m = s.amax(dim=-1, keepdim=True)
        e = det_exp(s - m.masked_fill(m == float("-inf"), 0.0))
        total = _row_sum(e)
        p = e / total.masked_fill(total == 0, 1.0)
        keep = None
        if dropout is not None:
            keep = _dropout_keep(p, dropout)
        out = det_bmm(p if keep is None else p * keep, vf.transpose(1, 2), out_dtype=q.dtype, plans=plans)
        ctx.save_for_backward(qf, kf, vf, p, scale_t, keep)
        ctx.dtypes, ctx.plans = (q.dtype, k.dtype, v.dtype), plans
        return out

    @staticmethod
    @trusted_fn
    def backward(ctx, d_out):
        qf, kf, vf, p, scale_t, keep = ctx.saved_tensors
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        do = d_out.float()
        dq = dk = dv = None
        if ctx.needs_input_grad[2]:
            pd = p if keep is None else p * keep
            dv = det_bmm(pd.transpose(1, 2), do.transpose(1, 2), out_dtype=v_dtype, plans=ctx.plans)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dp = det_bmm(do, vf, out_dtype=torch.float32, plans=ctx.plans)
            if keep is not None:
                dp = dp * keep  # the gradient through P * keep: the same mask and scale
            ds = p * (dp - _row_sum(p, dp)) * scale_t  # masked keys: p == 0, so ds == 0
            if ctx.needs_input_grad[0]:
                dq = det_bmm(ds, kf.transpose(1, 2), out_dtype=q_dtype, plans=ctx.plans)
            if ctx.needs_input_grad[1]:
                dk = det_bmm(ds.transpose(1, 2), qf.transpose(1, 2), out_dtype=k_dtype, plans=ctx.plans)
        return dq, dk, dv, None, None, None, None


def _dropout_keep(p: torch.Tensor, dropout) -> torch.Tensor:
    """fp32 (N, Lq, Lk): 1/(1-p) where the keyed mask keeps P's element, 0 elsewhere."""
    prob, key, b = dropout
    return dropout_multiplier(p.view(b, -1), prob, key).view(p.shape)


def _dropout_arg(dropout_p, dropout_key, lead):
    """None (no dropout) or (p, key, batch size) for _DetSDPA, checked."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}")
    if dropout_p == 0:
        return None
    if not isinstance(dropout_key, DropoutKey):
        raise ValueError(
            f"dropout_key: dropout_p={dropout_p} needs the call's DropoutKey (keyed masks, the same for a sample "
            "at every world size); under det_ddp det_function_mode passes it, got "
            f"{type(dropout_key).__name__}")
    if len(lead) < 1 or lead[0] != dropout_key.samples:
        raise ValueError(f"query: expected its first dimension to be the batch of {dropout_key.samples} samples "
                         f"(dropout_key.samples), got leading dimensions {lead}")
    return float(dropout_p), dropout_key, lead[0]


def _check(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    if t.dim() < 3:
        raise ValueError(f"{name}: expected shape (..., L, E) with at least 3 dimensions, e.g. (B, H, L, E), "
                         f"got {tuple(t.shape)}")


def det_scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    *,
    plans="default",
    dropout_key: Optional[DropoutKey] = None,
) -> torch.Tensor:
    """Exact, batch- and head-invariant ``F.scaled_dot_product_attention`` (see the module docstring).

    Args:
        query: (..., Lq, E), e.g. (B, H, Lq, E); float32, bfloat16 or float16.
        key: (..., Lk, E), the same leading dims and dtype as ``query``.
        value: (..., Lk, Ev), the same leading dims and dtype as ``query``.
        attn_mask: optional, broadcastable to (..., Lq, Lk): bool (True = may attend) or float
            (added to the scores). Treated as a constant (no gradient).
        dropout_p: attention dropout, applied to the probabilities as PyTorch does (``P * m``
            before ``P @ V``, ``m`` = 1/(1-p) where kept, 0 where dropped; the backward uses the
            same ``m``). The mask is keyed (:mod:`lightning_det.ops.dropout`) over each sample's
            (head, query, key) elements: ``dropout_key`` is required when dropout_p > 0, and
            the first dimension of query is the batch (its size is ``dropout_key.samples``).
        is_causal: query r attends keys j <= r (upper-left aligned, as PyTorch). Not with attn_mask.
        scale: score scale, default ``1 / sqrt(E)``.
        plans: how the exact GEMMs plan their integer slices, as
            :func:`lightning_det.ops.det_gemm`'s (the bytes never depend on it).
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
    if tuple(key.shape) != (*lead, lk, e):
        raise ValueError(f"key: expected shape {(*lead, 'Lk', e)} matching query {tuple(query.shape)}, "
                         f"got {tuple(key.shape)}")
    if tuple(value.shape[:-1]) != (*lead, lk):
        raise ValueError(f"value: expected shape {(*lead, lk, 'Ev')} matching key {tuple(key.shape)}, "
                         f"got {tuple(value.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype or t.device != query.device:
            raise ValueError(f"{name}: expected dtype {query.dtype} on {query.device} like query, "
                             f"got {t.dtype} on {t.device}")
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (as F.scaled_dot_product_attention)")
    n = math.prod(lead)
    mask = None
    if is_causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril().expand(n, lq, lk)
    elif attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a tensor or None, got {type(attn_mask).__name__}")
        try:
            mask = attn_mask.to(query.device).expand(*lead, lq, lk).reshape(n, lq, lk)
        except RuntimeError as err:
            raise ValueError(f"attn_mask: expected a shape broadcastable to {(*lead, lq, lk)}, "
                             f"got {tuple(attn_mask.shape)}") from err
        if mask.dtype != torch.bool:
            mask = mask.detach()
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    dropout = _dropout_arg(dropout_p, dropout_key, lead)
    out = _DetSDPA.apply(query.reshape(n, lq, e), key.reshape(n, lk, e), value.reshape(n, lk, value.shape[-1]),
                         mask, scale, plans, dropout)
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
        state = self.qkv.step_state
        y = det_scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                             plans="default" if state is None else state.plans)
        return self.proj(y.transpose(1, 2).reshape(b, l, self.dim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_heads={self.n_heads}, exact=True"
