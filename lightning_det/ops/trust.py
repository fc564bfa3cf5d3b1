"""Trusted regions: ops that run inside an exact det op or module, skipped by the op audit.

Lives in the ops layer so that nn/ and optim/ can mark their internals without importing the
audit (which sits above them).
"""
from __future__ import annotations

import contextlib
import contextvars

__all__ = ["trusted", "in_trusted"]

_TRUSTED = contextvars.ContextVar("ldet_trusted", default=0)


@contextlib.contextmanager
def trusted():
    """Marks a region whose ops belong to an exact det op or module."""
    tok = _TRUSTED.set(_TRUSTED.get() + 1)
    try:
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
