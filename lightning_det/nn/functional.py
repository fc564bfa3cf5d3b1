"""Functional forms of the Det activations, and the exact row/column sums behind the Det norms
(:mod:`lightning_det.ops.sums`, re-exported here).

Every activation here is computed elementwise in fp64 by ``csrc/detmath.h`` (only IEEE
+, -, *, / and fma, and exact bit manipulation, no library transcendental, no compiler-chosen FMA
contraction) and rounded once to the input's dtype. So an element's result depends only on its
own value: not on its position in the tensor, the number of rows beside it, the thread count, or
the device (CPU == CUDA).
PyTorch's own CPU kernels do not promise that (docs/det_modules.md).

Shapes: any; dtypes float32, bfloat16 or float16; output has the input's shape and dtype.
"""
from __future__ import annotations

import torch

from ..ops.activation import act
from ..ops.sums import det_col_sums, det_row_sums

__all__ = ["det_gelu", "det_silu", "det_tanh", "det_sigmoid", "det_relu", "det_exp", "det_sin", "det_cos",
           "det_row_sums", "det_col_sums", "div_by_count", "fresh"]


def fresh(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it where it is a view: what an autograd Function returns must not be a
    view of a tensor made inside it, or an in-place op on the output (``relu_``, ``+=``) raises."""
    return t.clone() if t._is_view() else t


def div_by_count(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t / n``, one IEEE division per element on every device (n < 2^24).

    The divisor is a 0-d fp32 tensor on t's device: PyTorch's CUDA kernel turns a division by a
    Python number (or a CPU scalar tensor) into a multiply by the rounded reciprocal, which the
    CPU does not, so ``t / n`` with n not a power of two can differ between the two."""
    return t / torch.full((), float(n), dtype=torch.float32, device=t.device)


def det_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, ``approximate`` ``"none"`` (x * Phi(x), erf form) or ``"tanh"``, as ``F.gelu``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return act(x, "gelu_erf" if approximate == "none" else "gelu_tanh")


def det_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU, x * sigmoid(x), as ``F.silu``."""
    return act(x, "silu")


def det_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh, as ``torch.tanh``."""
    return act(x, "tanh")


def det_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid, as ``torch.sigmoid``: 1 / (1 + exp(-x)) (for x < 0 exp(x) / (1 + exp(x))) in fp64,
    rounded once; its gradient s * sigmoid(-x), without the cancellation of s * (1 - s).
    PyTorch's CPU sigmoid is position-dependent at odd widths (docs/det_modules.md)."""
    return act(x, "sigmoid")


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """exp, as ``torch.exp``: fp64 ``detmath.h`` exp (relative error ~1e-16) rounded once.

    Used by the det softmax (:mod:`lightning_det.nn.matmul`) and the fused attention; exp(-inf) is +0.0, exp(nan)
    is nan, overflow gives +inf.
    """
    return act(x, "exp")


def det_sin(x: torch.Tensor) -> torch.Tensor:
    """sin, as ``torch.sin``: fp64 ``detmath.h`` sin (exact Payne-Hanek reduction for large
    arguments, relative error ~2e-16) rounded once. inf and nan give nan."""
    return act(x, "sin")


def det_cos(x: torch.Tensor) -> torch.Tensor:
    """cos, as ``torch.cos``; see :func:`det_sin`. Rotary position embeddings (Llama's) call it
    through ``det_function_mode``."""
    return act(x, "cos")


def det_relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU. ``torch.relu`` is already exact (a select), so this is it; kept for symmetry."""
    return torch.relu(x)
