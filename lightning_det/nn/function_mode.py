"""det_function_mode: sends PyTorch functions that have a det version to it, inside a ``with`` block.

det_ddp enters one around every training and validation step, constructed with its step state.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .attention import det_scaled_dot_product_attention
from .attention_routes import (BADDBMM_FUNCS, MATMUL_FUNCS, NOT_ROUTED, SOFTMAX_FUNCS, baddbmm_route, matmul_route,
                               softmax_route)
from .broadcast_grads import BROADCAST_FUNCS, call_with_exact_broadcasts
from .dropout import functional_dropout, sdpa_dropout_key
from .elementwise_routes import DETMATH_FUNCS, POW_FUNCS, detmath_route, pow_route
from .indexing import INDEX_FUNCS, index_route
from .reductions import CUMSUM_FUNCS, REDUCTION_FUNCS, cumsum_route, reduction_route
from .loss import cross_entropy_rows, cross_entropy_unsupported, det_cross_entropy_checked
from .step_state import StepState, StepStateMode

__all__ = ["det_function_mode"]


def _route_table() -> dict:
    """func -> route(mode, func, args, kwargs): the det version's result, or NOT_ROUTED (then
    PyTorch's own runs). One lookup per call: this mode sees every torch call of a step."""
    table = {}
    for funcs, route in ((MATMUL_FUNCS, lambda mode, f, a, k: matmul_route(f, a, k, mode._plans())),
                         (BADDBMM_FUNCS, lambda mode, f, a, k: baddbmm_route(f, a, k, mode._plans())),
                         (POW_FUNCS, lambda mode, f, a, k: pow_route(f, a, k)),
                         (SOFTMAX_FUNCS, lambda mode, f, a, k: softmax_route(f, a, k)),
                         (DETMATH_FUNCS, lambda mode, f, a, k: detmath_route(f, a, k)),
                         (REDUCTION_FUNCS, lambda mode, f, a, k: reduction_route(f, a, k)),
                         (CUMSUM_FUNCS, lambda mode, f, a, k: cumsum_route(f, a, k)),
                         (INDEX_FUNCS, lambda mode, f, a, k: index_route(f, a, k))):
        table.update(dict.fromkeys(funcs, route))
    return table


_ROUTE_OF = _route_table()


class _DetFunctionMode(StepStateMode):
    # a StepStateMode: set aside inside trusted regions (lightning_det.ops.trust), the det ops'
    # internals call nothing this mode redirects

    def __init__(self, strict: bool, loss_reduce: Optional[Callable], state: Optional[StepState]) -> None:
        super().__init__(state)
        self.strict, self.loss_reduce = strict, loss_reduce
        self._reduce_takes_count = loss_reduce is not None and _takes_count(loss_reduce)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            state = self.ldet_step_state
            dropout_key, fallback = sdpa_dropout_key(args, kwargs, state, self.strict)
            if fallback:  # dropout_p > 0 without a position, non-strict: PyTorch's own, unverified
                return func(*args, **kwargs)
            if state is not None:
                args, kwargs = _mask_across_the_batch(args, kwargs, state, self.strict)
            return det_scaled_dot_product_attention(*args, dropout_key=dropout_key, **kwargs)
        if func is F.dropout:
            return functional_dropout(func, args, kwargs, self.ldet_step_state, self.strict)
        if func is F.cross_entropy:
            return self._cross_entropy(func, args, kwargs)
        route = _ROUTE_OF.get(func)
        if route is not None:
            out = route(self, func, args, kwargs)
            if out is not NOT_ROUTED:
                return out
        if func in BROADCAST_FUNCS and self.ldet_step_state is not None:
            # a gradient that the broadcast would sum over the batch in float goes to exact digits
            return call_with_exact_broadcasts(func, args, kwargs, self.ldet_step_state, self.strict)
        return func(*args, **kwargs)

    def _plans(self):
        state = self.ldet_step_state
        return "default" if state is None else state.plans

    def _cross_entropy(self, func, args, kwargs):
        bound = _CE_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        reason = cross_entropy_unsupported(a["input"], a["target"], a["weight"], a["size_average"], a["reduce"],
                                           a["label_smoothing"])
        if reason is not None:
            if self.strict:
                raise ValueError(reason + " (det_function_mode, strict: pass strict=False to fall back to "
                                 "PyTorch's cross_entropy, outside the verified set)")
            warnings.warn(reason + "; PyTorch's F.cross_entropy runs instead (outside the verified set)", stacklevel=3)
            return func(*args, **kwargs)
        # this mode is off inside its own handler: the step's checks are passed, not looked up
        checks = None if self.ldet_step_state is None else self.ldet_step_state.checks
        if self.loss_reduce is None or a["reduction"] == "none":
            return det_cross_entropy_checked(a["input"], a["target"], a["ignore_index"], a["reduction"], checks)
        reduction = a["reduction"]
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
        rows, valid, n_valid = cross_entropy_rows(a["input"], a["target"], a["ignore_index"])
        if self._reduce_takes_count:  # the row count is known here: no second read of the mask
            return self.loss_reduce(rows, valid, reduction, a["input"].dtype, count=n_valid)
        return self.loss_reduce(rows, valid, reduction, a["input"].dtype)


