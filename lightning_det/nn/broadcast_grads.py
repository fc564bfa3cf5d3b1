"""Exact gradients for tensors that a broadcast spreads across the batch, outside any det module.

``x + self.pos_embed`` with ``pos_embed`` of shape (1, N, D) and ``x`` of shape (B, N, D): autograd
sums the (B, N, D) gradient over B in floating point (``sum_to_size`` in the add's backward)
before the parameter sees it, so the result depends on how the batch is split over ranks and
micro-batches. The same holds for ``cls_token.expand(B, -1, -1)``, a layer scale ``x * gamma``,
a bias added by hand, a slice ``pos_embed[:, :T]`` and an embedding output ``wpe(position_ids)``
of shape (1, T, D).

det_function_mode (with a StepState) sends the broadcasting functions of :data:`BROADCAST_FUNCS`
here. Each tensor argument that requires grad and whose gradient has a known exact destination
is replaced by the output of :class:`_ExactBroadcast`: the operand expanded to the broadcast
shape (a view; a floating operand is first cast to the call's promoted floating dtype, which is
exact), so the function itself no longer broadcasts and its backward hands over the full-shape
gradient. :class:`_ExactBroadcast`'s backward sums that gradient over the expanded dimensions as
exact digits and delivers them, through the step state's ``contribute``, to:

- a Parameter (a leaf), or a view of one (a slice, ``unsqueeze``, ...; added into the viewed
  elements), or a same-device dtype cast of one: the Parameter's pending digits, as a det
  module's dW. Every such use is routed, broadcast or not, so a parameter used several times
  (twice, or once per micro-batch of one sample) only ever collects digits;
- the output of a det op whose autograd Function offers ``ldet_broadcast_sink`` (DetEmbedding's
  row scatter), broadcast or at its own shape (``tok(idx) + pos(positions)``): the op maps the
  full-shape gradient straight to its parameter's digits, with no digits of the operand between;
- any other data movement of a Parameter (lightning_det.nn.movement): the operand's digits,
  added into the elements they were copied from.

It returns no gradient to the operand, so the Parameter gets no float ``.grad`` and the det op's
own backward is not called for this use. Each route counts one forward use of its parameter
(:meth:`StepState.note_forward_use`), so eager rounding stays correct. A det op's output has its
op's count too: where the backward does not run the op's own node (every use of the output was
routed), the route takes that count back first, so ``tok(idx) + pos(positions)`` rounds each
embedding's gradient at once under eager rounding, with no digits of the whole vocabulary.

A tensor that requires grad, has no such destination, and is broadcast across dimension 0 of the
result (the batch dimension, batch-first) cannot be kept exact: strict mode raises
:class:`BroadcastGradError` naming the function, the shapes and the operand's grad_fn chain;
non-strict mode leaves the call to PyTorch, whose float sum the op audit reports
(``aten.sum`` in a backward) and which labels the run unverified. Broadcasts of such tensors
along other dimensions (a row statistic ``x - x.amax(-1, keepdim=True)``) are left to PyTorch and
to the audit as well.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..ops import LongAcc, det_col_sums, det_finalize, to_digits
from ..ops.trust import trusted_fn
from ..profile import WORDS
from .movement import digits_to_source, moved_from
from .step_state import StepState

__all__ = ["BROADCAST_FUNCS", "BroadcastGradError", "call_with_exact_broadcasts", "exact_reduce_digits"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_T = torch.Tensor
# Whether the running backward will execute an autograd node (the test behind
# torch.autograd.graph.register_multi_grad_hook). Without it, a routed det op's count stays: its
# parameter keeps its digits, which is always safe.
_will_execute = getattr(torch._C, "_will_engine_execute_node", None)

#: Elementwise functions whose tensor arguments broadcast against each other (torch functions,
#: Tensor methods and operators). In-place forms broadcast their other arguments into ``self``.
_ELEMENTWISE = {
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide,
    torch.rsub, torch.where, torch.maximum, torch.minimum, torch.lerp, torch.addcmul, torch.addcdiv,
    _T.add, _T.sub, _T.subtract, _T.mul, _T.multiply, _T.div, _T.divide, _T.true_divide, _T.where,
    _T.maximum, _T.minimum, _T.lerp, _T.addcmul, _T.addcdiv,
    _T.__add__, _T.__radd__, _T.__sub__, _T.__rsub__, _T.__mul__, _T.__rmul__, _T.__truediv__, _T.__rtruediv__,
}
_IN_PLACE = {_T.add_, _T.sub_, _T.mul_, _T.div_, _T.lerp_, _T.addcmul_, _T.addcdiv_,
             _T.__iadd__, _T.__isub__, _T.__imul__, _T.__itruediv__}
#: Functions that broadcast their one tensor argument to a shape.
_EXPAND = {_T.expand, _T.expand_as, _T.broadcast_to, torch.broadcast_to}

#: Everything det_function_mode sends to :func:`call_with_exact_broadcasts`.
BROADCAST_FUNCS = frozenset(_ELEMENTWISE | _IN_PLACE | _EXPAND | {_T.repeat})


class BroadcastGradError(RuntimeError):
    """A tensor that requires grad is broadcast across the batch dimension, and its gradient has
    no exact destination (strict det_function_mode)."""


# ---- the exact reduction -------------------------------------------------------------------
def exact_reduce_digits(grad: torch.Tensor, shape: Sequence[int]) -> LongAcc:
    """Exact sum of ``grad`` down to ``shape`` (which broadcasts to ``grad.shape``), as digits.

    The inverse of a broadcast: ``out[i]`` is the exact sum of every element of ``grad`` that the
    broadcast of an element at ``i`` produced. Returns a canonical LongAcc ``(*shape, 19)``; the
    same digits for any split of the summed positions, as they are integers.
    """
    if grad.dtype not in _FLOATS:
        raise TypeError(f"grad: expected float32, bfloat16 or float16, got {grad.dtype}")
    shape = tuple(shape)
    n = grad.dim()
    if len(shape) > n:
        raise ValueError(f"shape: {shape} has more dimensions than grad {tuple(grad.shape)}")
    aligned = (1,) * (n - len(shape)) + shape
    for a, s in zip(aligned, grad.shape):
        if a != s and a != 1:
            raise ValueError(f"shape: {shape} does not broadcast to grad's shape {tuple(grad.shape)}")
    reduce = [i for i in range(n) if aligned[i] == 1 and grad.shape[i] != 1]
    keep = [i for i in range(n) if i not in reduce]
    return _reduce(grad, reduce, keep, shape)


def _reduce(grad: torch.Tensor, reduce: List[int], keep: List[int], shape: Tuple[int, ...]) -> LongAcc:
    """Exact sums of ``grad`` over the dims ``reduce``; the dims ``keep`` hold ``shape``'s elements."""
    width = 1
    for s in shape:
        width *= s
    if not reduce:
        return to_digits(grad.reshape(shape).contiguous())
    rows = grad.numel() // width if width else 0
    if rows == 0 or width == 0:
        return torch.zeros((*shape, WORDS), dtype=torch.int64, device=grad.device)
    g2 = grad.permute(*reduce, *keep).reshape(rows, width).contiguous()
    return det_col_sums(g2).reshape(*shape, WORDS)


