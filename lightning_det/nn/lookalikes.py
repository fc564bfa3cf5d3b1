"""Library classes that compute what a Det module computes, recognised by structure and code.

Real models hold lookalike classes: Hugging Face's ``Conv1D`` (a transposed Linear),
``FalconLinear`` (``x @ W.T + b``), ``LlamaRMSNorm`` and its copies (``Qwen2RMSNorm``,
``MistralRMSNorm``, ...), ``T5LayerNorm``, ``GemmaRMSNorm`` (``xhat * (1 + weight)``), HF's
activation modules (``QuickGELUActivation`` included) and drop-path modules (``ConvNextDropPath``,
``SwinDropPath``, ...). A class is
never matched by its name. The rule, per kind:

1. **Structure**: exactly the expected direct parameters (names and ranks), no buffers, no
   child modules, and the attributes the arithmetic reads (``variance_epsilon``, ``nf``...).
2. **Code**: the class's ``forward`` (and the methods it calls) has the same bytecode,
   constants and names as the library's own, read from the installed library (``_refs``). A
   class that changes one operation, a constant or a cast does not match, and det_transform
   reports it like any other uncovered module.

What a match changes: the module's class (in place, keeping its Parameter objects, so
``state_dict`` keys and shapes stay loadable both ways) and its rounding, which becomes the
Det module's (one rounding per output; the exact function is the same). One more difference,
for RMSNorms: the output has the input's dtype, where HF multiplies the fp32 weight into a
half-precision input and returns fp32; a model held in one dtype sees no difference.

**Wrappers** of a covered class whose recognised ``forward`` only rearranges its input or output
around ``super().forward``: OPT's ``OPTLearnedPositionalEmbedding`` and BART's
``BartLearnedPositionalEmbedding`` (position ids, integer arithmetic), Gemma's
``GemmaTextScaledWordEmbedding`` and BART's ``BartScaledWordEmbedding`` (the output times a
constant), ConvNext's ``ConvNextLayerNorm`` (permutes for channels-first). The Det class
is put under the library's class (``class DetX(X, DetBase)``), so ``super().forward`` runs the
Det module while the library's own code around it runs unchanged, under the op audit like any
other code.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .activation import DetGELU, DetQuickGELU, DetSiLU
from .conv1d import conv1d_to_det
from .dropout import DetDropPath
from .embedding import DetEmbedding, _check_options
from .linear import DetLinear
from .norm import DetLayerNorm, DetRMSNorm

__all__ = ["match_lookalike"]


# ---- the library's own forwards, from the installed library (their bytecode is the fingerprint)
def _attr(path: str):
    """``module.Class.attr`` of the installed transformers, or None (not installed, or a version
    without it: then no class of that kind can be met either)."""
    mod, _, rest = path.partition(":")
    try:
        obj = importlib.import_module(mod)
    except Exception:  # transformers missing or failing to import: nothing of it to match
        return None
    for name in rest.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


@functools.lru_cache(maxsize=None)
def _refs() -> dict:
    """name -> the library function whose code a lookalike's must equal (missing ones left out)."""
    paths = {
        "conv1d": "transformers.pytorch_utils:Conv1D.forward",
        "llama_rms": "transformers.models.llama.modeling_llama:LlamaRMSNorm.forward",
        "t5_rms": "transformers.models.t5.modeling_t5:T5LayerNorm.forward",
        "silu": "transformers.activations:SiLUActivation.forward",
        "new_gelu": "transformers.activations:NewGELUActivation.forward",
        "act_attr": "transformers.activations:GELUActivation.forward",
        "gelu_python": "transformers.activations:GELUActivation._gelu_python",
        "gelu_tanh_python": "transformers.activations:GELUTanh._gelu_tanh_python",
        "falcon_linear": "transformers.models.falcon.modeling_falcon:FalconLinear.forward",
        "gemma_rms": "transformers.models.gemma.modeling_gemma:GemmaRMSNorm.forward",
        "gemma_rms_norm": "transformers.models.gemma.modeling_gemma:GemmaRMSNorm._norm",
        "drop_path": "transformers.models.convnext.modeling_convnext:ConvNextDropPath.forward",
        "opt_positions": "transformers.models.opt.modeling_opt:OPTLearnedPositionalEmbedding.forward",
        "gemma_embedding": "transformers.models.gemma.modeling_gemma:GemmaTextScaledWordEmbedding.forward",
        "convnext_layer_norm": "transformers.models.convnext.modeling_convnext:ConvNextLayerNorm.forward",
        "bart_positions": "transformers.models.bart.modeling_bart:BartLearnedPositionalEmbedding.forward",
        "bart_embedding": "transformers.models.bart.modeling_bart:BartScaledWordEmbedding.forward",
        "quick_gelu": "transformers.activations:QuickGELUActivation.forward",
    }
    found = {name: _attr(path) for name, path in paths.items()}
    return {name: fn for name, fn in found.items() if fn is not None}


def _is(fn, name: str) -> bool:
    ref = _refs().get(name)
    return ref is not None and _same_code(fn, ref)


def _code_key(fn) -> Optional[tuple]:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return None
    return (code.co_code, code.co_consts, code.co_names, code.co_varnames, code.co_argcount,
            code.co_freevars, code.co_kwonlyargcount)


def _same_code(fn, ref) -> bool:
    key = _code_key(fn)
    return key is not None and key == _code_key(ref)


def _bare(module: nn.Module, params: dict[str, int]) -> bool:
    """Exactly ``params`` (name -> rank) as direct parameters; no buffers, no children."""
    got = {n: p.dim() for n, p in module.named_parameters(recurse=False)}
    return (got == params and next(module.named_buffers(recurse=False), None) is None
            and next(module.children(), None) is None)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _forward(module: nn.Module):
    return type(module).forward


