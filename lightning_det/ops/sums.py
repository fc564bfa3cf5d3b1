"""Exact row and column sums of products as digits (``ldet::dot_rows`` / ``ldet::dot_cols``).

Each product of two fp32/bf16/fp16 values is exact in fp64 and every sum is exact in the long
accumulator, so row r's digits depend only on row r, and column sums over any split of the rows,
combined with :func:`lightning_det.ops.det_combine`, give the same digits.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._registry import ldet
from .longacc import LongAcc, _check_float

__all__ = ["det_row_sums", "det_col_sums"]


def _check_dot(a: torch.Tensor, b: Optional[torch.Tensor]) -> None:
    _check_float(a, "a")
    if a.dim() != 2:
        raise ValueError(f"a: expected a 2-D (R, W) tensor, got shape {tuple(a.shape)}")
    if b is not None:
        _check_float(b, "b")
        if b.shape != a.shape or b.device != a.device:
            raise ValueError(f"b: expected shape {tuple(a.shape)} on {a.device} like a, got {tuple(b.shape)} on {b.device}")


def det_row_sums(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> LongAcc:
    """Exact ``(a * b).sum(1)`` as digits: a, b (R, W) float -> LongAcc (R, 19).

    Each product is formed exactly (fp64 holds the product of two fp32/bf16/fp16 values), so
    row r's digits depend only on row r. ``b=None`` sums ``a`` itself.
    """
    _check_dot(a, b)
    return ldet().dot_rows(a, b)


def det_col_sums(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> LongAcc:
    """Exact ``(a * b).sum(0)`` as digits: a, b (R, W) float -> LongAcc (W, 19).

    Column sums over any split of the rows, combined with ``det_combine``, give the same digits.
    """
    _check_dot(a, b)
    return ldet().dot_cols(a, b)
