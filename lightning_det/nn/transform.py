"""det_transform: swap a model's modules for their Det versions in place (torchao quantize_ style).

    model = det_transform(model)                       # strict: uncovered modules raise
    model = det_transform(model, strict=False)         # warn; model.ldet_unverified lists them
    model = det_transform(model, filter_fn=lambda m, fqn: not fqn.startswith("head"))
    register_det_module(MyNorm, lambda m: ...)        # your own class -> its Det version

The swap changes only each module's class (``__class__``), so the Parameter objects, their
names and the ``state_dict`` keys stay exactly as they were: checkpoints load both ways, and an
optimizer built before the transform still holds the right tensors.

Which modules are swapped, first rule that applies:

1. a class registered with :func:`register_det_module` (exact class): its factory;
2. a covered PyTorch class (``_SWAPS``), exactly;
3. a subclass of a covered PyTorch class that keeps the base's ``forward`` (and adds no
   parameters or children), e.g. torch's ``NonDynamicallyQuantizableLinear`` or a LayerNorm
   subclass that only changes ``__init__``: the base's Det class. A subclass that overrides
   ``forward`` computes something the library cannot know, and is reported;
4. a library lookalike recognised by structure and by its forward's code
   (:mod:`lightning_det.nn.lookalikes`): HF ``Conv1D``, ``FalconLinear``, Llama/Qwen2/T5-style
   and Gemma-style RMSNorms, HF ``SiLUActivation``, ``NewGELUActivation``, ``GELUActivation``,
   ``GELUTanh``, ``QuickGELUActivation``, HF drop paths (-> :class:`~lightning_det.nn.DetDropPath`),
   and the library wrappers whose code only rearranges around ``super().forward`` (OPT's and
   BART's positions, Gemma's and BART's scaled embeddings, ConvNext's LayerNorm), which get the
   Det class under their own.

Everything else is reported (strict: raised) when it holds parameters and is a layer: a
``torch.nn`` layer without a Det version (Conv3d, Bilinear, ...), a subclass of a covered class
that could not be swapped (its own ``forward``), or any module holding a ``weight`` or ``bias``
(a norm or projection with its own arithmetic); or when it is an
activation or dropout module (from ``torch.nn`` or ``transformers.activations``) with no Det
version. Any other module that holds parameters directly (a ViT's ``cls_token`` and position
embedding, a layer scale) keeps them: they are listed in ``model.ldet_loose_params`` and checked
where they are used. Under det_ddp a loose parameter used by a broadcasting function (``+ - * /``,
``expand``, ``where``, ...) gets an exact gradient (:mod:`lightning_det.nn.broadcast_grads`); any
other use is caught at run time: the op audit names the op, and strict det_ddp refuses a
parameter whose gradient was rounded outside the exact paths.

Each DetDropout is keyed by its qualified name in ``model`` (its ``site``), and those
inside ``batch_first=False`` transformer layers take their batch from dimension 1
(:mod:`lightning_det.nn.dropout`).
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

from torch import nn

from .activation import DetGELU, DetHardtanh, DetQuickGELU, DetReLU, DetSiLU, DetSigmoid, DetTanh
from .batch_norm import DetBatchNorm1d, DetBatchNorm2d
from .conv import DetConv1d, DetConv2d
from .conv1d import DetConv1D
from .dropout import DetDropout, DetDropPath, name_dropouts
from .embedding import DetEmbedding, _check_options
from .group_norm import DetGroupNorm
from .linear import DetLinear
from .lookalikes import match_lookalike
from .mha import (DetMultiheadAttention, DetTransformerDecoderLayer, DetTransformerEncoder,
                  DetTransformerEncoderLayer, TRANSFORMER_SWAPS)
from .norm import DetLayerNorm, DetRMSNorm
from .pool import DetAdaptiveAvgPool1d, DetAdaptiveAvgPool2d, DetMaxPool2d

__all__ = [
    "det_transform", "register_det_module", "UnsupportedModuleError", "DET_MODULES", "UNVERIFIED_ATTR",
    "supported_summary",
]

UNVERIFIED_ATTR = "ldet_unverified"
LOOSE_ATTR = "ldet_loose_params"

# PyTorch class -> Det class (rules 2 and 3 above)
_SWAPS: dict[type, type] = {
    nn.Linear: DetLinear,
    nn.Embedding: DetEmbedding,
    nn.LayerNorm: DetLayerNorm,
    nn.RMSNorm: DetRMSNorm,
    nn.GELU: DetGELU,
    nn.SiLU: DetSiLU,
    nn.Tanh: DetTanh,
    nn.Sigmoid: DetSigmoid,
    nn.ReLU: DetReLU,
    nn.Hardtanh: DetHardtanh,
    nn.Conv1d: DetConv1d,
    nn.Conv2d: DetConv2d,
    nn.BatchNorm1d: DetBatchNorm1d,
    nn.BatchNorm2d: DetBatchNorm2d,
    nn.GroupNorm: DetGroupNorm,
    nn.AdaptiveAvgPool1d: DetAdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d: DetAdaptiveAvgPool2d,
    nn.MaxPool2d: DetMaxPool2d,
    nn.Dropout: DetDropout,
}
DET_MODULES: tuple[type, ...] = tuple(_SWAPS.values()) + (
    DetConv1D, DetDropPath, DetQuickGELU, DetMultiheadAttention, DetTransformerEncoderLayer, DetTransformerEncoder,
    DetTransformerDecoderLayer)

# user class -> factory (rule 1)
_REGISTERED: dict[type, Callable[[nn.Module], nn.Module]] = {}

# where activation modules live: a parameterless module from these that is not swapped is
# reported, since its op would otherwise be found only by the first step's audit
# (Dropout1d/2d/3d and AlphaDropout too: their masks would come from the per-rank RNG)
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "torch.nn.modules.dropout", "transformers.activations")


class UnsupportedModuleError(ValueError):
    """A module outside the verified set (strict det_transform)."""


def register_det_module(cls: type, factory: Callable[[nn.Module], nn.Module]) -> None:
    """Tells :func:`det_transform` how to make a Det version of your own module class.

    Args:
        cls: an ``nn.Module`` subclass, matched exactly (its subclasses are not).
        factory: ``factory(module) -> nn.Module``, called with each instance of ``cls`` found;
            returns the replacement (the same object changed in place, e.g. by a Det class's
            ``from_*`` constructor, or a new module, which det_transform puts in its place).
            You vouch that the replacement computes what ``cls`` does with the library's exact
            modules and verified ops; the first step's op audit still checks the ops it runs.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"cls: expected an nn.Module subclass, got {cls!r}")
    if not callable(factory):
        raise TypeError(f"factory: expected a callable factory(module) -> nn.Module, got {type(factory).__name__}")
    if cls in _SWAPS or cls in DET_MODULES or cls in TRANSFORMER_SWAPS:
        raise ValueError(f"cls: {cls.__name__} is already covered by det_transform; register your own classes only")
    _REGISTERED[cls] = factory


