"""DetAdaptiveAvgPool1d, DetAdaptiveAvgPool2d and DetMaxPool2d: pooling with exact gradients.

**Max pooling** selects, which is exact; PyTorch's backward then adds the gradients of every
window whose maximum an element is (overlapping windows, e.g. ResNet's 3 x 3 stride-2 stem pool)
in floating point, one rounding per window. DetMaxPool2d keeps PyTorch's forward (the selection
and its indices) and sums those gradients exactly (``scatter_sum_digits`` by input element),
rounded once.

**Adaptive average pooling**:

Where the input's height and width are multiples of the output's (global average pooling, output
1 x 1, always is), the regions do not overlap and each output is (the 1-D pooling: a 2-D one of
width 1)

    y = round_fp32(exact sum of the region) / n          (IEEE division by the region size n)

and each input element's gradient is its one region's ``dy / n``. Both depend on the sample
alone, in any batch size, thread count or vector width. PyTorch's own kernel sums in floating
point in an order of its choosing.

Overlapping regions (a size that does not divide) would send two gradients into one element, a
float sum of two rounded values: that case runs PyTorch's ``F.adaptive_avg_pool2d`` outside the
det trusted region, so det_ddp's op audit sees it and reports it (strict mode raises).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import det_finalize, scatter_sum_digits
from ..ops.trust import trusted_fn
from .functional import det_row_sums, div_by_count, fresh

__all__ = ["DetAdaptiveAvgPool1d", "DetAdaptiveAvgPool2d", "DetMaxPool2d"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _DetAvgPoolFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, oh, ow):
        B, C, H, W = x.shape
        kh, kw = H // oh, W // ow
        rows = x.reshape(B, C, oh, kh, ow, kw).permute(0, 1, 2, 4, 3, 5).reshape(-1, kh * kw)
        y = div_by_count(det_finalize(det_row_sums(rows)), kh * kw)
        ctx.geom = (B, C, oh, kh, ow, kw)
        ctx.x_dtype = x.dtype
        return fresh(y.view(B, C, oh, ow).to(x.dtype))  # not a view: in-place ops on it work

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        B, C, oh, kh, ow, kw = ctx.geom
        g = div_by_count(gy.float(), kh * kw).to(ctx.x_dtype).view(B, C, oh, 1, ow, 1)
        return g.expand(B, C, oh, kh, ow, kw).reshape(B, C, oh * kh, ow * kw), None, None


class DetAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` with exact region sums (module docstring). Input (B, C, H, W) or
    (C, H, W), float32/bfloat16/float16."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS or input.dim() not in (3, 4):
            raise TypeError(f"input: expected a 3-D or 4-D float32/bfloat16/float16 tensor, got "
                            f"{getattr(input, 'dtype', type(input))} of shape {tuple(getattr(input, 'shape', ()))}")
        if input.dim() == 3:
            return self.forward(input.unsqueeze(0)).squeeze(0)
        size = self.output_size
        oh, ow = (size, size) if isinstance(size, int) else size
        H, W = input.shape[2:]
        oh, ow = oh or H, ow or W  # None keeps the input's size
        if H % oh or W % ow:
            return F.adaptive_avg_pool2d(input, (oh, ow))  # visible to the op audit (module docstring)
        return _DetAvgPoolFn.apply(input, oh, ow)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"


class DetAdaptiveAvgPool1d(nn.AdaptiveAvgPool1d):
    """``nn.AdaptiveAvgPool1d`` with exact region sums (module docstring): Swin's and other token
    poolers. Input (B, C, L) or (C, L), float32/bfloat16/float16."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS or input.dim() not in (2, 3):
            raise TypeError(f"input: expected a 2-D or 3-D float32/bfloat16/float16 tensor, got "
                            f"{getattr(input, 'dtype', type(input))} of shape {tuple(getattr(input, 'shape', ()))}")
        if input.dim() == 2:
            return self.forward(input.unsqueeze(0)).squeeze(0)
        size = self.output_size
        o = size[0] if isinstance(size, (tuple, list)) else size
        L = input.shape[2]
        o = o or L
        if L % o:
            return F.adaptive_avg_pool1d(input, o)  # visible to the op audit (module docstring)
        return _DetAvgPoolFn.apply(input.unsqueeze(-1), o, 1).squeeze(-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"


class _DetMaxPoolFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, x, kernel_size, stride, padding, dilation, ceil_mode):
        y, idx = F.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode, return_indices=True)
        ctx.save_for_backward(idx)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.mark_non_differentiable(idx)
        return y, idx

    @staticmethod
    @trusted_fn
    def backward(ctx, gy, _gidx):
        (idx,) = ctx.saved_tensors
        B, C, H, W = ctx.x_shape
        planes = torch.arange(B * C, device=idx.device).view(B, C, 1, 1) * (H * W)
        # every window's gradient into its maximum's element: exact sums, one rounding each
        acc = scatter_sum_digits(gy.reshape(-1, 1), (idx + planes).reshape(-1), B * C * H * W)
        return det_finalize(acc, ctx.x_dtype).view(B, C, H, W), None, None, None, None, None


class DetMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose backward sums overlapping windows' gradients exactly (module
    docstring). Input (B, C, H, W) or (C, H, W), float32/bfloat16/float16."""

    def forward(self, input: torch.Tensor):
        if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS or input.dim() not in (3, 4):
            raise TypeError(f"input: expected a 3-D or 4-D float32/bfloat16/float16 tensor, got "
                            f"{getattr(input, 'dtype', type(input))} of shape {tuple(getattr(input, 'shape', ()))}")
        if input.dim() == 3:
            out = self.forward(input.unsqueeze(0))
            return tuple(t.squeeze(0) for t in out) if self.return_indices else out.squeeze(0)
        y, idx = _DetMaxPoolFn.apply(input, self.kernel_size, self.stride, self.padding, self.dilation,
                                     self.ceil_mode)
        return (y, idx) if self.return_indices else y

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"
