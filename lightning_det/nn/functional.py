"""Functional forms of the Det activations and the exact row/column sums behind the Det norms.

Every activation here is computed elementwise in fp64 by ``csrc/detmath.h`` (only IEEE
+, -, *, / and fma, and exact bit manipulation, no library transcendental, no compiler-chosen FMA
contraction) and rounded once to the input's dtype. So an element's result depends only on its
own value: not on its position in the tensor, the number of rows beside it, the thread count, or
the device (CPU == CUDA).
PyTorch's own CPU kernels do not promise that (docs/det_modules.md).

Shapes: any; dtypes float32, bfloat16 or float16; output has the input's shape and dtype.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _build
from ..ops.longacc import LongAcc, _check_float

__all__ = ["det_gelu", "det_silu", "det_tanh", "det_relu", "det_exp", "det_row_sums", "det_col_sums"]

_KINDS = {"gelu_erf": 0, "gelu_tanh": 1, "silu": 2, "tanh": 3, "exp": 4}
_WORDS = 19


def _ops():
    _build.load()
    return torch.ops.ldet


def _act(x: torch.Tensor, kind: int) -> torch.Tensor:
    _check_float(x, "x")
    return _ops().act(x, kind)


def det_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, ``approximate`` ``"none"`` (x * Phi(x), erf form) or ``"tanh"``, as ``F.gelu``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")
    return _act(x, _KINDS["gelu_erf" if approximate == "none" else "gelu_tanh"])


def det_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU, x * sigmoid(x), as ``F.silu``."""
    return _act(x, _KINDS["silu"])


def det_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh, as ``torch.tanh``."""
    return _act(x, _KINDS["tanh"])


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """exp, as ``torch.exp``: fp64 ``detmath.h`` exp (relative error ~1e-16) rounded once.

    Used by the det softmax of :mod:`lightning_det.nn.attention`; exp(-inf) is +0.0, exp(nan)
    is nan, overflow gives +inf.
    """
    return _act(x, _KINDS["exp"])


def det_relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU. ``torch.relu`` is already exact (a select), so this is it; kept for symmetry."""
    return torch.relu(x)


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
    return _ops().dot_rows(a, b)


def det_col_sums(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> LongAcc:
    """Exact ``(a * b).sum(0)`` as digits: a, b (R, W) float -> LongAcc (W, 19).

    Column sums over any split of the rows, combined with ``det_combine``, give the same digits.
    """
    _check_dot(a, b)
    return _ops().dot_cols(a, b)


def _register() -> None:
    lib = "ldet::"

    @torch.library.register_fake(lib + "act")
    def _(x, kind):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "act_backward")
    def _(grad, x, kind):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "act_fp64")
    def _(x, kind, grad=None):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(lib + "dot_rows")
    def _(a, b=None):
        return a.new_empty((a.shape[0], _WORDS), dtype=torch.int64)

    @torch.library.register_fake(lib + "dot_cols")
    def _(a, b=None):
        return a.new_empty((a.shape[1], _WORDS), dtype=torch.int64)

    @torch.library.register_fake(lib + "ce_row_loss")
    def _(m, picked, t_minus):
        return torch.empty_like(m)

    def _act_setup(ctx, inputs, output):
        x, kind = inputs
        ctx.save_for_backward(x)
        ctx.kind = kind

    def _act_backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ops.ldet.act_backward(grad.contiguous(), x, ctx.kind), None

    torch.library.register_autograd(lib + "act", _act_backward, setup_context=_act_setup)


_build.on_load(_register)
