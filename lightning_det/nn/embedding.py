"""DetEmbedding: nn.Embedding whose weight gradient is an exact digit sum (never float atomics)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._swap import swap_class

from ..ops import det_finalize, scatter_sum_digits
from ..ops.deferred_checks import DeferredChecks, check_now_or_later
from ..ops.trust import trusted, trusted_fn
from .step_state import StepState, current_step_state

__all__ = ["DetEmbedding"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class _DetEmbeddingFn(torch.autograd.Function):
    @staticmethod
    @trusted_fn
    def forward(ctx, idx, weight, padding_idx, state, bad):
        ctx.save_for_backward(idx)
        # the state keys gradients by the Parameter object itself
        ctx.weight, ctx.padding_idx, ctx.state, ctx.bad = weight, padding_idx, state, bad
        out = F.embedding(idx, weight, padding_idx)  # a gather: exact
        if bad is not None:  # out-of-range indices (deferred check): NaN, and no gradient
            out = out.masked_fill(bad.unsqueeze(-1), math.nan)
        return out

    @staticmethod
    def ldet_broadcast_sink(node, state, shape):
        """The output, broadcast to ``shape`` outside the module or used at its own shape there
        (``tok(idx) + pos(positions)``), takes its full gradient here
        (lightning_det.nn.broadcast_grads): the indices broadcast the same way, and one exact
        row scatter gives the weight's gradient, with no digits of the output in between.
        Returns ``(weight, grad -> digits, grad -> rounded gradient, grad -> (digits -> None),
        grad -> (() -> (row, sums)) or None)`` (the fourth adds the gradient's row sums into the
        weight's pending digits in place, the fifth gives the occurring rows' sums:
        StepState.contribute's row_sums), or None where the embedding dimension itself is
        broadcast or the module has another state."""
        weight = node.weight
        (idx,) = node.saved_tensors
        if node.state is not state or not node.needs_input_grad[1] or len(shape) < idx.dim() + 1 \
                or shape[-1] != weight.shape[1]:
            return None
        lead = tuple(shape[:-1])
        pad, bad = node.padding_idx, node.bad
        ones = (1,) * (len(lead) - idx.dim())
        idx_b = idx.reshape(ones + tuple(idx.shape)).expand(lead).reshape(-1).long()
        bad_b = None if bad is None else bad.reshape(ones + tuple(bad.shape)).expand(lead).reshape(-1, 1)

        def rows(grad):
            g = grad.reshape(-1, weight.shape[1])
            if bad_b is not None:
                g = g.masked_fill(bad_b, 0)
            return (g if g.dtype in _FLOATS else g.float()).contiguous()

        @trusted_fn
        def digits(grad):
            return _row_sum_digits(rows(grad), idx_b, weight.shape[0], pad)

        @trusted_fn
        def rounded(grad):
            return _rounded_row_sums(rows(grad), idx_b, weight, pad)

        def add_into(grad):
            return trusted_fn(lambda acc: _add_row_sums(acc, rows(grad), idx_b, pad))

        def row_sums(grad):
            if weight.shape[0] <= idx_b.shape[0]:
                return None  # no fewer segments than rows
            return trusted_fn(lambda: _occurring_row_sums(rows(grad), idx_b, weight.shape[0], pad))

        return weight, digits, rounded, add_into, row_sums

    @staticmethod
    @trusted_fn
    def backward(ctx, gy):
        (idx,) = ctx.saved_tensors
        weight = ctx.weight
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        if ctx.bad is not None:
            gy = gy.masked_fill(ctx.bad.unsqueeze(-1), 0)
        idx1 = idx.reshape(-1)
        gy2 = gy.reshape(idx1.shape[0], weight.shape[1])
        if gy2.dtype not in _FLOATS:
            gy2 = gy2.float()
        pad, idx1 = ctx.padding_idx, idx1.long()

        def rounded() -> torch.Tensor:
            return _rounded_row_sums(gy2, idx1, weight, pad)

        def digits() -> torch.Tensor:
            return _row_sum_digits(gy2, idx1, weight.shape[0], pad)

        def add_into(acc: torch.Tensor) -> None:
            _add_row_sums(acc, gy2, idx1, pad)

        def row_sums():
            return _occurring_row_sums(gy2, idx1, weight.shape[0], pad)

        if ctx.state is not None:
            sparse = weight.shape[0] > idx1.shape[0]  # fewer segments than rows
            ctx.state.contribute(weight, digits, rounded, add_into, row_sums=row_sums if sparse else None)
            return None, None, None, None, None
        return None, rounded(), None, None, None


def _row_sum_digits(g: torch.Tensor, idx: torch.Tensor, n_rows: int, pad: Optional[int]) -> torch.Tensor:
    """The weight gradient's digits (n_rows, D, 19): row v is the exact sum of the rows of ``g``
    whose index is v; the padding row is zero."""
    acc = scatter_sum_digits(g, idx, n_rows)
    if pad is not None:
        acc[pad] = 0
    return acc


def _segments(idx: torch.Tensor, n_rows: int):
    """The occurring rows of ``idx`` (n,) as segments, with no host synchronization: ``(seg, row)``
    where position p belongs to segment ``seg[p]`` and segment s holds index ``row[s]``. There are
    n segments; those past the last occurring index hold no position and have ``row = n_rows``."""
    n = idx.shape[0]
    sorted_idx, order = torch.sort(idx)
    starts = torch.ones_like(sorted_idx, dtype=torch.bool)
    torch.ne(sorted_idx[1:], sorted_idx[:-1], out=starts[1:])
    seg_sorted = torch.cumsum(starts, 0) - 1  # segment of each sorted position
    seg = torch.empty_like(seg_sorted).scatter_(0, order, seg_sorted)  # ... of each position
    # row of each segment, written once by its first position; the rest write a spare slot
    row = torch.full((n + 1,), n_rows, dtype=torch.long, device=idx.device)
    row.scatter_(0, torch.where(starts, seg_sorted, n), sorted_idx)
    return seg, row[:n]


def _rounded_row_sums(g: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, pad: Optional[int]) -> torch.Tensor:
    """The same sums rounded once to the weight's dtype (float32 for other dtypes); rows that
    never occur, and the padding row, are +0.0.

    With fewer positions than vocabulary rows, only the rows that occur get digits
    (:func:`_segments`): the (positions, D, 19) segment sums are rounded and copied to their rows.
    Every vocabulary row's digits would be a temporary of 152 bytes per weight element (3.8 GB
    for a 32768 x 768 embedding). The segment count is data-dependent but never read on the
    host: the empty segments go to a spare row that is dropped, so no step waits for the device."""
    n_rows, width = weight.shape
    out_dtype = weight.dtype if weight.dtype in _FLOATS else torch.float32
    if n_rows <= idx.shape[0]:  # every row's digits: no larger than the segments' would be
        gw = det_finalize(scatter_sum_digits(g, idx, n_rows), out_dtype)
    else:
        seg, row = _segments(idx, n_rows)
        sums = det_finalize(scatter_sum_digits(g, seg, idx.shape[0]), out_dtype)
        # empty segments sum to +0.0 and all land on the spare row n_rows
        full = torch.zeros((n_rows + 1, width), dtype=out_dtype, device=g.device)
        full.index_copy_(0, row, sums)
        gw = full[:n_rows]
    if pad is not None:
        gw[pad] = 0  # PyTorch semantics: the padding row gets no gradient
    return gw


def _occurring_row_sums(g: torch.Tensor, idx: torch.Tensor, n_rows: int, pad: Optional[int]):
    """``(row, sums)``: the exact row sums of the rows that occur, as the segments' digits
    (positions, D, 19) (:func:`_segments`), and the row each segment goes to; ``n_rows`` for the
    segments that hold no position and for the padding row's, whose sums are zeroed."""
    seg, row = _segments(idx, n_rows)
    sums = scatter_sum_digits(g, seg, idx.shape[0])
    if pad is not None:
        is_pad = row == pad
        sums.masked_fill_(is_pad.view(-1, 1, 1), 0)
        row = torch.where(is_pad, n_rows, row)
    return row, sums


