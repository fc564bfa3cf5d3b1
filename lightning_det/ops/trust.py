"""Trusted regions: ops that run inside an exact det op or module, skipped by the op audit.

Lives in the ops layer so that nn/ and optim/ can mark their internals without importing the
audit (which sits above them).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["trusted", "in_trusted"]

_TRUSTED = contextvars.ContextVar("ldet_trusted", default=0)


def _redirect_mode_on_top():
    """The torch function mode on top of the stack if it is a det redirect mode, else None."""
    n = torch._C._len_torch_function_stack()
    if n == 0:
        return None
    mode = torch._C._get_function_stack_at(n - 1)
    return mode if getattr(mode, "ldet_redirect_mode", False) else None


@contextlib.contextmanager
def trusted():
    """Marks a region whose ops belong to an exact det op or module.

    A det redirect mode (``det_function_mode``, marked ``ldet_redirect_mode``) on top of the torch
    function mode stack is set aside inside the region: a det op's internals call nothing it
    redirects, and every torch call through a Python mode costs host time (~300 calls a det_ddp
    step, which is bound by its host time). Other modes stay.
    """
    tok = _TRUSTED.set(_TRUSTED.get() + 1)
    try:
        if _redirect_mode_on_top() is None:
            yield
        else:
            with torch.overrides._pop_mode_temporarily():
                yield
    finally:
        _TRUSTED.reset(tok)


def in_trusted() -> bool:
    return _TRUSTED.get() > 0


def trusted_fn(fn):
    """Decorator form of :func:`trusted` (for autograd.Function forward/backward)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with trusted():
            return fn(*args, **kwargs)

    return wrapper