def _reduce_repeat(grad: torch.Tensor, reps: Tuple[int, ...], shape: Tuple[int, ...]) -> LongAcc:
    """Exact inverse of ``value.repeat(*reps)`` for ``value`` of ``shape``: the tiles summed."""
    aligned = (1,) * (len(reps) - len(shape)) + shape
    split = []
    for r, s in zip(reps, aligned):
        split += [r, s]
    g = grad.reshape(split)
    reduce = list(range(0, 2 * len(reps), 2))
    keep = list(range(1, 2 * len(reps), 2))
    return _reduce(g, reduce, keep, shape)


# ---- destinations ----------------------------------------------------------------------------
class _Sink:
    """Where one routed operand's digits go: ``param`` and a map from the operand's exact digits
    (or, for a det op, from the full-shape gradient) to the parameter's digits.

    A det op's sink also has ``to_rounded`` (full-shape gradient -> the parameter's gradient
    rounded once, for eager rounding), ``to_add_into`` (full-shape gradient -> an in-place adder
    into the parameter's pending digits, StepState.contribute's ``add_into``), ``to_row_sums``
    (full-shape gradient -> its ``row_sums``, or None) and ``op_node``, the op's own autograd node,
    whose counted forward use gives no contribution when the node does not run in the backward."""

    def __init__(self, param: nn.Parameter, to_param: Callable[[torch.Tensor], LongAcc], takes_full: bool,
                 to_rounded: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, op_node=None,
                 to_add_into: Optional[Callable[[torch.Tensor], Callable[[LongAcc], None]]] = None,
                 to_row_sums: Optional[Callable[[torch.Tensor], Optional[Callable]]] = None):
        self.param, self.to_param, self.takes_full = param, to_param, takes_full
        self.to_rounded, self.op_node, self.to_add_into = to_rounded, op_node, to_add_into
        self.to_row_sums = to_row_sums


