"""In-place class swap used by every Det module's ``from_*`` constructor."""
from __future__ import annotations

from torch import nn


def swap_class(module: nn.Module, base: type, cls: type, arg: str) -> nn.Module:
    """Turns ``module`` (an instance of ``base``) into ``cls`` in place, keeping its Parameter
    objects, buffers and hooks, so state_dict keys and optimizer references stay valid."""
    if not isinstance(module, base):
        raise TypeError(f"{arg}: expected an nn.{base.__name__}, got {type(module).__name__}")
    module.__class__ = cls
    return module