def _add_row_sums(acc: torch.Tensor, g: torch.Tensor, idx: torch.Tensor, pad: Optional[int]) -> None:
    """Adds the row sums' digits into ``acc`` (n_rows, D, 19), canonical, in place; the caller
    normalizes. With fewer positions than rows, only the segments' (positions, D, 19) digits are
    made, and added into their rows as int64 words: exact in any order."""
    n_rows = acc.shape[0]
    if n_rows <= idx.shape[0]:
        acc.add_(_row_sum_digits(g, idx, n_rows, pad))
        return
    row, sums = _occurring_row_sums(g, idx, n_rows, pad)
    # the segments that go nowhere hold zero digits: sent to row 0, they add nothing
    acc.index_add_(0, torch.where(row == n_rows, 0, row), sums)


class DetEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight gradient is an exact sum over all occurrences, rounded once.

    Args: as ``nn.Embedding`` (same parameter and ``state_dict`` key). ``padding_idx`` is
    supported (that row gets no gradient). ``max_norm``, ``scale_grad_by_freq`` and ``sparse``
    are rejected: they would renormalize the weight in place or change the gradient's form.

    Shapes: input (...) int64/int32 indices; output (..., embedding_dim) of the weight's dtype
    (forward is a gather, exact). Backward: dweight[v] = exact sum of the output gradients of
    every position holding v, rounded once to the weight's dtype (or left as digits in digit
    mode, :mod:`lightning_det.nn.grad_digits`). Independent of batch order, split and device.
    """

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> "DetEmbedding":
        """Turns an ``nn.Embedding`` into a DetEmbedding in place, keeping its Parameter."""
        if isinstance(emb, nn.Embedding):
            _check_options(emb)
        return swap_class(emb, nn.Embedding, cls, "emb")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_options(self)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        _check_options(self)
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input: expected int64 or int32 indices, got {input.dtype}")
        # the range check waits for the step inside det_ddp's training step (its step state's
        # checks, as det_cross_entropy's target check does); elsewhere it is decided now
        now = current_step_state()
        input, bad = _checked_indices(input, self.num_embeddings, None if now is None else now.checks)
        state = self.step_state
        if state is not None:
            state.note_forward_use(self.weight)
        return _DetEmbeddingFn.apply(input, self.weight, self.padding_idx, state, bad)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", exact=True"


def _checked_indices(idx: torch.Tensor, n: int, checks: Optional[DeferredChecks]):
    """``(indices to gather, mask of bad positions or None)`` after the range check [0, n).

    Outside a collector the check is decided now: on the CPU it raises naming the input and the
    range; on a GPU it is left to a device-side assert, as a host read would stall the stream.
    Given the step's ``checks`` (det_ddp's training step) it is recorded and raised when the step's checks are resolved, before the optimizer step;
    until then bad positions gather row 0 and their outputs are NaN, and no kernel reads out of
    range.
    """
    if idx.numel() == 0:
        return idx, None
    with trusted():
        if checks is not None:
            bad = (idx < 0) | (idx >= n)
            lo, hi = torch.aminmax(torch.where(bad, idx, torch.zeros_like(idx)).long())
            check_now_or_later(torch.stack([bad.sum(), lo, hi]), _index_verdict(n, deferred=True), checks)
            return idx.masked_fill(bad, 0), bad
        lo, hi = torch.aminmax(idx.long())
        if idx.is_cuda:
            torch._assert_async((lo >= 0) & (hi < n), f"DetEmbedding input: indices must lie in [0, {n})")
            return idx, None
        lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= n:
        bad = int(((idx < 0) | (idx >= n)).sum())
        raise _index_verdict(n, deferred=False)([bad, lo, hi])
    return idx, None


def _index_verdict(n: int, deferred: bool):
    """The index check's verdict on [count of bad indices, min, max]."""

    def verdict(stats):
        n_bad, lo, hi = stats
        if not n_bad:
            return None
        when = (" (found when det_ddp resolved the step's checks, before its optimizer step)"
                if deferred else "")
        return IndexError(f"input: {n_bad} index value(s) outside [0, {n}) for an embedding of "
                          f"{n} rows, e.g. {hi if hi >= n else lo}{when}")

    return verdict


def _check_options(emb: nn.Embedding) -> None:
    bad = []
    if emb.max_norm is not None:
        bad.append(f"max_norm={emb.max_norm}")
    if emb.scale_grad_by_freq:
        bad.append("scale_grad_by_freq=True")
    if emb.sparse:
        bad.append("sparse=True")
    if bad:
        raise ValueError(
            f"DetEmbedding: {', '.join(bad)} is not supported (max_norm renormalizes the weight in "
            "place, scale_grad_by_freq and sparse change the gradient's form); construct the "
            "embedding without it, or keep this module out of det_transform (filter_fn) and accept "
            "an unverified run"
        )
