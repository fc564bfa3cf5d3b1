"""Plain-Python/PyTorch reference for the fused norm ops ``ldet::norm_forward`` and
``ldet::norm_backward`` (LayerNorm and RMSNorm over the last dimension of an (R, W) tensor).

Independent of csrc/: every row sum is the exact sum from :mod:`longacc_ref` (Python integers,
rounded once to fp32 nearest-even); everything else is one eager CPU torch op per IEEE
operation, written in the kernels' order. Separate eager ops are single correctly rounded
operations (no FMA contraction across ops), divisions are tensor by tensor (``tensor /
python_scalar`` may become a multiply by the reciprocal), and the square root is an fp64
``torch.sqrt`` (never ``rsqrt``). Slow by design; use it on small shapes.

The arithmetic, per row of width W (all fp32 unless said):

    forward   xf = x widened to fp32
              mean = round(sum_j xf_j) / W              (LayerNorm; RMSNorm: d = xf)
              d = xf - mean
              var = round(sum_j d_j * d_j) / W
              rstd = fp32(1 / sqrt_fp64(fp64(var + fp32(eps))))
              xhat = d * rstd ;  y = xhat (* weight) (+ bias), rounded to x's dtype
    backward  g = gy widened to fp32 (* weight)
              m2 = round(sum_j g_j * xhat_j) / W ;  t = xhat * m2
              LayerNorm: m1 = round(sum_j g_j) / W ;  g = g - m1
              gx = (g - t) * rstd, rounded to out_dtype
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .longacc_ref import gemm_rounded

__all__ = ["norm_forward_ref", "norm_backward_ref"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _row_sums(a: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """round(exact sum_j a_j * b_j) per row as an (R,) fp32 tensor; ``b=None`` sums ``a``."""
    if b is None:
        b = torch.ones_like(a)
    sums = [gemm_rounded(a[r : r + 1], b[r : r + 1]).reshape(1) for r in range(a.shape[0])]
    return torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float32)


def _row_mean(a: torch.Tensor, b: Optional[torch.Tensor], width: torch.Tensor) -> torch.Tensor:
    """round(exact sum_j a_j * b_j) / W as an (R, 1) column; ``width`` is an (R,) fp32 tensor."""
    return (_row_sums(a, b) / width).unsqueeze(1)


def _check(t: torch.Tensor, name: str, shape, dtypes) -> None:
    assert isinstance(t, torch.Tensor) and t.dtype in dtypes, f"{name}: dtype {getattr(t, 'dtype', type(t))}"
    assert tuple(t.shape) == tuple(shape), f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}"


def norm_forward_ref(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, rms: bool
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference ``ldet::norm_forward``: x (R, W) float32/bfloat16/float16, weight/bias (W,)
    float32 or None -> (y (R, W) of x's dtype, xhat (R, W) fp32, rstd (R,) fp32)."""
    assert x.dim() == 2, f"x: expected a 2-D (R, W) tensor, got shape {tuple(x.shape)}"
    _check(x, "x", x.shape, _FLOATS)
    rows, width = x.shape
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, (width,), (torch.float32,))
    x = x.cpu()
    xf = x.float()
    wt = torch.full((rows,), float(width), dtype=torch.float32)
    d = xf if rms else xf - _row_mean(xf, None, wt)
    var = _row_sums(d, d) / wt
    # the add in fp32 (eps rounded to fp32 by full_like), then fp64 sqrt and division, one
    # rounding back to fp32
    t = (var + torch.full_like(var, eps)).double()
    rstd = (torch.ones_like(t) / torch.sqrt(t)).float()
    xhat = d * rstd.unsqueeze(1)
    y = xhat
    if weight is not None:
        y = y * weight.cpu().reshape(1, width)
    if bias is not None:
        y = y + bias.cpu().reshape(1, width)
    return y.to(x.dtype), xhat, rstd


def norm_backward_ref(
    gy: torch.Tensor,
    xhat: torch.Tensor,
    rstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    rms: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reference ``ldet::norm_backward``: gy (R, W) float32/bfloat16/float16, xhat (R, W) fp32,
    rstd (R,) fp32, weight (W,) fp32 or None -> gx (R, W) of ``out_dtype``."""
    assert gy.dim() == 2, f"gy: expected a 2-D (R, W) tensor, got shape {tuple(gy.shape)}"
    _check(gy, "gy", gy.shape, _FLOATS)
    rows, width = gy.shape
    _check(xhat, "xhat", (rows, width), (torch.float32,))
    _check(rstd, "rstd", (rows,), (torch.float32,))
    if weight is not None:
        _check(weight, "weight", (width,), (torch.float32,))
    assert out_dtype in _FLOATS, f"out_dtype: {out_dtype}"
    xhat = xhat.cpu()
    wt = torch.full((rows,), float(width), dtype=torch.float32)
    g = gy.cpu().float()
    if weight is not None:
        g = g * weight.cpu().reshape(1, width)
    t = xhat * _row_mean(g, xhat, wt)
    if not rms:
        g = g - _row_mean(g, None, wt)
    return ((g - t) * rstd.cpu().unsqueeze(1)).to(out_dtype)