def _param_sink(t: torch.Tensor) -> Optional[_Sink]:
    """A Parameter, a view of one, or a same-device dtype cast of one (None otherwise)."""
    if isinstance(t, nn.Parameter) and t.is_leaf:
        return _Sink(t, lambda acc: acc, False)
    base = t._base if t._is_view() else None
    if isinstance(base, nn.Parameter) and base.is_leaf and base.requires_grad:
        return _view_sink(t, base)
    fn = t.grad_fn
    if fn is not None and type(fn).__name__ == "ToCopyBackward0":
        nxt = fn.next_functions[0][0] if fn.next_functions else None
        p = getattr(nxt, "variable", None)
        if isinstance(p, nn.Parameter) and p.shape == t.shape and p.device == t.device:
            return _Sink(p, lambda acc: acc, False)
    return None


def _view_sink(view: torch.Tensor, base: nn.Parameter) -> Optional[_Sink]:
    """Digits of a non-overlapping view of a contiguous Parameter, added into the viewed elements."""
    if not base.is_contiguous() or torch._debug_has_internal_overlap(view) != 0:
        return None
    with torch.no_grad():
        flat = torch.arange(base.numel(), device=base.device).as_strided(
            view.shape, view.stride(), view.storage_offset() - base.storage_offset()).reshape(-1)

    def to_param(acc: LongAcc) -> LongAcc:
        out = torch.zeros((base.numel(), WORDS), dtype=torch.int64, device=acc.device)
        # integers: each element of a non-overlapping view lands on its own parameter element
        out.index_copy_(0, flat, acc.reshape(-1, WORDS))
        return out.reshape(*base.shape, WORDS)

    return _Sink(base, to_param, False)


def _det_op_sink(t: torch.Tensor, state: StepState, result_shape: torch.Size) -> Optional[_Sink]:
    """A det op's output whose Function maps a broadcast's full gradient to digits."""
    fn = t.grad_fn
    fwd = getattr(type(fn), "_forward_cls", None) if fn is not None else None
    hook = getattr(fwd, "ldet_broadcast_sink", None)
    if hook is None:
        return None
    found = hook(fn, state, result_shape)
    if found is None:
        return None
    param, full_grad_to_digits, full_grad_to_rounded, full_grad_to_add_into, full_grad_to_row_sums = found
    return _Sink(param, full_grad_to_digits, True, full_grad_to_rounded, fn, full_grad_to_add_into,
                 full_grad_to_row_sums)


def _moved_sink(t: torch.Tensor, state: StepState) -> Optional[_Sink]:
    """Data movement of a Parameter (lightning_det.nn.movement): its copies' digits, added."""
    found = moved_from(t, state)
    if found is None:
        return None
    return _Sink(found.param, lambda acc: found.to_param(digits_to_source(acc, found.positions, found.source_shape)),
                 False)


