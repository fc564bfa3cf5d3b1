"""The fused deterministic attention kernels (``ldet::attention_fwd`` / ``attention_bwd`` /
``attention_probs``; the definition they compute: csrc/attention.h).

Each (batch, head) slice is computed on its own, as fixed chains of fp32 operations, so every
result is a function of its own slice's inputs: the same bytes for any batch, head count,
tiling, thread count and device. Nothing of size (Lq, Lk) is stored: the backward recomputes
scores and weights from the inputs and the forward's row statistics.

Shapes: q (B, H, Lq, E), k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev), H a multiple of Hkv (query head
h reads key/value head h // (H // Hkv)); one dtype of float32, bfloat16, float16; head
dimensions up to 256. ``mask``: None, or a bool (True: may attend) or float (added to the
scores) tensor broadcastable to (B, H, Lq, Lk).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._registry import ldet
from .dropout import DropoutKey, dropout_scale, keep_threshold

__all__ = ["AttentionDropout", "attention_forward", "attention_backward", "attention_probs"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class AttentionDropout(NamedTuple):
    """Dropout of the attention weights: probability ``p`` and the call's keyed masks; sample b of
    the batch is global sample ``key.offset + b`` (``key.samples`` must equal B)."""

    p: float
    key: DropoutKey


def _fp32_value(x: float, name: str) -> float:
    v = torch.tensor(float(x), dtype=torch.float32).item()  # rounded once to fp32
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: expected a finite float, got {x!r}")
    return v


def _dropout_args(dropout: Optional[AttentionDropout], batch: int):
    if dropout is None or dropout.p == 0:
        return [], 1.0
    if dropout.key.samples != batch:
        raise ValueError(f"dropout: expected key.samples == {batch} (the batch of q), got {dropout.key.samples}")
    k = dropout.key
    return [keep_threshold(dropout.p), k.seed, k.step, k.offset, k.site], dropout_scale(dropout.p, torch.float32)


def _mask4(mask: Optional[torch.Tensor], q: torch.Tensor, lk: int) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected a tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and mask.dtype not in _FLOATS:
        raise TypeError(f"mask: expected dtype bool, float32, bfloat16 or float16, got {mask.dtype}")
    b, h, lq, _ = q.shape
    try:
        return mask.to(q.device).expand(b, h, lq, lk)
    except RuntimeError as err:
        raise ValueError(f"mask: expected a shape broadcastable to {(b, h, lq, lk)}, got {tuple(mask.shape)}") from err


def _last_dim_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      scale: float = 1.0, causal: bool = False, dropout: Optional[AttentionDropout] = None):
    """``(o, stats)``: the output (B, H, Lq, Ev) in float32 and each row's (m, r), (B, H, Lq, 2)
    float32, which :func:`attention_backward` and :func:`attention_probs` take."""
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    drop, mult = _dropout_args(dropout, q.shape[0])
    return ldet().attention_fwd(q, k, v, _mask4(mask, q, k.shape[2]), _fp32_value(scale, "scale"), bool(causal),
                                drop, mult)


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       stats: torch.Tensor, mask: Optional[torch.Tensor] = None, scale: float = 1.0,
                       causal: bool = False, dropout: Optional[AttentionDropout] = None):
    """``(dq, dk, dv)`` in float32 for the output gradient ``dout`` (cast to q's dtype)."""
    q, k, v = (_last_dim_unit(t) for t in (q, k, v))
    drop, mult = _dropout_args(dropout, q.shape[0])
    return ldet().attention_bwd(dout.to(q.dtype).contiguous(), q, k, v, o, stats, _mask4(mask, q, k.shape[2]),
                                _fp32_value(scale, "scale"), bool(causal), drop, mult)


def attention_probs(q: torch.Tensor, k: torch.Tensor, stats: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """The attention weights p (B, H, Lq, Lk) float32 of the forward that gave ``stats`` (before
    dropout; 0 where a key is not allowed): the forward's own values, for ``need_weights``."""
    q, k = _last_dim_unit(q), _last_dim_unit(k)
    return ldet().attention_probs(q, k, stats, _mask4(mask, q, k.shape[2]), _fp32_value(scale, "scale"),
                                  bool(causal))
