"""Keyed dropout: masks that are the same for a sample at every world size, split and device.

Each kept/dropped decision is a pure function of (dropout seed, optimizer step, the sample's
global index within the step, a call-site key, the element's index within its sample)
(:mod:`lightning_det.ops.dropout`, csrc/dropout.h). The step and the sample index come from the
step state's ``position`` (:class:`~lightning_det.nn.step_state.BatchPosition`), which det_ddp
sets for every training step; the seed is ``StepState.dropout_seed``.

Call sites. Two dropouts in one forward must draw different masks, and a forward recomputed by
activation checkpointing must draw the same ones again:

- :class:`DetDropout` (what ``det_transform`` puts in place of ``nn.Dropout``) is keyed by its
  module's qualified name (``site``, set by det_transform; the same at every world size) and by
  how many times that module has run in the current micro-batch (``"encoder.drop#0"``,
  ``"encoder.drop#1"`` for a module called twice);
- ``F.dropout`` and ``F.scaled_dot_product_attention(dropout_p > 0)`` calls, routed here by
  ``det_function_mode``, share one per-micro-batch call counter (``"<functional>#n"``).

Counts start afresh whenever ``position`` is set (det_ddp: every micro-batch). A forward that
runs inside a backward (activation checkpointing's recomputation, reentrant or not) reuses call
0 of a module that ran exactly once in the micro-batch, which is its original key; for a module
that ran more often the original call cannot be told apart, and it raises instead of drawing a
different mask. ``F.dropout`` in a checkpointed segment is recomputed outside det_ddp's function
mode (autograd's backward does not see it), so it runs PyTorch's own dropout there, which the
first step's op audit reports: use ``nn.Dropout`` modules inside checkpointed segments.

Outside a training step with a position (validation, a plain PyTorch loop) a module in training
mode with ``p > 0`` has no key: with ``strict`` it raises, saying what is missing; otherwise it
warns and runs PyTorch's dropout (outside the verified set). A plain PyTorch or Fabric loop
provides the key itself::

    state = StepState(); set_grad_digits(model, state); state.dropout_seed = 1234
    state.position = BatchPosition(step=step, offset=first_global_sample, size=len(x),
                                   global_size=len(x) * world_size)
    loss = model(x)   # DetDropout modules draw keyed masks
"""
from __future__ import annotations

import inspect
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.dropout import DropoutKey, dropout_mask, keyed_dropout, site_key
from ._swap import swap_class
from .step_state import StepState, current_step_state

__all__ = ["DetDropout", "DetDropPath", "FUNCTIONAL_SITE", "dropout_key", "functional_dropout", "sdpa_dropout_key",
           "name_dropouts"]

#: The site name of F.dropout and attention-dropout calls (numbered per micro-batch).
FUNCTIONAL_SITE = "<functional>"

_HOW = ("det_ddp sets it for every training step; in your own loop set state.position = "
        "BatchPosition(step, offset, size, global_size) and state.dropout_seed on the StepState bound "
        "with set_grad_digits(model, state) (or passed to det_function_mode(state=...))")


def _missing(what: str, state: Optional[StepState]) -> Optional[str]:
    if state is None:
        return (f"{what}: training-mode dropout needs a StepState with the micro-batch's position in the "
                f"step's global batch (none is bound or active); {_HOW}")
    if state.position is None:
        return f"{what}: training-mode dropout needs StepState.position (it is None); {_HOW}"
    return None


def _call_key(state: StepState, site: str, what: str) -> DropoutKey:
    pos = state.position
    calls = state.dropout_calls
    n = calls.get(site, 0)
    if torch._C._current_autograd_node() is not None:  # a forward recomputed inside the backward
        if n != 1:
            raise RuntimeError(
                f"{what}: recomputed inside the backward (activation checkpointing) after {n} call(s) in this "
                "micro-batch's forward; the call it repeats, and so its dropout mask, cannot be told apart. "
                "Give each call its own nn.Dropout module, or keep the dropout out of checkpointed segments")
        k = 0
    else:
        k = n
        calls[site] = n + 1
    return DropoutKey(seed=state.dropout_seed, step=pos.step, offset=pos.offset, samples=pos.size,
                      site=site_key(f"{site}#{k}"))