# ---- the autograd Function ------------------------------------------------------------------
class _ExactBroadcast(torch.autograd.Function):
    """``value`` broadcast (expanded, or tiled by ``repeat``) to ``shape``; backward delivers the
    exact reduction to the sink and returns no gradient to its inputs."""

    @staticmethod
    @trusted_fn
    def forward(ctx, value, anchor, shape, dtype, reps, sink, state):
        ctx.vshape, ctx.reps, ctx.sink, ctx.state = tuple(value.shape), reps, sink, state
        v = value if value.dtype == dtype else value.to(dtype)
        return v.repeat(reps) if reps is not None else v.expand(shape)

    @staticmethod
    @trusted_fn
    def backward(ctx, grad):
        sink, vshape, reps = ctx.sink, ctx.vshape, ctx.reps
        p = sink.param

        def digits() -> LongAcc:
            if sink.takes_full:
                return sink.to_param(grad)
            acc = _reduce_repeat(grad, reps, vshape) if reps is not None else exact_reduce_digits(grad, vshape)
            return sink.to_param(acc)

        def rounded() -> torch.Tensor:
            if sink.to_rounded is not None:
                return sink.to_rounded(grad)
            return det_finalize(digits(), p.dtype if p.dtype in _FLOATS else torch.float32)

        node = sink.op_node
        if node is not None and _will_execute is not None and not getattr(node, "ldet_use_forgotten", False) \
                and not _will_execute(node):
            # The det op's output is used only through routes in this backward: the use its own
            # forward counted brings no contribution (once per op call), so a single route can
            # round eagerly.
            node.ldet_use_forgotten = True
            ctx.state.forget_forward_use(p)
        add_into = sink.to_add_into(grad) if sink.to_add_into is not None else None
        row_sums = sink.to_row_sums(grad) if sink.to_row_sums is not None else None
        ctx.state.contribute(p, digits, rounded, add_into, row_sums=row_sums)
        return None, None, None, None, None, None, None


class _ExactExpand(torch.autograd.Function):
    """A tensor expanded along dimensions other than the batch (Hugging Face's ``repeat_kv`` of
    the key/value heads): the backward's sum over the copies is exact and rounded once to the
    tensor's dtype, where autograd's own would be a float reduction. Per sample, so the gradient
    stays a tensor and flows on."""

    @staticmethod
    @trusted_fn
    def forward(ctx, value, shape):
        ctx.vshape, ctx.dtype = tuple(value.shape), value.dtype
        return value.expand(shape)

    @staticmethod
    @trusted_fn
    def backward(ctx, grad):
        return det_finalize(exact_reduce_digits(grad, ctx.vshape), ctx.dtype), None


# ---- the dispatch ----------------------------------------------------------------------------
def call_with_exact_broadcasts(func, args, kwargs, state: StepState, strict: bool):
    """Calls ``func(*args, **kwargs)`` (one of :data:`BROADCAST_FUNCS`) with every operand whose
    broadcast gradient has an exact destination routed through :class:`_ExactBroadcast`."""
    if not torch.is_grad_enabled():
        return func(*args, **kwargs)
    if func in _EXPAND or func is _T.repeat:
        return _call_expand(func, args, kwargs, state, strict)
    first = 1 if func in _IN_PLACE else 0  # an in-place op's self is written, never routed
    slots = [(i, a) for i, a in enumerate(args) if i >= first and _wants_grad(a)]
    slots += [(k, a) for k, a in kwargs.items() if _wants_grad(a)]
    if not slots:
        return func(*args, **kwargs)
    tensors = [a for a in args if isinstance(a, torch.Tensor)] + [a for a in kwargs.values() if isinstance(a, torch.Tensor)]
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    except RuntimeError:
        return func(*args, **kwargs)  # PyTorch's own error
    dtype = _promoted_float(tensors)
    args, kwargs = list(args), dict(kwargs)
    for key, t in slots:
        routed = _route(func, t, shape, dtype, None, state, strict, tensors)
        if routed is not None:
            if isinstance(key, int):
                args[key] = routed
            else:
                kwargs[key] = routed
    return func(*args, **kwargs)


def _call_expand(func, args, kwargs, state, strict):
    value = args[0] if args else None
    if not _wants_grad(value):
        return func(*args, **kwargs)
    with torch.no_grad():
        probe = func(value.detach(), *args[1:], **kwargs)  # the target shape, PyTorch's own checks
    reps = None
    if func is _T.repeat:
        sizes = args[1:] if len(args) > 1 else (kwargs.get("repeats"),)
        if len(sizes) == 1 and not isinstance(sizes[0], int):
            sizes = tuple(sizes[0])
        reps = tuple(int(s) for s in sizes)
    routed = _route(func, value, probe.shape, value.dtype, reps, state, strict, [value])
    if routed is not None:
        return routed
    if reps is None and value.dtype in _FLOATS and tuple(probe.shape) != tuple(value.shape):
        return _ExactExpand.apply(value, probe.shape)  # along other dimensions than the batch
    return func(*args, **kwargs)


