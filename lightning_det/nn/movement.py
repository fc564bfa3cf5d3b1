"""Where each element of a tensor was copied from: the Parameter element it carries.

A tensor made from a Parameter by data movement alone (views, permutes, copies, slices,
selections, advanced indexing, a DetEmbedding lookup) holds the Parameter's values unchanged,
some of them several times: Swin's relative position bias ``table[index].view(N, N, H)
.permute(2, 0, 1).unsqueeze(0)``, T5's ``relative_attention_bias(buckets).permute(2, 0, 1)``. Its
gradient is the Parameter's moved back: each Parameter element's gradient is the sum of its
copies' gradients. :mod:`lightning_det.nn.broadcast_grads` uses :func:`moved_from` to hand such a
tensor's exact gradient digits straight to the Parameter, where autograd would add floats: the
copies' digits add as integers, so their sum is exact and order-free.

The chain is read from the tensor's autograd graph. Each node must be one of the data
movements below, with one tensor input, down to a Parameter (``AccumulateGrad``) or a DetEmbedding
lookup (whose weight is the Parameter); anything else, and the tensor has no such source. The
positions come from replaying the chain on ``arange(param.numel())``.
"""
from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from ..ops import LongAcc, det_normalize
from ..ops.trust import trusted_fn
from ..profile import WORDS

__all__ = ["Moved", "moved_from", "digits_to_source"]

# nodes that keep the row-major order of the elements (their replay is a reshape); a node's
# input shape is the forward output shape its input node records (``_input_metadata``)
_RESHAPES = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SqueezeBackward0",
             "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0"}
_SAME = {"CloneBackward0", "ToCopyBackward0", "AliasBackward0"}
_MAX_DEPTH = 32


def _one_input(fn):
    """``(slot, node, output_nr)`` of the node's one input that needs a gradient, or None where it
    has several or none."""
    ins = [(i, f, nr) for i, (f, nr) in enumerate(fn.next_functions) if f is not None]
    return ins[0] if len(ins) == 1 else None


def _step(fn, slot: int, in_shape: Tuple[int, ...], out_shape: Tuple[int, ...]) -> Optional[Callable]:
    """The replay of one data-movement node: the input's positions (``in_shape``) to the
    output's (``out_shape``); None where the node is not one."""
    name = type(fn).__name__
    if name in _RESHAPES:
        return lambda p: p.reshape(out_shape)
    if name in _SAME:
        return lambda p: p
    if name == "PermuteBackward0":
        dims = list(fn._saved_dims)
        return lambda p: p.permute(dims)
    if name == "TransposeBackward0":
        d0, d1 = fn._saved_dim0, fn._saved_dim1
        return lambda p: p.transpose(d0, d1)
    if name == "TBackward0":
        return lambda p: p.t()
    if name == "ExpandBackward0":
        return lambda p: p.expand(out_shape)
    if name == "RepeatBackward0":
        reps = tuple(fn._saved_repeats)
        return lambda p: p.repeat(reps)
    if name == "SliceBackward0":
        dim, start, end, step = fn._saved_dim % len(in_shape), fn._saved_start, fn._saved_end, fn._saved_step
        return lambda p: p[(slice(None),) * dim + (slice(start, end, step),)]
    if name == "SelectBackward0":
        dim, index = fn._saved_dim, fn._saved_index
        return lambda p: p.select(dim, index)
    if name == "IndexBackward0":
        indices = list(fn._saved_indices)
        return lambda p: torch.ops.aten.index.Tensor(p, indices)
    if name == "_DetSelectBackward":  # lightning_det.nn.indexing: the forward's own selection
        return fn.select
    if name == "WhereBackward0":  # torch.where(c, t, constant) or (c, constant, t): a constant carries nothing
        cond = fn._saved_condition
        none = torch.tensor(-1, dtype=torch.int64)
        if slot == 0:
            return lambda p: torch.where(cond.to(p.device), p, none.to(p.device))
        return lambda p: torch.where(cond.to(p.device), none.to(p.device), p)
    if name == "MaskedFillBackward0":  # t.masked_fill(mask, constant)
        mask = fn._saved_mask
        return lambda p: p.masked_fill(mask.to(p.device), -1)
    return None