def dropout_key(state: Optional[StepState], site: str, strict: bool, what: str) -> Optional[DropoutKey]:
    """The key of one dropout call at ``site``, counted in ``state``; None when there is no
    position and ``strict`` is False (after a warning: the caller runs PyTorch's dropout)."""
    msg = _missing(what, state)
    if msg is not None:
        if strict:
            raise RuntimeError(msg + ", or pass strict=False to run PyTorch's dropout (outside the verified set)")
        warnings.warn(msg + "; PyTorch's dropout runs instead (outside the verified set)", stacklevel=3)
        return None
    return _call_key(state, site, what)


def _dropout_signature(input, p=0.5, training=True, inplace=False):
    """F.dropout's signature, for binding a call's arguments by name."""


_DROPOUT_SIGNATURE = inspect.signature(_dropout_signature)


def functional_dropout(func, args, kwargs, state: Optional[StepState], strict: bool):
    """``F.dropout(*args, **kwargs)`` with a keyed mask (``det_function_mode``'s handler)."""
    a = _DROPOUT_SIGNATURE.bind(*args, **kwargs)
    a.apply_defaults()
    x, p, training, inplace = (a.arguments[k] for k in ("input", "p", "training", "inplace"))
    if not training or p == 0:
        return x  # the identity: PyTorch returns its input too (and nothing reaches the audit)
    key = dropout_key(state, FUNCTIONAL_SITE, strict, "F.dropout")
    if key is None:
        return func(*args, **kwargs)
    if strict and isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] != key.samples):
        raise ValueError(
            f"F.dropout: input of shape {tuple(x.shape)}: its dimension 0 is not the micro-batch's {key.samples} "
            "samples, so its masks cannot be keyed per sample (a (batch * seq, D) view mixes samples in one "
            "dimension, as OPT's decoder layers make). Set that dropout probability to 0 in the model's config, "
            "or run with strict=False (PyTorch's dropout there, the run labelled unverified)")
    if not _fits(x, 0, key, strict, "F.dropout"):
        return func(*args, **kwargs)
    return keyed_dropout(x, p, key, batch_dim=0, inplace=inplace)


def _fits(x, batch_dim: int, key: DropoutKey, strict: bool, what: str) -> bool:
    """Whether x holds the micro-batch's samples along batch_dim. Strict: True, and keyed_dropout
    raises a ValueError naming the shape if not; non-strict: False (after a warning) if not, and
    the caller runs PyTorch's dropout."""
    if strict or (isinstance(x, torch.Tensor) and -x.dim() <= batch_dim < x.dim()
                  and x.shape[batch_dim] == key.samples):
        return True
    shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
    warnings.warn(f"{what}: input of shape {shape} has no batch dimension {batch_dim} of the micro-batch's "
                  f"{key.samples} samples; PyTorch's dropout runs instead (outside the verified set)", stacklevel=4)
    return False


def sdpa_dropout_key(args, kwargs, state: Optional[StepState], strict: bool):
    """``(key, fallback)`` for an ``F.scaled_dot_product_attention`` call: key None when its
    dropout_p is 0; fallback True when PyTorch's own attention must run (no position, non-strict)."""
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    if p == 0:
        return None, False
    what = "F.scaled_dot_product_attention(dropout_p > 0)"
    key = dropout_key(state, FUNCTIONAL_SITE, strict, what)
    query = args[0] if args else kwargs.get("query")
    if key is None or not _fits(query, 0, key, strict, what):
        return None, True
    return key, False


class DetDropout(nn.Dropout):
    """``nn.Dropout`` with keyed masks (see the module docstring).

    Args:
        p, inplace: as ``nn.Dropout``.
        batch_dim: the input's sample dimension (0 for batch-first inputs; 1 for sequence-first
            (L, B, ...) ones such as inside ``nn.TransformerEncoderLayer(batch_first=False)``,
            which det_transform sets). Its size must equal the micro-batch's size.
        site: the call-site name (det_transform sets the module's qualified name).
        strict: without a position in training mode, raise (True) or warn and run PyTorch's
            dropout (False; det_transform passes its own ``strict``).

    Eval mode and ``p == 0`` are the identity, as in PyTorch.
    """

    supports_grad_digits = True  # bound to the step state by set_grad_digits, like DetLinear
    step_state: Optional[StepState] = None
    batch_dim = 0
    site: Optional[str] = None
    strict = True

    def __init__(self, p: float = 0.5, inplace: bool = False, *, batch_dim: int = 0, site: Optional[str] = None,
                 strict: bool = True) -> None:
        super().__init__(p, inplace)
        self.batch_dim, self.site, self.strict = batch_dim, site, bool(strict)

    @classmethod
    def from_dropout(cls, dropout: nn.Dropout) -> "DetDropout":
        """Turns an ``nn.Dropout`` into a DetDropout in place (site, batch_dim: class defaults)."""
        return swap_class(dropout, nn.Dropout, cls, "dropout")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return input
        what = f"DetDropout '{self.site or '<unnamed>'}'"
        key = _site_checked_key(self, what)
        if key is None or not _fits(input, self.batch_dim, key, self.strict, what):
            return torch.dropout_(input, self.p, True) if self.inplace else torch.dropout(input, self.p, True)
        return keyed_dropout(input, self.p, key, batch_dim=self.batch_dim, inplace=self.inplace)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, batch_dim={self.batch_dim}, site={self.site!r}, keyed=True"