def supported_summary() -> str:
    """The covered modules, in words, for error messages."""
    torch_names = ", ".join(f"nn.{c.__name__}" for c in _SWAPS)
    mine = f"; registered: {', '.join(c.__name__ for c in _REGISTERED)}" if _REGISTERED else ""
    return (f"{torch_names} and their subclasses that keep forward; nn.MultiheadAttention, "
            "nn.TransformerEncoder(Layer), nn.TransformerDecoderLayer; HF Conv1D, FalconLinear, Llama/T5/Gemma-style "
            "RMSNorms, SiLU/GELU activations, drop paths, OPT/Gemma embeddings, ConvNext LayerNorm"
            f"{mine}")


def _describe(fqn: str, module: nn.Module) -> str:
    return f"{fqn or '<root>'} ({type(module).__name__})"


def _subclass_base(module: nn.Module) -> Optional[type]:
    """The covered PyTorch base of a subclass that keeps its ``forward`` and adds no parameters
    or children (rule 3), else None."""
    for base in type(module).__mro__[1:]:
        if base in _SWAPS:
            if type(module).forward is not base.forward or next(module.children(), None) is not None:
                return None
            names = {n for n, _ in module.named_parameters(recurse=False)}
            return base if names <= {"weight", "bias"} else None
    return None


