"""DetBatchNorm1d, DetBatchNorm2d: BatchNorm whose statistics are exact and world-size invariant.

**Semantics.** BatchNorm's training statistics cross samples, so where the samples are decides
the result: per-rank statistics (plain DDP) normalize rank r's samples with rank r's own mean,
and world size 1 with batch 8 and world size 2 with 4 + 4 compute different functions. No
arithmetic can make that invariant. Under det_ddp the statistics are therefore taken over the
**global micro-batch** (every rank's current micro-batch together): SyncBatchNorm semantics, made
exact. Each rank forms its per-channel sums as long-accumulator digits, the step state's
``reduce_digits`` (an int64 all-reduce; the identity at world size 1) adds them exactly, and they
are rounded once. Every rank then holds the same statistics as one process with the whole batch.

Gradient accumulation changes what one forward can see: with ``accumulate_grad_batches=k`` the
global micro-batch is B/k samples, so statistics over it are not those of the whole batch B.
For models that must be invariant across world size *and* accumulation, the strategy's
``batch_norm_group_size=G`` (:class:`lightning_det.strategy.DeterministicStrategy`, stored on the
step state) fixes the normalization group to G consecutive global samples (ghost batch norm):
groups never cross a global micro-batch, G must divide it, and every configuration whose global
micro-batch G divides computes the same thing.

Outside det_ddp (no step state, or a state without a batch position) the module's own batch is
the global micro-batch: its statistics are exact, with no cross-rank reduction. A module bound to
a step state without a position in a process group of several ranks (e.g. Fabric, which sets no
position) raises rather than normalize per rank.

**Arithmetic**, per normalization group j and channel c, over its M = G * spatial elements
(bf16/fp16 inputs are widened to fp32 exactly):

    mean  = round_fp32(exact sum x) / M                  (IEEE fp32 division, on CUDA too: div_by_count)
    d     = x - mean
    var   = round_fp32(exact sum d * d) / M              (products exact, one rounding)
    rstd  = fp32(1 / sqrt_fp64(fp64(var + eps)))
    y     = (d * rstd) * weight + bias                   (then rounded to x's dtype)

Running statistics are updated as PyTorch does (``running = momentum * stat + (1 - momentum) *
running``; the unbiased variance round_fp32(exact sum d * d) / (M - 1); ``momentum=None``: the
cumulative average), once per normalization group, in global sample order, ``num_batches_tracked``
counting the updates. With the default group that is once per forward, as in PyTorch; with ghost
groups the sequence of updates is the same at every world size and accumulation. Eval mode
normalizes with the running statistics (elementwise, the same rstd formula).

Backward, with g = dy * weight, per group: m1 = round(exact sum g) / M, m2 = round(exact sum
g * xhat) / M, both reduced across ranks exactly; dx = (g - m1 - xhat * m2) * rstd. dweight and
dbias are exact sums of dy * xhat and dy over the rank's samples, handed to the step state as
digits (reduced with every other gradient at the step), or rounded once without a state.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

from ..ops import LongAcc, det_finalize
from ..ops.trust import trusted, trusted_fn
from .functional import det_row_sums, div_by_count
from .step_state import StepState

__all__ = ["DetBatchNorm1d", "DetBatchNorm2d", "batch_norm_layout"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _Layout:
    """Which normalization group each of this rank's samples belongs to.

    Attributes:
        n_groups: groups in the global micro-batch (every rank sees all of them).
        group_size: samples per group (G).
        pieces: (group, start, end) ranges of this rank's samples, in order.
        reduce: exact sum of digits over the ranks (identity for one process).
    """

    def __init__(self, n_groups: int, group_size: int, pieces: List[Tuple[int, int, int]], reduce):
        self.n_groups, self.group_size, self.pieces, self.reduce = n_groups, group_size, pieces, reduce

    def sample_groups(self, device) -> torch.Tensor:
        ids = [j for j, s, e in self.pieces for _ in range(e - s)]
        return torch.tensor(ids, dtype=torch.int64, device=device)


def _identity(acc: LongAcc) -> LongAcc:
    return acc


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def batch_norm_layout(batch: int, state: Optional[StepState]) -> _Layout:
    """The normalization groups of a training forward over ``batch`` samples under ``state``.

    With a state whose ``position`` is set (det_ddp's training step): the global micro-batch is
    ``position.global_size`` samples, this rank's start at ``position.offset % global_size``, and
    groups of ``state.batch_norm_group_size`` (None: the whole global micro-batch). Otherwise the
    local batch is the global micro-batch.
    """
    position = state.position if state is not None else None
    group = getattr(state, "batch_norm_group_size", None) if state is not None else None
    if position is None:
        if state is not None and _world_size() > 1:
            raise RuntimeError(
                "DetBatchNorm: bound to a step state without a batch position in a process group of "
                f"{_world_size()} ranks; per-rank statistics would not be world-size invariant. Train with "
                "Trainer(strategy='det_ddp'), which sets the position, or set state.position and "
                "state.reduce_digits yourself (lightning_det.nn.step_state)"
            )
        total, start, reduce = batch, 0, _identity
    else:
        if batch != position.size:
            raise ValueError(
                f"input: a batch of {batch} samples, but the step's position says this rank's micro-batch holds "
                f"{position.size}; BatchNorm's global statistics need every rank's micro-batch to have the size "
                "the sampler gave (use drop_last=True, or a dataset size divisible by the global batch)"
            )
        total, start, reduce = position.global_size, position.offset % position.global_size, state.reduce_digits
    if group is None:
        group = total
    if total % group:
        raise ValueError(
            f"batch_norm_group_size: {group} does not divide the global micro-batch of {total} samples; "
            "normalization groups never cross a micro-batch, so choose a divisor of every configuration's "
            "global micro-batch (global batch / accumulate_grad_batches)"
        )
    pieces = []
    i = 0
    while i < batch:
        j = (start + i) // group
        end = min(batch, (j + 1) * group - start)
        pieces.append((j, i, end))
        i = end
    return _Layout(total // group, group, pieces, reduce)


def _group_sums(a: torch.Tensor, b: Optional[torch.Tensor], layout: _Layout) -> LongAcc:
    """Exact per-(group, channel) sums of ``a * b`` (or ``a``) over this rank's samples and positions.

    a, b: (B, C, S) fp32. Returns canonical digits (n_groups, C, 19), zero for groups without
    samples here (so a sum over the ranks gives each group's total).
    """
    B, C, S = a.shape
    lens = {e - s for _, s, e in layout.pieces}
    if len(lens) == 1:  # equal pieces: one call on (pieces * C, samples * S) rows
        n = len(layout.pieces)
        L = lens.pop()

        def rows(t):
            return t.reshape(n, L, C, S).transpose(1, 2).reshape(n * C, L * S)

        acc = det_row_sums(rows(a), None if b is None else rows(b)).view(n, C, -1)
    else:
        def rows(t, s, e):
            return t[s:e].transpose(0, 1).reshape(C, -1)

        acc = torch.stack([det_row_sums(rows(a, s, e), None if b is None else rows(b, s, e))
                           for _, s, e in layout.pieces])
    out = acc.new_zeros(layout.n_groups, C, acc.shape[-1])
    out[[j for j, _, _ in layout.pieces]] = acc
    return out


def _channel_sums(a: torch.Tensor, b: Optional[torch.Tensor]) -> LongAcc:
    """Exact per-channel sums of ``a * b`` over samples and positions: (C, 19). a, b: (B, C, S)."""
    C = a.shape[1]
    return det_row_sums(a.transpose(0, 1).reshape(C, -1), None if b is None else b.transpose(0, 1).reshape(C, -1))


def _rstd(var: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32(1 / sqrt_fp64(fp64(var + eps))): IEEE operations only (no approximate rsqrt)."""
    return (1.0 / torch.sqrt((var + eps).double())).float()


def _param_grad(state: Optional[StepState], param: torch.Tensor, acc: LongAcc):
    dtype = param.dtype if param.dtype in _FLOATS else torch.float32
    if state is not None:
        state.contribute(param, lambda: acc, lambda: det_finalize(acc, dtype))
        return None
    return det_finalize(acc, dtype)


class _DetBatchNormFn(torch.autograd.Function):
    """x (B, C, S) -> y (B, C, S). ``stats`` (training) gets (mean (n_groups, C), unbiased
    variance (n_groups, C)) for the running-statistics update."""

    @staticmethod
    @trusted_fn
    def forward(ctx, x, weight, bias, state, layout, running_mean, running_var, eps, stats: list):
        B, C, S = x.shape
        xf = x.float()
        if layout is not None:  # batch statistics
            M = layout.group_size * S
            if M <= 1:
                raise ValueError(f"input: expected more than 1 value per channel in a normalization group, got "
                                 f"{layout.group_size} sample(s) x {S} position(s)")
            groups = layout.sample_groups(x.device)
            mean_g = div_by_count(det_finalize(layout.reduce(_group_sums(xf, None, layout))), M)
            d = xf - mean_g[groups].unsqueeze(-1)
            sq = det_finalize(layout.reduce(_group_sums(d, d, layout)))
            var_g = div_by_count(sq, M)
            rstd = _rstd(var_g, eps)[groups].unsqueeze(-1)  # (B, C, 1)
            stats.extend([mean_g, div_by_count(sq, M - 1)])
        else:  # running statistics
            d = xf - running_mean.float().view(1, C, 1)
            rstd = _rstd(running_var.float(), eps).view(1, C, 1)
            groups = None
        xhat = d * rstd
        y = xhat
        if weight is not None:
            y = y * weight.float().view(1, C, 1)
        if bias is not None:
            y = y + bias.float().view(1, C, 1)
        ctx.save_for_backward(xhat, rstd, groups)
        ctx.params = (weight, bias)  # the state keys gradients by the Parameter objects
        ctx.state, ctx.layout, ctx.x_dtype = state, layout, x.dtype
        return y.to(x.dtype) if x.dtype != torch.float32 else y

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        xhat, rstd, groups = ctx.saved_tensors
        weight, bias = ctx.params
        layout, state = ctx.layout, ctx.state
        C = xhat.shape[1]
        gyf = gy.float()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            g = gyf if weight is None else gyf * weight.float().view(1, C, 1)
            if layout is not None:
                M = layout.group_size * xhat.shape[2]
                # one exact all-reduce for both batch-crossing sums
                sums = layout.reduce(torch.stack([_group_sums(g, None, layout), _group_sums(g, xhat, layout)]))
                m = div_by_count(det_finalize(sums), M)  # (2, n_groups, C)
                m1, m2 = m[0][groups].unsqueeze(-1), m[1][groups].unsqueeze(-1)
                gx = (g - m1 - xhat * m2) * rstd
            else:
                gx = g * rstd
            gx = gx.to(ctx.x_dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            gw = _param_grad(state, weight, _channel_sums(gyf, xhat))
        if bias is not None and ctx.needs_input_grad[2]:
            gb = _param_grad(state, bias, _channel_sums(gyf, None))
        return gx, gw, gb, None, None, None, None, None, None


def _update_running(module, mean_g: torch.Tensor, unbiased_g: torch.Tensor) -> None:
    """PyTorch's running-statistics update, once per normalization group in global order."""
    rm, rv = module.running_mean, module.running_var
    new_m, new_v = rm.float(), rv.float()
    for j in range(mean_g.shape[0]):
        if module.num_batches_tracked is not None:
            module.num_batches_tracked.add_(1)
        if module.momentum is None:
            factor = 1.0 / float(module.num_batches_tracked)
        else:
            factor = float(module.momentum)
        new_m = mean_g[j] * factor + new_m * (1.0 - factor)
        new_v = unbiased_g[j] * factor + new_v * (1.0 - factor)
    rm.copy_(new_m)
    rv.copy_(new_v)


class _DetBatchNorm:
    """What DetBatchNorm1d and DetBatchNorm2d share (see the module docstring)."""

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in _FLOATS:
            raise TypeError(f"input: expected a float32/bfloat16/float16 tensor, got {getattr(input, 'dtype', type(input))}")
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"input: expected {self.num_features} channels (num_features), got shape {tuple(input.shape)}")
        state = self.step_state
        use_batch = self.training or self.running_mean is None
        update = self.training and self.track_running_stats and self.running_mean is not None
        layout = batch_norm_layout(input.shape[0], state) if use_batch else None
        weight, bias = (self.weight, self.bias) if self.affine else (None, None)
        if state is not None:
            state.note_forward_use(weight, bias)
        stats: list = []
        x3 = input.reshape(input.shape[0], self.num_features, -1)
        y = _DetBatchNormFn.apply(x3, weight, bias, state, layout, self.running_mean, self.running_var,
                                  float(self.eps), stats)
        if update:
            with torch.no_grad(), trusted():
                _update_running(self, *stats)
        return y.reshape(input.shape)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True, global statistics under det_ddp"  # type: ignore[misc]


class DetBatchNorm1d(_DetBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` with exact statistics over the global micro-batch (module docstring).

    Args: as ``nn.BatchNorm1d`` (same parameters, buffers and ``state_dict`` keys).
    Input (B, C) or (B, C, L), float32/bfloat16/float16; output of the same shape and dtype.
    """


class DetBatchNorm2d(_DetBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with exact statistics over the global micro-batch (module docstring).

    Args: as ``nn.BatchNorm2d``. Input (B, C, H, W); output of the same shape and dtype.
    """