def _mask_across_the_batch(args, kwargs, state: StepState, strict: bool):
    """The SDPA call's arguments with a float mask that needs a gradient expanded to the scores'
    shape through the exact broadcast (lightning_det.nn.broadcast_grads): shared by the batch, its
    gradient goes to its Parameter as digits (or strict mode raises), never as a per-rank float sum."""
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    query = args[0] if args else kwargs.get("query")
    key = args[1] if len(args) > 1 else kwargs.get("key")
    if not (isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.requires_grad
            and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() >= 3
            and torch.is_grad_enabled()):
        return args, kwargs
    full = (*query.shape[:-2], query.shape[-2], key.shape[-2])
    try:
        if torch.broadcast_shapes(mask.shape, full) != torch.Size(full):
            return args, kwargs  # det_scaled_dot_product_attention's own error
    except RuntimeError:
        return args, kwargs
    routed = call_with_exact_broadcasts(torch.Tensor.expand, (mask, *full), {}, state, strict)
    if len(args) > 3:
        return (*args[:3], routed, *args[4:]), kwargs
    return args, {**kwargs, "attn_mask": routed}


def _takes_count(fn: Callable) -> bool:
    """Whether a loss_reduce accepts ``count=`` (global_loss_reduce does; a user's may not)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return "count" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _ce_signature(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """F.cross_entropy's signature, for binding a call's arguments by name."""


_CE_SIGNATURE = inspect.signature(_ce_signature)


def det_function_mode(strict: bool = True, loss_reduce: Optional[Callable] = None,
                      state: Optional[StepState] = None) -> TorchFunctionMode:
    """A context manager that sends PyTorch functions with a det version to it.

        with det_function_mode():
            y = model(x)   # F.scaled_dot_product_attention: exact and batch-invariant
            loss = F.cross_entropy(y, t)   # also nn.CrossEntropyLoss: exact, device-invariant

    Redirected: ``F.scaled_dot_product_attention`` -> :func:`det_scaled_dot_product_attention`
    (``enable_gqa`` included), ``F.cross_entropy`` (which ``nn.CrossEntropyLoss`` calls) ->
    :func:`det_cross_entropy`, and the calls of hand-written attention (Hugging Face's "eager"):
    ``torch.matmul`` / ``@`` / ``bmm`` / ``mm`` of two float activations -> ``det_matmul``,
    ``F.softmax`` / ``torch.softmax`` / ``Tensor.softmax`` with a ``dim`` -> ``det_softmax``
    (:mod:`lightning_det.nn.attention_routes`); ``torch.sin`` / ``torch.cos`` (rotary
    embeddings) / ``torch.tanh`` -> ``det_sin`` / ``det_cos`` / ``det_tanh``
    (:mod:`lightning_det.nn.elementwise_routes`); ``sum`` / ``mean`` / ``cumsum`` of a float
    tensor over dimensions that leave the batch (dimension 0) alone -> ``det_sum`` /
    ``det_mean`` / ``det_cumsum`` (:mod:`lightning_det.nn.reductions`).
    With a ``state``, broadcasting functions (``+ - * /``, ``where``, ``expand``, ``repeat``, ...)
    route the gradient of a Parameter, a view of one, or a DetEmbedding output that they spread
    across the batch to exact digits (:mod:`lightning_det.nn.broadcast_grads`).
    ``F.dropout`` and attention's ``dropout_p > 0`` draw keyed masks from the state's position
    (:mod:`lightning_det.nn.dropout`).
    A torch function mode is off inside its own handler, so the det kernels' internals are not
    touched. Wrap forward and the loss alike; the backward is the det Functions' own and needs
    no mode. det_ddp applies it around every training and validation step.

    Args:
        strict: a tensor that requires grad, is broadcast across the batch (dimension 0) and has no
            exact gradient route raises :class:`~lightning_det.nn.broadcast_grads.BroadcastGradError`
            (False: PyTorch's float sum, reported by the op audit); cross_entropy options the det
            version lacks (``weight``, ``label_smoothing``,
            class-probability targets, (N, C, d1, ...) inputs, float64) raise a ValueError naming
            the argument; with False they warn and run PyTorch's own function (det_ddp's op audit of
            the first step then labels the run unverified). Training-mode dropout without a
            ``state.position`` raises a RuntimeError saying how to provide one; with False it
            warns and runs PyTorch's dropout (unverified).
        loss_reduce: ``(per_row_losses fp32 (N,), valid bool (N,), reduction, out_dtype) -> loss``
            used for reduction 'mean' and 'sum' instead of this process's exact reduction; one
            that also takes ``count=`` gets the number of valid rows (known here already).
            det_ddp passes :func:`lightning_det.parallel.loss.global_loss_reduce`: the exact
            mean / sum over the rows of every rank, so the loss and its gradient are the same at
            any world size.
        state: the step's :class:`~lightning_det.nn.step_state.StepState` (det_ddp passes its
            own): the redirected functions take its GEMM plans, value checks of cross-entropy
            targets with reduction 'none' are deferred to its ``checks``, and code inside the
            block (``global_mean``, ``det_cross_entropy``) finds it (:func:`current_step_state`).
    """
    return _DetFunctionMode(strict, loss_reduce, state)
