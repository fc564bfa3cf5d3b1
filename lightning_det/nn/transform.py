"""det_transform: swap a model's modules for their Det versions in place (torchao quantize_ style).

    model = det_transform(model)                       # strict: uncovered parameters raise
    model = det_transform(model, strict=False)         # warn; model.ldet_unverified lists them
    model = det_transform(model, filter_fn=lambda m, fqn: not fqn.startswith("head"))

The swap changes only each module's class (``__class__``), so the Parameter objects, their
names and the ``state_dict`` keys stay exactly as they were: checkpoints load both ways, and an
optimizer built before the transform still holds the right tensors.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

from torch import nn

from .activation import DetGELU, DetReLU, DetSiLU, DetTanh
from .embedding import DetEmbedding, _check_options
from .linear import DetLinear
from .norm import DetLayerNorm, DetRMSNorm

__all__ = ["det_transform", "UnsupportedModuleError", "DET_MODULES", "UNVERIFIED_ATTR"]

UNVERIFIED_ATTR = "ldet_unverified"

# PyTorch class -> Det class; exact class match, so a user subclass with its own forward is not
# silently swapped (its forward would be replaced).
_SWAPS: dict[type, type] = {
    nn.Linear: DetLinear,
    nn.Embedding: DetEmbedding,
    nn.LayerNorm: DetLayerNorm,
    nn.RMSNorm: DetRMSNorm,
    nn.GELU: DetGELU,
    nn.SiLU: DetSiLU,
    nn.Tanh: DetTanh,
    nn.ReLU: DetReLU,
}
DET_MODULES: tuple[type, ...] = tuple(_SWAPS.values())


class UnsupportedModuleError(ValueError):
    """A module holding parameters is outside the verified set (strict det_transform)."""


def _describe(fqn: str, module: nn.Module) -> str:
    return f"{fqn or '<root>'} ({type(module).__name__})"


def det_transform(
    model: nn.Module,
    strict: bool = True,
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
) -> nn.Module:
    """Swaps covered modules of ``model`` for their Det versions, in place; returns ``model``.

    Args:
        model: any ``nn.Module``.
        strict: if True, a module that directly holds parameters and is neither covered nor
            already a Det module raises :class:`UnsupportedModuleError` naming it. If False,
            such modules are warned about and listed in ``model.ldet_unverified``.
        filter_fn: ``filter_fn(module, fqn) -> bool``; only modules for which it returns True
            are swapped or checked (default: all). A module filtered out is the user's explicit
            choice and is not reported.

    Sets ``model.ldet_unverified``: a list of ``"fqn (Class)"`` strings, empty when every
    parameter lives in a verified module, so a strategy can label the run unverified.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    uncovered = []
    for fqn, module in list(model.named_modules()):
        if filter_fn is not None and not filter_fn(module, fqn):
            continue
        if isinstance(module, DET_MODULES):
            continue
        target = _SWAPS.get(type(module))
        if target is not None:
            if target is DetEmbedding:
                _check_options(module)  # raises with the reason and the fix
            module.__class__ = target
            continue
        if next(module.parameters(recurse=False), None) is not None:
            uncovered.append(_describe(fqn, module))
    if uncovered and strict:
        supported = ", ".join(sorted(c.__name__ for c in _SWAPS))
        raise UnsupportedModuleError(
            f"det_transform: {len(uncovered)} module(s) hold parameters outside the verified set: "
            f"{', '.join(uncovered)}. Their arithmetic is not covered by the bitwise contract. "
            f"Use one of the supported modules ({supported}), or pass strict=False (the run is "
            "then labelled unverified), or exclude them with filter_fn."
        )
    if uncovered:
        warnings.warn(
            "det_transform: modules outside the verified set (run will be labelled unverified): "
            + ", ".join(uncovered),
            stacklevel=2,
        )
    setattr(model, UNVERIFIED_ATTR, uncovered)
    return model