def _wants_grad(a) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad and a.is_floating_point()


def _promoted_float(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The floating dtype PyTorch computes the call in: floating tensors with dimensions decide
    over 0-dim ones (a routed operand gets dimensions, so it is cast to this dtype up front and
    cannot change the promotion; an in-place op's ``self`` takes part, as its arithmetic is done
    in the promoted dtype before the store)."""
    dtype = None
    for zero_dim in (False, True):
        for t in tensors:
            if t.is_floating_point() and (t.dim() == 0) == zero_dim:
                dtype = t.dtype if dtype is None else _promote(dtype, t.dtype)
        if dtype is not None:
            return dtype
    return dtype


@functools.lru_cache(maxsize=None)
@trusted_fn  # torch.promote_types is an aten op; the audit is not about dtype bookkeeping
def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return torch.promote_types(a, b)


def _route(func, t, shape, dtype, reps, state, strict, tensors) -> Optional[torch.Tensor]:
    """``t`` through _ExactBroadcast to ``shape``, or None where the call should use it as it is."""
    sink = None
    if dtype in _FLOATS:
        sink = _param_sink(t)
        if sink is None and reps is None:  # broadcast or not (see the module's docstring)
            sink = _det_op_sink(t, state, torch.Size(shape))
        if sink is None:  # broadcast or not, as a Parameter's: its every use collects digits
            sink = _moved_sink(t, state)
    if sink is None:
        if strict and _crosses_dim0(t.shape, shape):
            raise BroadcastGradError(_message(func, t, shape, tensors, dtype))
        return None
    state.note_forward_use(sink.param)
    return _ExactBroadcast.apply(t.detach(), sink.param, torch.Size(shape), dtype, reps, sink, state)


def _crosses_dim0(tshape, shape) -> bool:
    """Whether the broadcast (or tiling) spreads one element of ``tshape`` over several positions
    of dimension 0 of the result ``shape`` (the batch). A tensor whose own dimension 0 is larger
    than 1 and is tiled along it (``h.repeat(2, 1)``) only adds up copies of the same sample."""
    if len(shape) == 0:
        return False
    first = tshape[0] if len(tshape) == len(shape) else 1
    return first == 1 and shape[0] > 1


def _chain(t: torch.Tensor, depth: int = 6) -> str:
    """The grad_fn chain of ``t`` along first inputs, e.g. ``AddBackward0 <- AccumulateGrad``."""
    names, fn = [], t.grad_fn
    while fn is not None and len(names) < depth:
        var = getattr(fn, "variable", None)
        if var is not None:
            names.append(f"AccumulateGrad({type(var).__name__} {tuple(var.shape)})")
            break
        names.append(type(fn).__name__)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        fn = nxt[0] if nxt else None
    else:
        if fn is not None:
            names.append("...")
    return " <- ".join(names) if names else "a leaf that is not a Parameter"


def _message(func, t, shape, tensors, dtype) -> str:
    name = getattr(func, "__name__", repr(func))
    if "Tensor" in (getattr(func, "__qualname__", "") or ""):  # operators arrive as their methods
        name = f"Tensor.{name}"
    else:
        name = f"torch.{name}"
    why = ("" if dtype in _FLOATS else
           f" (its dtype {dtype} has no exact digit reduction; use float32, bfloat16 or float16)")
    return (
        f"det_function_mode (strict): {name} broadcasts a tensor of shape {tuple(t.shape)} that requires grad "
        f"to shape {tuple(shape)} (operands {[tuple(x.shape) for x in tensors]}), across dimension 0 (the batch). "
        f"Autograd would sum its gradient over the batch in floating point, which depends on the world size"
        f"{why}. Its grad_fn chain: {_chain(t)}. Exact routes exist for a Parameter, a view or slice of one, a "
        "dtype cast of one, and the output of a det module that takes broadcast gradients (DetEmbedding). "
        "Broadcast one of those first and compute on the full-shape result (e.g. "
        "x + self.p.expand_as(x) * 2 instead of x + self.p * 2), or pass strict=False to keep PyTorch's "
        "float sum (the op audit then labels the run unverified)."
    )