def _site_checked_key(module, what: str) -> Optional[DropoutKey]:
    """The key of a keyed-dropout module's call (its bound state first: a forward recomputed in
    the backward runs outside any function mode), or None where PyTorch's dropout must run."""
    state = module.step_state if module.step_state is not None else current_step_state()
    if module.site is None and _missing(what, state) is None:
        raise RuntimeError(f"{what}: has no site name, which keys its masks; run det_transform(model) (it "
                           f"names each one by its qualified name) or set its site")
    return dropout_key(state, module.site or "", module.strict, what)


class DetDropPath(nn.Module):
    """Stochastic depth (drop path) with keyed masks: each sample's residual branch is kept or
    dropped by a draw keyed like DetDropout's, one per sample (element 0 of a (B, 1) mask), so
    the same at every world size and split. What det_transform puts in place of the library's
    drop-path modules (Hugging Face's ``ConvNextDropPath``, ``SwinDropPath`` and their copies,
    recognised by code: :mod:`lightning_det.nn.lookalikes`).

    The arithmetic is theirs: ``x.div(1 - p) * m``, ``m`` the 0/1 mask in x's dtype. Eval mode
    and ``drop_prob == 0`` are the identity. Input (B, ...), batch first.
    """

    supports_grad_digits = True  # bound to the step state by set_grad_digits, like DetDropout
    step_state: Optional[StepState] = None
    site: Optional[str] = None
    strict = True

    def __init__(self, drop_prob: float = 0.0, *, site: Optional[str] = None, strict: bool = True) -> None:
        super().__init__()
        self.drop_prob, self.site, self.strict = float(drop_prob), site, bool(strict)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return hidden_states
        keep_prob = 1 - self.drop_prob
        shape = (hidden_states.shape[0],) + (1,) * (hidden_states.ndim - 1)
        what = f"DetDropPath '{self.site or '<unnamed>'}'"
        key = _site_checked_key(self, what)
        if key is None or not _fits(hidden_states, 0, key, self.strict, what):
            random_tensor = torch.rand(shape, dtype=hidden_states.dtype, device=hidden_states.device)
            return hidden_states.div(keep_prob) * torch.floor(random_tensor + keep_prob)
        probe = torch.empty((shape[0], 1), dtype=torch.float32, device=hidden_states.device)
        kept = dropout_mask(probe, self.drop_prob, key).to(hidden_states.dtype).view(shape)
        return hidden_states.div(keep_prob) * kept

    def extra_repr(self) -> str:
        return f"p={self.drop_prob}, site={self.site!r}, keyed=True"


_SEQUENCE_FIRST_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def name_dropouts(model: nn.Module, strict: bool) -> None:
    """det_transform's last pass: every DetDropout and DetDropPath without a site gets its
    qualified name and ``strict``; DetDropouts directly inside a ``batch_first=False``
    transformer layer get batch_dim 1 (their inputs are (L, B, D)). Nothing is guessed from sizes
    (L may equal B)."""
    for fqn, m in model.named_modules():  # parents before children
        if isinstance(m, _SEQUENCE_FIRST_LAYERS) and not m.self_attn.batch_first:  # the layer's own flag
            for child in m.children():
                if isinstance(child, DetDropout) and child.site is None:
                    child.batch_dim = 1
        if isinstance(m, (DetDropout, DetDropPath)) and m.site is None:
            m.site, m.strict = fqn, bool(strict)