# ---- what each matched kind becomes ---------------------------------------------------------
def _to_rms_norm(module: nn.Module) -> nn.Module:
    return _to_rms_norm_eps(module, module.variance_epsilon)


def _to_gemma_rms_norm(module: nn.Module) -> nn.Module:
    module = _to_rms_norm_eps(module, module.eps)
    module.weight_offset = 1.0  # Gemma stores the scale as weight - 1
    return module


def _to_rms_norm_eps(module: nn.Module, eps) -> nn.Module:
    module.normalized_shape = (module.weight.shape[0],)
    module.eps = float(eps)
    module.elementwise_affine = True
    module.__class__ = DetRMSNorm
    return module


def _to_linear(module: nn.Module) -> nn.Module:
    module.__class__ = DetLinear
    return module


def _to_quick_gelu(module: nn.Module) -> nn.Module:
    module.__class__ = DetQuickGELU
    return module


def _to_drop_path(module: nn.Module) -> nn.Module:
    module.drop_prob = float(module.drop_prob)
    module.__class__ = DetDropPath
    return module


@functools.lru_cache(maxsize=None)
def _det_under(cls: type, det: type) -> type:
    """``class DetX(X, det)``: X's own code first, whose ``super().forward`` is then det's. An
    instance pickles as the rebuild of that pair (``torch.save(model)`` of a transformed model)."""

    def __reduce_ex__(self, protocol):
        return _rebuild_under, (cls, det), self.__getstate__()

    return type(f"Det{cls.__name__}", (cls, det),
                {"__module__": __name__, "__doc__": cls.__doc__, "__reduce_ex__": __reduce_ex__})


def _rebuild_under(cls: type, det: type) -> nn.Module:
    """An empty instance of ``_det_under(cls, det)`` for unpickling (its state comes next)."""
    wrapped = _det_under(cls, det)
    return wrapped.__new__(wrapped)


def _wrapper_factory(base: type, det: type) -> Callable[[nn.Module], nn.Module]:
    def factory(module: nn.Module) -> nn.Module:
        if det is DetEmbedding:
            _check_options(module)  # raises with the reason and the fix
        module.__class__ = _det_under(type(module), det)
        return module

    return factory


# the wrappers (module docstring): reference forward -> (covered base, its Det class)
_WRAPPERS = {"opt_positions": (nn.Embedding, DetEmbedding), "gemma_embedding": (nn.Embedding, DetEmbedding),
             "bart_positions": (nn.Embedding, DetEmbedding), "bart_embedding": (nn.Embedding, DetEmbedding),
             "convnext_layer_norm": (nn.LayerNorm, DetLayerNorm)}


def _to_gelu(approximate: str) -> Callable[[nn.Module], nn.Module]:
    def factory(module: nn.Module) -> nn.Module:
        module.approximate = approximate
        module.__class__ = DetGELU
        return module

    return factory


def _to_silu(module: nn.Module) -> nn.Module:
    module.inplace = False
    module.__class__ = DetSiLU
    return module


def _gelu_act_kind(act) -> Optional[str]:
    """The GELU that a GELUActivation/GELUTanh's ``act`` attribute computes, or None."""
    if act is F.gelu:
        return "none"
    if isinstance(act, functools.partial) and act.func is F.gelu and not act.args and act.keywords == {"approximate": "tanh"}:
        return "tanh"
    if _is(act, "gelu_python"):
        return "none"
    if _is(act, "gelu_tanh_python"):
        return "tanh"
    return None


def match_lookalike(module: nn.Module) -> Optional[Callable[[nn.Module], nn.Module]]:
    """The factory turning ``module`` into its Det version when it matches a rule above, else None."""
    fwd = _forward(module)
    if _is(fwd, "conv1d"):
        ok = (_bare(module, {"weight": 2, "bias": 1}) and tuple(module.weight.shape) == (module.nx, module.nf)
              and tuple(module.bias.shape) == (module.nf,))
        return conv1d_to_det if ok else None
    if _is(fwd, "llama_rms") or _is(fwd, "t5_rms"):
        ok = _bare(module, {"weight": 1}) and _number(getattr(module, "variance_epsilon", None))
        return _to_rms_norm if ok else None
    if _is(fwd, "gemma_rms") and _is(getattr(type(module), "_norm", None), "gemma_rms_norm"):
        ok = _bare(module, {"weight": 1}) and _number(getattr(module, "eps", None))
        return _to_gemma_rms_norm if ok else None
    if _is(fwd, "falcon_linear"):
        ok = isinstance(module, nn.Linear) and _bare(module, {"weight": 2, "bias": 1} if module.bias is not None
                                                     else {"weight": 2})
        return _to_linear if ok else None
    for name, (base, det) in _WRAPPERS.items():
        if _is(fwd, name):
            params = {n for n, _ in module.named_parameters(recurse=False)}
            ok = isinstance(module, base) and params <= {"weight", "bias"} and next(module.children(), None) is None
            return _wrapper_factory(base, det) if ok else None
    if not _bare(module, {}):
        return None
    if _is(fwd, "drop_path"):
        return _to_drop_path if _number(getattr(module, "drop_prob", None)) else None
    if _is(fwd, "silu"):
        return _to_silu
    if _is(fwd, "quick_gelu"):
        return _to_quick_gelu
    if _is(fwd, "new_gelu"):
        return _to_gelu("tanh")
    if _is(fwd, "act_attr"):
        kind = _gelu_act_kind(getattr(module, "act", None))
        return None if kind is None else _to_gelu(kind)
    return None
