"""Lightning's chosen precision plugin, with exact gradient-norm clipping.

Trainer-side clipping (``gradient_clip_val``, ``LightningModule.clip_gradients``) ends in the
precision plugin's public ``clip_grad_by_norm``; the Trainer's Strategy has no clipping hook of
its own, and ``LightningModule.configure_gradient_clipping`` belongs to the user. The plugin
depends on ``precision=`` (``Precision``, ``MixedPrecision``, ``HalfPrecision``, ...), so
:func:`exact_norm_clipping` derives a subclass of whichever class Lightning picked, overriding
``clip_grad_by_norm`` only: mixed precision still unscales before it clips.
"""
from __future__ import annotations

import functools
from typing import Union

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from ..optim.clip import clip_grad_norm_exact_

__all__ = ["exact_norm_clipping"]


class ExactNormClipping(Precision):
    """Clips by the exact global 2-norm (:func:`lightning_det.optim.clip_grad_norm_exact_`)."""

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        clip_grad_norm_exact_(params, float(clip_val))

    @override
    def __reduce__(self):
        # The derived classes are made at run time; pickles (det_ddp_spawn sends the Trainer to
        # its processes) name the plugin's own class and rebuild the derived one from it.
        return _rebuild, (type(self).__bases__[1], self.__dict__)


@functools.lru_cache(maxsize=None)
def _exact_class(cls: type) -> type:
    return type(f"Exact{cls.__name__}", (ExactNormClipping, cls), {"__module__": __name__})


def _rebuild(cls: type, state: dict) -> Precision:
    exact = object.__new__(_exact_class(cls))
    exact.__dict__.update(state)
    return exact


def exact_norm_clipping(plugin: Precision) -> Precision:
    """``plugin`` as an instance of its class with exact norm clipping mixed in (same state)."""
    if not isinstance(plugin, Precision):
        raise TypeError(f"plugin: expected a lightning.pytorch Precision plugin, got {type(plugin).__name__}")
    if isinstance(plugin, ExactNormClipping):
        return plugin
    return _rebuild(type(plugin), plugin.__dict__)
