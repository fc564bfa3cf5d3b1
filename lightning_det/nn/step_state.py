"""StepState: everything one training step carries between the layers, in one object.

The owner of the step (det_ddp, the Fabric strategy, or a plain PyTorch loop) makes one
StepState, binds the model's det modules to it (:func:`lightning_det.nn.set_grad_digits`), and
reads it back when the step's gradients are rounded. It holds:

- ``plans``: how the exact GEMMs of the step plan their integer slices (the ``plans`` argument
  of :func:`lightning_det.ops.det_gemm`; the bytes never depend on it);
- the unrounded gradient of each parameter (a LongAcc of shape ``(*param.shape, 19)``), keyed
  by the Parameter object, which the det modules' backward add into in digit mode;
- eager rounding (``eager``) and what it needs: forward-use counts and gradients rounded in the
  backward, waiting for the owner;
- ``checks``: value checks of the step's inputs, resolved by the owner (DeferredChecks);
- ``position``: where this process's micro-batch sits in the optimizer step's global batch
  (:class:`BatchPosition`), which keyed dropout and global-batch statistics need; None outside a
  training step. Setting it starts a micro-batch: the keyed dropout call counts start afresh;
- ``batch_norm_group_size``: None (BatchNorm normalizes over the whole global micro-batch), or G:
  BatchNorm's normalization groups are G consecutive global samples (ghost batch norm,
  :mod:`lightning_det.nn.batch_norm`), the same at every world size and accumulation that G divides;
- ``dropout_seed``: the seed of keyed dropout (:mod:`lightning_det.nn.dropout`), and
  ``dropout_calls``: its per-site call counts within the current micro-batch;
- ``reduce_digits``: returns a LongAcc's exact sum over every rank (the strategy's exact
  all-reduce; the identity at world size 1), for statistics that cross ranks inside the forward
  or backward;
- ``global_mean_used``: whether a global loss (:func:`lightning_det.global_mean`) was
  back-propagated (the strategy sets it from
  :func:`lightning_det.parallel.loss.feeds_global_loss`), so it skips its 1/N gradient scale.

Eager rounding (``with state.eager_rounding():`` around the step's one backward, world size 1):
the digits of a parameter with exactly one contribution in that backward would be rounded once
anyway, so its module rounds it there and then (the ordinary exact GEMM with a rounded output)
and never allocates its 152 bytes per element of digits. "Exactly one" is proved per parameter:
each det module's forward counts the uses of its parameters that require grad (in any grad mode,
so a forward that a reentrant checkpoint will recompute counts too), each backward contribution
takes one off, and a contribution rounds eagerly only when it is the single counted use and no
digits are pending. Anything uncounted that arrives later (a second backward through a retained
graph, a checkpointed segment recomputed after the rounding) raises instead of rounding twice.

A weight with two contributions, a dense one and then one confined to a few rows (a head tied to
its token embedding: the head's dW, then the embedding's occurring rows), is also rounded in the
backward, without digits of its whole shape: the dense contribution waits as its operands (it
offers ``rows``, its digits of given rows), and the sparse one (``row_sums``) completes it, each
touched row's digits made from both and rounded once, every other row rounded from the dense one.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from ..ops import LongAcc, det_combine, det_finalize, det_normalize
from ..ops.deferred_checks import DeferredChecks
from ..ops.longacc import _plans_arg, check_acc

__all__ = ["BatchPosition", "StepState", "StepStateMode", "current_step_state"]


@dataclass(frozen=True)
class BatchPosition:
    """Where one process's micro-batch sits in its optimizer step's global batch.

    The global batch of a step is ``accumulation * world_size`` micro-batches of ``size`` samples,
    ordered micro-batch by micro-batch, rank by rank (DeterministicSampler's order). Sample ``i``
    of this micro-batch is global sample ``offset + i`` of the step, at every world size and split.

    Args:
        step: the optimizer step the micro-batch belongs to (0-based).
        offset: global index, within the step, of this micro-batch's first sample.
        size: samples in this process's micro-batch.
        global_size: samples in the global micro-batch (every rank's current micro-batch together:
            ``size * world_size``); ``offset - offset % global_size`` is where it starts.
    """

    step: int
    offset: int
    size: int
    global_size: int

    def __post_init__(self) -> None:
        for name in ("step", "offset", "size", "global_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: expected an integer >= 0, got {v!r}")
        if self.size < 1 or self.global_size < self.size:
            raise ValueError(f"size, global_size: expected 1 <= size <= global_size, got {self.size}, {self.global_size}")


class StepState:
    """The state of one training step, passed explicitly to whatever needs it.

    Args:
        plans: the GEMM plan mode of the step's det modules: ``"default"``, ``"cached"``,
            ``"sync"`` or ``(slices_x, slices_w)`` (as :func:`lightning_det.ops.det_gemm`'s).
    """

    def __init__(self, plans="default") -> None:
        _plans_arg(plans)  # checked here, once, not at the first GEMM
        self.plans = plans
        self.eager = False
        self.global_mean_used = False
        self.dropout_seed = 0
        self.dropout_calls: Dict[str, int] = {}
        self.position = None
        self.batch_norm_group_size: Optional[int] = None
        self.reduce_digits: Callable[[LongAcc], LongAcc] = _no_reduce
        self.checks = DeferredChecks()
        # id(param) -> [param, digits, owned]: owned = made or handed over here, so writable
        self._digits: Dict[int, list] = {}
        self._rounded: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (param, grad)
        self._uses: Dict[int, list] = {}  # id(param) -> [param, forward uses whose backward is due]
        # id(param) -> [param, digits, rounded, rows]: a dense contribution waiting for a sparse one
        self._waiting: Dict[int, list] = {}

    @property
    def position(self) -> Optional[BatchPosition]:
        return self._position

    @position.setter
    def position(self, value: Optional[BatchPosition]) -> None:
        if value is not None and not isinstance(value, BatchPosition):
            raise TypeError(f"position: expected a BatchPosition or None, got {type(value).__name__}")
        self._position = value
        self.dropout_calls = {}  # a new micro-batch: its dropout calls are counted from 0

    # ---- forward ---------------------------------------------------------------------------
    def note_forward_use(self, *params: Optional[torch.Tensor]) -> None:
        """A det module's forward: each param (that requires grad) expects one more backward
        contribution. Counted in any grad mode: a forward under no_grad may be recomputed with grad
        later (reentrant activation checkpointing), and over-counting (a forward whose output never
        reaches a loss) only keeps that parameter on the digit path. Under-counting is what would
        be unsafe, and a contribution arriving after an eager rounding raises."""
        for p in params:
            if p is not None and p.requires_grad:
                entry = self._uses.get(id(p))
                if entry is None:
                    self._uses[id(p)] = [p, 1]
                else:
                    entry[1] += 1

    def forget_forward_use(self, param: torch.Tensor) -> None:
        """One counted use of ``param`` will bring no contribution (a det op whose output was
        used only through routes, lightning_det.nn.broadcast_grads): its count goes down by one,
        never below zero."""
        entry = self._uses.get(id(param))
        if entry is not None and entry[0] is param and entry[1] > 0:
            entry[1] -= 1

    def clear_forward_uses(self) -> None:
        """Forgets the counts (their backward is done; leftovers were over-counts)."""
        self._uses.clear()

    @contextmanager
    def eager_rounding(self, enabled: bool = True) -> Iterator[None]:
        """Lets the bound det modules round single-contribution gradients at once.

        Must enclose the forward and the backward of the step's last (or only) micro-batch, and
        only where the pending digits would then be rounded with no reduction and no scale: one
        process (world size 1). Entering forgets earlier forward-use counts (their backward is
        done). The rounded gradients wait here (:meth:`take_rounded_grad`) for the step's owner.
        """
        if not enabled:
            yield
            return
        self.clear_forward_uses()
        self.eager = True
        try:
            yield
            self._settle_waiting()
        finally:
            self.eager = False
            self._waiting.clear()

    def _settle_waiting(self) -> None:
        """After the eager backward: a dense contribution still waiting was its parameter's only
        one (the counted use that would have completed it brought none), so it is rounded."""
        for param, _, rounded, _ in self._waiting.values():
            self._rounded[id(param)] = (param, rounded())
        self._waiting.clear()

    # ---- backward --------------------------------------------------------------------------
    def contribute(self, param: torch.Tensor, digits: Callable[[], LongAcc],
                   rounded: Callable[[], torch.Tensor],
                   add_into: Optional[Callable[[LongAcc], None]] = None, *,
                   rows: Optional[Callable[[torch.Tensor], LongAcc]] = None,
                   row_sums: Optional[Callable[[], Tuple[torch.Tensor, LongAcc]]] = None) -> None:
        """A det module's backward hands over one exact contribution to ``param``'s gradient.

        Args:
            param: the parameter receiving the contribution.
            digits: makes the contribution as a canonical LongAcc ``(*param.shape, 19)``, handed over.
            rounded: makes the same exact sum rounded once to the param's dtype, shape ``param.shape``.
                Called instead of ``digits`` only when this is provably the parameter's one
                contribution of a backward under :meth:`eager_rounding`.
            add_into: optional; adds the same contribution's canonical digits into a canonical
                LongAcc of the parameter's shape, in place (a sparse contribution, an embedding's
                rows, touches only its rows). Used instead of ``digits`` where this state already
                holds the parameter's digits and may write them: no second full-size LongAcc.
            rows: optional; ``rows(index)`` makes the contribution's canonical digits of the given
                rows (dim 0) only, ``(len(index), *param.shape[1:], 19)`` (a dense contribution, a
                Linear's dW). Under eager rounding, a first contribution of two that offers it waits
                (as its operands) for the second, instead of making the parameter's digits.
            row_sums: optional; makes ``(row, sums)``: the contribution is zero outside the rows
                listed in ``row`` (int64 ``(n,)``, each row at most once; ``param.shape[0]`` marks
                an entry that goes nowhere, its sums zero), ``sums`` their canonical digits
                ``(n, *param.shape[1:], 19)`` (an embedding's occurring rows). The last contribution
                of a waiting dense one completes it with these rows: no digits of the whole shape.
        """
        entry = self._uses.get(id(param))
        uses = entry[1] if entry is not None and entry[0] is param else 0
        if uses > 0:
            entry[1] = uses - 1
        if id(param) in self._rounded:
            raise RuntimeError(
                f"param: a gradient contribution (shape {tuple(param.shape)}) arrived after this parameter's "
                "gradient was already rounded as its only one (eager rounding); a second backward through a "
                "retained graph or a recomputed checkpoint segment does that. Construct the strategy with "
                "eager_rounding=False to keep every gradient as digits until the step."
            )
        waiting = self._waiting.pop(id(param), None)
        if waiting is not None and waiting[0] is param:
            if row_sums is not None and uses == 1:
                self._rounded[id(param)] = (param, _dense_with_rows(param, waiting[2], waiting[3], row_sums))
                return
            self.add_grad_digits(param, waiting[1](), take=True)  # not the pair it waited for
        elif self.eager and uses > 1 and rows is not None and self.grad_digits(param) is None:
            self._waiting[id(param)] = [param, digits, rounded, rows]
            return
        if self.eager and uses == 1 and self.grad_digits(param) is None:
            self._rounded[id(param)] = (param, rounded())
            return
        entry = self._digits.get(id(param))
        if add_into is not None and entry is not None and entry[0] is param and entry[2]:
            # Two canonical accumulators added: far inside every digit's headroom (longacc.h).
            add_into(entry[1])
            entry[1] = det_normalize(entry[1])
            return
        self.add_grad_digits(param, digits(), take=True)

    def add_grad_digits(self, param: torch.Tensor, acc: LongAcc, *, take: bool = False) -> None:
        """Adds an exact gradient contribution (LongAcc of shape ``(*param.shape, 19)``, canonical).

        Args:
            param: the parameter whose pending digits receive the contribution.
            acc: int64 ``(*param.shape, 19)`` on the parameter's pending digits' device.
            take: the caller hands ``acc`` over (it keeps no reference and will not read it
                again), so it may become the pending digits and later sums may go into it in place:
                one full copy of the digits fewer at the memory peak of gradient accumulation. The
                det modules pass True for the tensors their backward just made; with False the
                caller's tensor is never written.
        """
        check_acc(acc, "acc")
        if acc.shape[:-1] != param.shape:
            raise ValueError(f"acc: expected shape {(*param.shape, 19)} for this parameter, got {tuple(acc.shape)}")
        entry = self._digits.get(id(param))
        if entry is None:
            self._digits[id(param)] = [param, acc, take]
            return
        prev, owned = entry[1], entry[2]
        if owned:
            if acc.device != prev.device:
                raise ValueError(f"acc: expected device {prev.device} like the pending digits, got {acc.device}")
            # Two canonical accumulators: the sum is far inside every digit's headroom (longacc.h).
            prev.add_(acc)
            total = det_normalize(prev)
        else:
            total = det_combine([prev, acc])
        entry[1], entry[2] = total, True  # made here: nobody else holds it

    # ---- the owner, after the backward -------------------------------------------------------
    def grad_digits(self, param: torch.Tensor) -> Optional[LongAcc]:
        """The pending unrounded gradient of ``param``, or None."""
        entry = self._digits.get(id(param))
        return entry[1] if entry is not None and entry[0] is param else None

    def pop_grad_digits(self, param: torch.Tensor) -> Optional[LongAcc]:
        """Removes and returns ``param``'s pending digits, or None."""
        acc = self.grad_digits(param)
        if acc is not None:
            del self._digits[id(param)]
        return acc

    def rounded_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """``param``'s eagerly rounded gradient waiting for the owner, or None."""
        entry = self._rounded.get(id(param))
        return entry[1] if entry is not None and entry[0] is param else None

    def take_rounded_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """Removes and returns ``param``'s eagerly rounded gradient, or None."""
        g = self.rounded_grad(param)
        if g is not None:
            del self._rounded[id(param)]
        return g

    def pending_params(self) -> List[torch.Tensor]:
        """The parameters holding pending digits or an eagerly rounded gradient."""
        return [e[0] for e in self._digits.values()] + [p for p, _ in self._rounded.values()]

    def consume_global_mean(self) -> bool:
        """True if a global loss took part in a backward since the last call (the owner then skips
        its 1/N scale)."""
        used, self.global_mean_used = self.global_mean_used, False
        return used


def _dense_with_rows(param: torch.Tensor, rounded: Callable[[], torch.Tensor],
                     rows: Callable[[torch.Tensor], LongAcc],
                     row_sums: Callable[[], Tuple[torch.Tensor, LongAcc]]) -> torch.Tensor:
    """A dense contribution (``rounded``, ``rows``) plus a sparse one (``row_sums``) rounded once,
    as the parameter's gradient: each listed row from both contributions' digits, every other row
    as the dense one alone rounds it (the same exact sum). Entries that go nowhere are written to a
    spare row, dropped: no host synchronization."""
    row, sums = row_sums()
    n_rows = param.shape[0]
    acc = rows(torch.where(row == n_rows, 0, row))
    acc.add_(sums)  # two canonical accumulators: far inside every digit's headroom (longacc.h)
    dense = rounded()
    out = torch.empty((n_rows + 1, *dense.shape[1:]), dtype=dense.dtype, device=dense.device)
    out[:n_rows].copy_(dense)
    out.index_copy_(0, row, det_finalize(det_normalize(acc), dense.dtype))
    return out[:n_rows]


def _no_reduce(acc: LongAcc) -> LongAcc:
    """One process: the sum over ranks is the process's own value."""
    return acc


class StepStateMode(TorchFunctionMode):
    """A torch function mode that carries a StepState to code that runs without a det module.

    ``det_cross_entropy``'s deferred checks run in the user's code, outside any module bound to
    the state: they find the state of the innermost such mode on the torch function mode stack
    (:func:`current_step_state`). This mode redirects nothing;
    :func:`lightning_det.nn.det_function_mode` is one that also redirects, which det_ddp enters
    around its training step. (Autograd's backward does not see the mode stack.)
    """

    # set aside inside trusted regions (lightning_det.ops.trust), like the redirect mode: a det
    # op's internals look nothing up, and every torch call through a Python mode costs host time
    ldet_redirect_mode = True

    def __init__(self, state: Optional[StepState]) -> None:
        super().__init__()
        if state is not None and not isinstance(state, StepState):
            raise TypeError(f"state: expected a StepState or None, got {type(state).__name__}")
        self.ldet_step_state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def current_step_state() -> Optional[StepState]:
    """The StepState of the innermost StepStateMode on this thread's torch function mode stack,
    or None."""
    for i in range(torch._C._len_torch_function_stack() - 1, -1, -1):
        state = getattr(torch._C._get_function_stack_at(i), "ldet_step_state", None)
        if state is not None:
            return state
    return None