def _embedding_source(fn, state) -> Optional[Tuple[nn.Parameter, torch.Tensor]]:
    """A DetEmbedding lookup's weight and its output's positions in it (-1: no gradient)."""
    if type(fn).__name__ != "_DetEmbeddingFnBackward" or fn.state is not state or not fn.needs_input_grad[1]:
        return None
    weight = fn.weight
    (idx,) = fn.saved_tensors
    d = weight.shape[1]
    pos = idx.long().unsqueeze(-1) * d + torch.arange(d, device=idx.device)
    if fn.padding_idx is not None:  # PyTorch semantics: the padding row gets no gradient
        pos = pos.masked_fill((idx == fn.padding_idx).unsqueeze(-1), -1)
    if fn.bad is not None:  # out-of-range indices: NaN forward, no gradient
        pos = pos.masked_fill(fn.bad.unsqueeze(-1), -1)
    return weight, pos


class Moved(NamedTuple):
    """A tensor's elements as copies of a source's: ``positions`` (int64, the tensor's shape) holds
    each element's row-major index in the source (of ``source_shape``), -1 where it carries none;
    ``to_param`` maps the source's digits to ``param``'s."""
    param: nn.Parameter
    positions: torch.Tensor
    source_shape: Tuple[int, ...]
    to_param: Callable[[LongAcc], LongAcc]


def _same(acc: LongAcc) -> LongAcc:
    return acc


def _broadcast_source(fn, state, out_shape):
    """An exact broadcast's output (``_ExactBroadcast``, whose sink maps its operand's digits to a
    Parameter's): ``(param, operand positions, the sink's map, the broadcast's replay)``, or None.
    A sink that takes the full gradient (a det op's) has no operand-shaped digits: None."""
    if type(fn).__name__ != "_ExactBroadcastBackward" or fn.state is not state or fn.sink.takes_full:
        return None
    vshape, reps = fn.vshape, fn.reps
    numel = 1
    for s in vshape:
        numel *= s
    pos = torch.arange(numel, device=fn.sink.param.device).view(vshape)
    replay = (lambda p: p.repeat(reps)) if reps is not None else (lambda p: p.expand(out_shape))
    return fn.sink.param, pos, fn.sink.to_param, replay


@trusted_fn  # integer bookkeeping on positions
def moved_from(t: torch.Tensor, state) -> Optional[Moved]:
    """:class:`Moved` where ``t`` is data movement of a Parameter (-1: a padding row). The source is
    the Parameter itself or a DetEmbedding lookup of it (``to_param`` the identity), or an exact
    broadcast's operand (lightning_det.nn.broadcast_grads: its sink's map), where a tensor moved
    from a Parameter was routed before. None where ``t`` is anything else. ``state``: the
    StepState the source must belong to."""
    fn, out_shape = t.grad_fn, tuple(t.shape)
    replays: List[Callable] = []
    to_param = _same
    for _ in range(_MAX_DEPTH):
        if fn is None:
            return None
        var = getattr(fn, "variable", None)
        if var is not None:  # AccumulateGrad
            if not (isinstance(var, nn.Parameter) and var.requires_grad and tuple(var.shape) == out_shape):
                return None
            param, pos = var, torch.arange(var.numel(), device=var.device).view(var.shape)
            source_shape = tuple(var.shape)
            break
        routed = _broadcast_source(fn, state, out_shape)
        if routed is not None:
            param, pos, to_param, replay = routed
            source_shape = tuple(pos.shape)
            replays.append(replay)
            break
        src = _embedding_source(fn, state)
        if src is not None:
            param, pos = src
            source_shape = tuple(param.shape)
            if tuple(pos.shape) != out_shape:
                return None
            break
        found = _one_input(fn)
        if found is None:
            return None
        slot, nxt, nr = found
        meta = getattr(nxt, "_input_metadata", None)
        if not meta or nr >= len(meta):
            return None
        in_shape = tuple(meta[nr].shape)
        replay = _step(fn, slot, in_shape, out_shape)
        if replay is None:
            return None
        replays.append(replay)
        fn, out_shape = nxt, in_shape
    else:
        return None
    for replay in reversed(replays):
        pos = replay(pos)
    if tuple(pos.shape) != tuple(t.shape):
        return None
    return Moved(param, pos.to(t.device), source_shape, to_param)


@trusted_fn
def digits_to_source(acc: LongAcc, positions: torch.Tensor, source_shape: Tuple[int, ...]) -> LongAcc:
    """The source's digits from those of its copies (``acc``: ``(*positions.shape, WORDS)``): each
    element the integer sum of its copies' words, canonical."""
    flat, pos = acc.reshape(-1, WORDS), positions.reshape(-1)
    keep = pos >= 0
    numel = 1
    for s in source_shape:
        numel *= s
    out = torch.zeros((numel, WORDS), dtype=torch.int64, device=acc.device)
    out.index_add_(0, pos[keep], flat[keep])  # integers: exact in any order
    return det_normalize(out).reshape(*source_shape, WORDS)