def _factory(module: nn.Module) -> Optional[Callable[[nn.Module], nn.Module]]:
    cls = type(module)
    if cls in _REGISTERED:
        return _REGISTERED[cls]
    if cls in TRANSFORMER_SWAPS:
        return TRANSFORMER_SWAPS[cls]
    base = cls if cls in _SWAPS else _subclass_base(module)
    if base is not None:
        target = _SWAPS[base]

        def swap(m: nn.Module) -> nn.Module:
            if target is DetEmbedding:
                _check_options(m)  # raises with the reason and the fix
            check = getattr(target, "check_module", None)
            if check is not None:
                check(m)  # options the Det class does not cover: raises with the reason and the fix
            m.__class__ = target
            return m

        return swap
    return match_lookalike(module)


def _is_activation(module: nn.Module) -> bool:
    return type(module).__module__ in _ACTIVATION_MODULES and next(module.parameters(), None) is None


# A module holding these is a layer applying them with its own arithmetic (a norm, a projection):
# reported. Other directly held parameters (cls_token, pos_embed, a layer scale) are loose.
_LAYER_PARAMS = {"weight", "bias"}


def _is_torch_layer(module: nn.Module) -> bool:
    """A torch.nn layer class (Conv3d, Bilinear, ...): its parameters meet its own kernels."""
    return any(c.__module__.startswith("torch.nn.") for c in type(module).__mro__[:-1]
               if c is not nn.Module)


def _replace(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name), name, new)


def det_transform(
    model: nn.Module,
    strict: bool = True,
    filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
) -> nn.Module:
    """Swaps covered modules of ``model`` for their Det versions, in place; returns ``model``.

    Args:
        model: any ``nn.Module``.
        strict: if True, a module that is neither covered nor already a Det module raises
            :class:`UnsupportedModuleError` naming every such module with its class, when it
            directly holds parameters or is an activation module without a Det version. If
            False, such modules are warned about and listed in ``model.ldet_unverified``.
        filter_fn: ``filter_fn(module, fqn) -> bool``; only modules for which it returns True
            are swapped or checked (default: all). A module filtered out is the user's explicit
            choice and is not reported.

    Sets ``model.ldet_unverified``: a list of ``"fqn (Class)"`` strings, empty when every
    parameter and activation lives in a verified module, so a strategy can label the run; and
    ``model.ldet_loose_params``: the qualified names of the parameters held directly by modules
    without a Det version, checked at run time (see the module docstring).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    uncovered, loose = [], []
    for fqn, module in list(model.named_modules()):
        if filter_fn is not None and not filter_fn(module, fqn):
            continue
        if isinstance(module, DET_MODULES):
            continue
        factory = _factory(module)
        if factory is not None:
            new = factory(module)
            if not isinstance(new, nn.Module):
                raise TypeError(f"det_transform: the factory for {_describe(fqn, module)} returned "
                                f"{type(new).__name__}, expected an nn.Module")
            if new is not module:
                if not fqn:
                    raise ValueError("model: the root module cannot be replaced by a new object; "
                                     "make its factory change it in place")
                _replace(model, fqn, new)
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]
        layer = _is_torch_layer(module) or isinstance(module, tuple(_SWAPS)) or bool(_LAYER_PARAMS & set(own))
        if _is_activation(module) or (own and layer):
            uncovered.append(_describe(fqn, module))
        elif own:
            loose += [f"{fqn}.{n}" if fqn else n for n in own]
    if uncovered and strict:
        raise UnsupportedModuleError(
            f"det_transform: {len(uncovered)} module(s) outside the verified set: "
            f"{', '.join(uncovered)}. Their arithmetic is not covered by the bitwise contract. "
            f"Covered: {supported_summary()}. Register a Det version of your own class with "
            "register_det_module, pass strict=False (the run is then labelled unverified), or "
            "exclude them with filter_fn."
        )
    if uncovered:
        warnings.warn(
            "det_transform: modules outside the verified set (run will be labelled unverified): "
            + ", ".join(uncovered),
            stacklevel=2,
        )
    name_dropouts(model, strict)  # keyed dropout: each DetDropout's site is its qualified name
    setattr(model, UNVERIFIED_ATTR, uncovered)
    setattr(model, LOOSE_ATTR, loose)
    return model
