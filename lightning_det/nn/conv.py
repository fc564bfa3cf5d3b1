"""DetConv1d, DetConv2d: ``nn.Conv1d`` / ``nn.Conv2d`` as exact implicit GEMMs.

A convolution is a GEMM over patches. With ``cols`` the patches of the zero-padded input (im2col,
one row per (sample, output position), columns ordered (in-channel, kernel row, kernel column),
pure data movement) and ``W2`` the weight as (out, in/groups * kernel), for each group g:

    y[:, g]  = det_gemm(cols[:, g], W2[g], bias[g])      one rounding, bias inside the accumulator
    dW[g]    = exact sum over (sample, position) of dy[:, g]^T cols[:, g]     (digits)
    db       = exact column sums of dy over (sample, position)                (digits)

The input gradient is one exact GEMM too, not ``F.fold``'s float summation of overlapping
patches: it is the convolution of the output gradient, dilated by the stride (zeros inserted) and
padded by ``dilation * (kernel - 1)``, with the spatially flipped, channel-transposed kernel. Each
element of dX is the exact sum of every ``dy * w`` product that reaches it, rounded once; the
gradient of the padded input is then cropped to the input.

So each output row depends only on its own sample (batch invariant), and every sum is exact in any
tiling or thread count. Groups run one GEMM per group (groups=1, depthwise groups=C and anything
between). Bound to a step state (digit mode, :mod:`lightning_det.nn.grad_digits`), dW and db go to
it unrounded, like DetLinear's.

Padding values, and the zeros the input gradient inserts between strided positions, multiply
weights like any other input: a weight of inf or NaN makes those products NaN (as in PyTorch's own
im2col convolution). Only ``padding_mode='zeros'`` is covered: reflect, replicate and circular
padding send two gradients to one input element, whose float sum would be a second rounding.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import det_combine, det_finalize, det_gemm, det_gemm_partial
from ..ops.trust import trusted_fn
from .functional import det_col_sums, fresh
from .step_state import StepState

__all__ = ["DetConv1d", "DetConv2d", "det_conv1d", "det_conv2d"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_IntOr = Union[int, Sequence[int]]


def _tuple2(v, name: str, minimum: int) -> Tuple[int, int]:
    t = (v, v) if isinstance(v, int) and not isinstance(v, bool) else tuple(v)
    if len(t) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) and i >= minimum for i in t):
        raise ValueError(f"{name}: expected an integer >= {minimum} or a pair of them, got {v!r}")
    return t  # type: ignore[return-value]


def _pads(padding, kernel, dilation, stride) -> Tuple[int, int, int, int]:
    """(top, bottom, left, right) zero padding of a padding argument: ints, 'valid' or 'same'
    (as PyTorch: total dilation * (kernel - 1), the odd unit on the bottom/right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding != "same":
            raise ValueError(f"padding: expected an int, a tuple of ints, 'valid' or 'same', got {padding!r}")
        if stride != (1, 1):
            raise ValueError(f"padding: 'same' is not supported for strided convolutions (stride={stride})")
        th, tw = dilation[0] * (kernel[0] - 1), dilation[1] * (kernel[1] - 1)
        return (th // 2, th - th // 2, tw // 2, tw - tw // 2)
    ph, pw = _tuple2(padding, "padding", 0)
    return (ph, ph, pw, pw)


def _param_grad(state: Optional[StepState], param: torch.Tensor, acc_fn):
    """The rounded gradient for autograd, or None when it went to the step state as digits."""
    dtype = param.dtype if param.dtype in _FLOATS else torch.float32
    if state is not None:
        state.contribute(param, lambda: acc_fn().reshape(*param.shape, -1),
                         lambda: det_finalize(acc_fn(), dtype).reshape(param.shape))
        return None
    return det_finalize(acc_fn(), dtype).reshape(param.shape)


def _patches(x: torch.Tensor, kernel, dilation, stride) -> torch.Tensor:
    """im2col of a (B, C, H, W) tensor: (B * L, C * kh * kw), rows (sample, position)."""
    cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (B, C*kh*kw, L)
    return cols.transpose(1, 2).reshape(-1, cols.shape[1])


def _channels_last_rows(t: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B * H * W, C)."""
    return t.permute(0, 2, 3, 1).reshape(-1, t.shape[1])


class _DetConvFn(torch.autograd.Function):
    # 4-D (B, C, H, W) inside; a 1-d convolution's 3-D input and weight (the Parameter itself,
    # which the state keys gradients by) are viewed with H = 1.
    @staticmethod
    @trusted_fn
    def forward(ctx, x, weight, bias, state, stride, pads, dilation, groups):
        ctx.one_d = x.dim() == 3
        if ctx.one_d:
            x, weight4 = x.unsqueeze(2), weight.unsqueeze(2)
        else:
            weight4 = weight
        ctx.params = (weight, bias)  # the state keys gradients by the Parameter objects
        weight = weight4
        kernel = tuple(weight.shape[2:])
        top, bottom, left, right = pads
        xp = F.pad(x, (left, right, top, bottom)) if any(pads) else x
        B, C, Hp, Wp = xp.shape
        O = weight.shape[0]
        Ho = (Hp - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
        Wo = (Wp - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
        if Ho < 1 or Wo < 1:
            raise ValueError(f"input: spatial size {tuple(x.shape[2:])} (padded {Hp, Wp}) is smaller than the "
                             f"dilated kernel {kernel} with dilation {dilation}")
        plans = state.plans if state is not None else "default"
        cols = _patches(xp, kernel, dilation, stride)
        w2 = weight.reshape(O, -1)
        og, kg = O // groups, w2.shape[1]
        outs = [det_gemm(cols[:, g * kg:(g + 1) * kg], w2[g * og:(g + 1) * og],
                         None if bias is None else bias[g * og:(g + 1) * og], out_dtype=x.dtype, plans=plans)
                for g in range(groups)]
        y2 = outs[0] if groups == 1 else torch.cat(outs, dim=1)
        ctx.save_for_backward(x, weight)
        ctx.state, ctx.plans = state, plans
        ctx.geom = (stride, pads, dilation, groups, (Hp, Wp), (Ho, Wo))
        # a fresh contiguous tensor, not a view: in-place ops on the output work (contiguous()
        # returns the view itself where it already is, a 1 x 1 output: fresh copies it then)
        y = y2.view(B, Ho, Wo, O).permute(0, 3, 1, 2)
        return fresh((y.squeeze(2) if ctx.one_d else y).contiguous())

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors  # 4-D
        param, bias = ctx.params
        if ctx.one_d:
            gy = gy.unsqueeze(2)
        stride, pads, dilation, groups, (Hp, Wp), (Ho, Wo) = ctx.geom
        state, plans = ctx.state, ctx.plans
        kernel = tuple(weight.shape[2:])
        B, C, H, W = x.shape
        O = weight.shape[0]
        og, cg = O // groups, C // groups
        gy = gy.to(x.dtype)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            # dX of the padded input = the stride-dilated, padded dy convolved with the flipped,
            # transposed kernel: every product reaching one input element in one exact sum
            gd = gy
            if stride != (1, 1):
                gd = gy.new_zeros(B, O, (Ho - 1) * stride[0] + 1, (Wo - 1) * stride[1] + 1)
                gd[:, :, ::stride[0], ::stride[1]] = gy
            eh, ew = dilation[0] * (kernel[0] - 1), dilation[1] * (kernel[1] - 1)
            rh, rw = Hp - gd.shape[2] - eh, Wp - gd.shape[3] - ew
            gd = F.pad(gd, (ew, ew + rw, eh, eh + rh))
            gcols = _patches(gd, kernel, dilation, (1, 1))  # (B*Hp*Wp, O*kh*kw)
            wt = weight.flip(2, 3)
            kk = kernel[0] * kernel[1]
            parts = [det_gemm(gcols[:, g * og * kk:(g + 1) * og * kk],
                              wt[g * og:(g + 1) * og].transpose(0, 1).reshape(cg, og * kk),
                              out_dtype=x.dtype, plans=plans) for g in range(groups)]
            gxp = (parts[0] if groups == 1 else torch.cat(parts, dim=1)).view(B, Hp, Wp, C).permute(0, 3, 1, 2)
            top, _, left, _ = pads
            gx = gxp[:, :, top:top + H, left:left + W]
            gx = gx.squeeze(2).contiguous() if ctx.one_d else gx.contiguous()
        want_w = ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        if want_w or want_b:
            gy2 = _channels_last_rows(gy)  # (B*Ho*Wo, O)
        if want_w:
            top, bottom, left, right = pads
            xp = F.pad(x, (left, right, top, bottom)) if any(pads) else x
            cols = _patches(xp, kernel, dilation, stride)
            kg = cols.shape[1] // groups

            def w_digits():  # dW[o, (c, kh, kw)] = sum over rows of dy[:, o] * cols[:, (c, kh, kw)]
                accs = [det_gemm_partial(gy2[:, g * og:(g + 1) * og].t(), cols[:, g * kg:(g + 1) * kg].t(),
                                         plans=plans) for g in range(groups)]
                return accs[0] if groups == 1 else torch.cat(accs, dim=0)

            gw = _param_grad(state, param, w_digits)
        if want_b:
            gb = _param_grad(state, bias, lambda: det_col_sums(gy2))
        return gx, gw, gb, None, None, None, None, None


def _check_conv_args(x, weight, bias, groups, dims: int, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"input: expected a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() != dims + 2:
        raise ValueError(f"input: expected a {dims + 2}-D (batch, channels, {'length' if dims == 1 else 'H, W'}) "
                         f"tensor for {what}, got shape {tuple(x.shape)}")
    if weight.dim() != dims + 2:
        raise ValueError(f"weight: expected a {dims + 2}-D (out, in/groups, kernel...) tensor, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"weight: expected dtype {x.dtype} on {x.device} like the input, got {weight.dtype} on {weight.device}")
    if not isinstance(groups, int) or groups < 1 or x.shape[1] % groups or weight.shape[0] % groups:
        raise ValueError(f"groups: expected a positive integer dividing in_channels={x.shape[1]} and "
                         f"out_channels={weight.shape[0]}, got {groups!r}")
    if weight.shape[1] * groups != x.shape[1]:
        raise ValueError(f"input: expected {weight.shape[1] * groups} channels (weight {tuple(weight.shape)}, "
                         f"groups={groups}), got shape {tuple(x.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias: expected shape ({weight.shape[0]},) of {x.dtype}, got {tuple(bias.shape)} of {bias.dtype}")


def det_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride: _IntOr = 1,
               padding: Union[str, _IntOr] = 0, dilation: _IntOr = 1, groups: int = 1, *,
               step_state: Optional[StepState] = None) -> torch.Tensor:
    """``F.conv2d`` exactly: every output, dX, dW and db element the exact sum rounded once.

    Args:
        x: (B, C, H, W) float32 / bfloat16 / float16. weight: (O, C / groups, kh, kw) of x's dtype;
            bias: optional (O,).
        stride, padding, dilation, groups: as ``F.conv2d`` (padding an int, a pair, 'valid' or
            'same'; zero padding).
        step_state: None (dW and db rounded here), or the step state that takes them as digits
            (and counts this call as one forward use of weight and bias).

    Returns:
        (B, O, Ho, Wo) of x's dtype, a fresh tensor.
    """
    _check_conv_args(x, weight, bias, groups, 2, "det_conv2d")
    stride2, dilation2 = _tuple2(stride, "stride", 1), _tuple2(dilation, "dilation", 1)
    pads = _pads(padding, tuple(weight.shape[2:]), dilation2, stride2)
    if step_state is not None:
        step_state.note_forward_use(weight, bias)
    return _DetConvFn.apply(x, weight, bias, step_state, stride2, pads, dilation2, groups)


def det_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride: _IntOr = 1,
               padding: Union[str, _IntOr] = 0, dilation: _IntOr = 1, groups: int = 1, *,
               step_state: Optional[StepState] = None) -> torch.Tensor:
    """``F.conv1d`` exactly: :func:`det_conv2d` on (B, C, 1, L). x: (B, C, L); weight (O, C / groups, k)."""
    _check_conv_args(x, weight, bias, groups, 1, "det_conv1d")

    def one(v, name, minimum):
        if isinstance(v, str):
            return v
        t = (v,) if isinstance(v, int) else tuple(v)
        if len(t) != 1:
            raise ValueError(f"{name}: expected an integer or a 1-tuple for a 1-d convolution, got {v!r}")
        return (minimum, t[0])

    stride2, dilation2 = one(stride, "stride", 1), one(dilation, "dilation", 1)
    stride2, dilation2 = _tuple2(stride2, "stride", 1), _tuple2(dilation2, "dilation", 1)
    pads = _pads(one(padding, "padding", 0), (1, weight.shape[2]), dilation2, stride2)
    if step_state is not None:
        step_state.note_forward_use(weight, bias)
    return _DetConvFn.apply(x, weight, bias, step_state, stride2, pads, dilation2, groups)


def _check_module(conv: nn.Module) -> None:
    if conv.padding_mode != "zeros":
        raise ValueError(
            f"{type(conv).__name__}: padding_mode={conv.padding_mode!r} is not supported (only 'zeros': "
            "reflect, replicate and circular padding add two gradients into one input element, a second "
            "rounding); use zero padding, or keep this module out of det_transform (filter_fn) and accept "
            "an unverified run"
        )


class _DetConvNd:
    """What DetConv1d and DetConv2d share: digit mode, the swap check, the exact forward."""

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    @classmethod
    def check_module(cls, conv: nn.Module) -> None:
        """Raises a clear error for options the exact convolution does not cover (det_transform)."""
        _check_module(conv)

    def _det_forward(self, input, fn, dims):
        _check_module(self)
        if isinstance(input, torch.Tensor) and input.dim() == dims + 1:  # unbatched, as PyTorch allows
            return self._det_forward(input.unsqueeze(0), fn, dims).squeeze(0)
        return fn(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups,
                  step_state=self.step_state)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"  # type: ignore[misc]


class DetConv2d(_DetConvNd, nn.Conv2d):
    """``nn.Conv2d`` with exact, batch-invariant arithmetic (:func:`det_conv2d`).

    Args: as ``nn.Conv2d`` (same parameters and ``state_dict`` keys), ``padding_mode='zeros'`` only.
    Input (B, C, H, W) or (C, H, W); output of the input's dtype. dW and db: exact sums over the
    batch and every position, rounded once, or digits in digit mode.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._det_forward(input, det_conv2d, 2)


class DetConv1d(_DetConvNd, nn.Conv1d):
    """``nn.Conv1d`` with exact, batch-invariant arithmetic (:func:`det_conv1d`).

    Args: as ``nn.Conv1d``, ``padding_mode='zeros'`` only. Input (B, C, L) or (C, L).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._det_forward(input, det_conv1d, 1)
