"""Registers ``det_ddp`` with Lightning's strategy registries without importing Lightning.

``import lightning_det`` must keep ``Trainer(strategy="det_ddp")`` and
``Fabric(strategy="det_ddp")`` working, whether Lightning was imported before or after it, and
must not load Lightning itself (the ops, nn and optim layers serve plain PyTorch users).
Lightning has no entry point for external strategies (its entry points cover callbacks only),
so:

- if ``lightning`` is already imported, the strategies are registered at once;
- otherwise a finder on ``sys.meta_path`` waits for the ``lightning`` package to be imported,
  lets Python's own finder and loader import it, and registers right after the package has
  executed. ``lightning/__init__`` imports both ``lightning.fabric`` and ``lightning.pytorch``,
  so both registries exist by then, and nothing can reach them before. The finder then
  removes itself and puts the original loader back on the module.
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys

__all__ = ["register_when_imported"]

_PACKAGE = "lightning"
_STRATEGY = "lightning_det.strategy"


def _register() -> None:
    # Importing the strategy package registers det_ddp. When that package's own import is what
    # imported Lightning, it is in sys.modules already and registers as its import finishes.
    if _STRATEGY not in sys.modules:
        importlib.import_module(_STRATEGY)


class _Loader(importlib.abc.Loader):
    """Python's own loader of ``lightning``, followed by the registration."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # The module's spec and __loader__ show the original loader again (for importlib.resources,
        # pkgutil and reloads), before anything runs.
        module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        _register()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``lightning`` with the finders after it and wraps their loader in :class:`_Loader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _PACKAGE:
            return None
        sys.meta_path.remove(self)  # one import of lightning; also keeps the search below from finding us
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            raise ImportError(
                f"lightning_det: cannot register det_ddp with Lightning: the loader of {fullname!r} "
                f"({type(spec.loader).__name__}) has no exec_module"
            )
        spec.loader = _Loader(spec.loader)
        return spec


def register_when_imported() -> None:
    """Registers det_ddp with Lightning now if it is imported, else as soon as it is."""
    if sys.modules.get(_PACKAGE) is not None:  # None: an import of it is blocked
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
