"""Integer arguments shared by every layer: Python and NumPy integers are accepted alike."""
from __future__ import annotations

import operator
from typing import Any, Optional

__all__ = ["as_index"]


def as_index(value: Any) -> Optional[int]:
    """``value`` as a Python int if it is an integer, else None (the caller words the error).

    Anything that implements ``__index__`` (int, ``numpy.int64``, ...) is an integer; bool and
    floats, integral-valued ones included, are not, so ``seed=1.5`` is refused rather than
    truncated.
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
