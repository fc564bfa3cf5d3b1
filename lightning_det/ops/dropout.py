"""Keyed dropout masks (``ldet::dropout_mask``, stream layout in csrc/dropout.h).

Whether an element is kept is a pure function of (seed, optimizer step, global sample index
within the step, call-site key, element index within the sample), drawn from Philox 4x32-10
with integer arithmetic only. A sample's mask therefore does not depend on the world size, the
micro-batch split, the other samples computed with it, thread counts or the device: CPU and
CUDA give the same bits by construction.

Dropout itself is ``y = x * m`` with ``m = scale`` where kept and ``0`` where dropped (the
autograd formula multiplies the gradient by the same ``m``): one IEEE multiply per element,
``scale = 1 / (1 - p)`` rounded to fp32 and then to x's dtype (a bf16/fp16 product of two
values of that dtype is exact in fp32 and rounded once), as PyTorch's CPU dropout does.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ._registry import ldet
from .args import as_index
from .longacc import _check_float
from .trust import trusted

__all__ = ["DropoutKey", "site_key", "keep_threshold", "dropout_scale", "dropout_mask", "dropout_multiplier",
           "keyed_dropout"]

_TWO_32 = 1 << 32
_TWO_63 = 1 << 63


def site_key(name: str) -> int:
    """The 64-bit call-site key of a site name (first 8 bytes of BLAKE2b, as a signed int64):
    the same in every process and Python version, unlike ``hash``."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


@dataclass(frozen=True)
class DropoutKey:
    """Everything that picks one dropout call's masks, except the element.

    Args:
        seed: the dropout seed, in [0, 2^63).
        step: the optimizer step, in [0, 2^63).
        offset: global index, within the step, of the first sample of the call's batch.
        samples: the number of samples the call's input must hold along its batch dimension.
        site: the call site's 64-bit key (:func:`site_key`); two sites draw independent masks.
    """

    seed: int
    step: int
    offset: int
    samples: int
    site: int

    def __post_init__(self) -> None:
        for name, lo, hi in (("seed", 0, _TWO_63), ("step", 0, _TWO_63), ("offset", 0, _TWO_32),
                             ("samples", 1, _TWO_32), ("site", -_TWO_63, _TWO_63)):
            v = as_index(getattr(self, name))
            if v is None or not lo <= v < hi:
                raise ValueError(f"{name}: expected an integer in [{lo}, {hi}), got {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        if self.offset + self.samples > _TWO_32:
            raise ValueError(f"offset, samples: expected offset + samples <= 2^32, got {self.offset} + {self.samples}")


def _check_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"p: expected a float, got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p: dropout probability has to be between 0 and 1, but got {p}")
    return p


def keep_threshold(p: float) -> int:
    """The integer threshold of probability ``p``: an element is dropped when its 32-bit draw
    is below ``round(p * 2^32)`` (so it is kept with probability ``1 - threshold / 2^32``)."""
    return round(_check_p(p) * _TWO_32)  # p * 2^32 is exact; round half to even


def dropout_scale(p: float, dtype: torch.dtype) -> float:
    """``1 / (1 - p)`` rounded to fp32, then to ``dtype`` (0.0 for p == 1, where nothing is kept)."""
    p = _check_p(p)
    if p == 1.0:
        return 0.0
    return torch.tensor(1.0 / (1.0 - p), dtype=torch.float32).to(dtype).item()


def _batch_dim(x: torch.Tensor, batch_dim, key: DropoutKey) -> int:
    d = as_index(batch_dim)
    if d is None or not -x.dim() <= d < x.dim():
        raise ValueError(f"batch_dim: expected a dimension of x (shape {tuple(x.shape)}), got {batch_dim!r}")
    d %= x.dim()
    if x.shape[d] != key.samples:
        raise ValueError(
            f"x: expected dimension {d} (batch_dim) to hold the {key.samples} samples of this micro-batch, "
            f"got shape {tuple(x.shape)}. Each sample's mask is keyed by its global index, so the batch "
            "dimension must be known: pass batch_dim (1 for sequence-first (L, B, ...) tensors)"
        )
    return d


def dropout_mask(x: torch.Tensor, p: float, key: DropoutKey, batch_dim: int = 0) -> torch.Tensor:
    """bool tensor of x's shape, True where the element is kept (x is read for shape and device).

    Element ``x[..., b, ...]`` (``b`` at ``batch_dim``) belongs to global sample ``key.offset + b``;
    its index within the sample is its row-major index with the batch dimension taken out.
    """
    _check_float(x, "x")
    if not isinstance(key, DropoutKey):
        raise TypeError(f"key: expected a DropoutKey, got {type(key).__name__}")
    d = _batch_dim(x, batch_dim, key)
    return ldet().dropout_mask(x, d, keep_threshold(p), key.seed, key.step, key.offset, key.site)


def keyed_dropout(x: torch.Tensor, p: float, key: DropoutKey, batch_dim: int = 0,
                  inplace: bool = False) -> torch.Tensor:
    """``x * m``, ``m`` = :func:`dropout_scale` where :func:`dropout_mask` keeps, 0 elsewhere.

    Differentiable in x (the gradient is multiplied by the same ``m``). ``p == 0`` returns x.
    ``inplace`` multiplies x in place, as ``F.dropout(..., inplace=True)``.
    """
    p = _check_p(p)
    if p == 0.0:
        return x
    m = dropout_multiplier(x, p, key, batch_dim)
    return x.mul_(m) if inplace else x * m


def dropout_multiplier(x: torch.Tensor, p: float, key: DropoutKey, batch_dim: int = 0) -> torch.Tensor:
    """``m`` of :func:`keyed_dropout`: x's shape and dtype, :func:`dropout_scale` where kept, 0 elsewhere."""
    keep = dropout_mask(x, p, key, batch_dim)
    with trusted():  # a cast and a multiply by a representable value: exact, no audit noise
        return keep.to(x.dtype).mul_(dropout_scale(p, x.dtype))
