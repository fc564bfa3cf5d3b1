"""A CheckpointIO whose saves survive a crash and whose loads say what is wrong with a file.

Lightning's ``TorchCheckpointIO`` serializes to memory and then writes the target path in
place, so a process killed during the write leaves a truncated file under the checkpoint's
name, and that file replaced the previous checkpoint of the same name. Here the bytes go to a
temp file in the same folder, are fsynced, and replace the target by rename.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..digest.atomic import atomic_write
from ..digest.container import read_checkpoint

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` through a temp file, fsync and rename; ``torch.load`` with clear errors.

    Local paths only (a URL such as ``s3://`` is refused with the reason): atomic rename is a
    property of a local file system. A truncated or foreign file raises
    :class:`lightning_det.digest.container.CheckpointFileError` naming the file.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint: storage_options are not supported, got "
                            f"{storage_options!r}")
        atomic_write(self._local(path), lambda f: torch.save(checkpoint, f), self.before_rename)

    def load_checkpoint(self, path, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        return read_checkpoint(self._local(path), map_location, weights_only)

    def before_rename(self, temp: Path) -> None:
        """Called with the complete, synced temp file just before it replaces the target."""

    @staticmethod
    def _local(path) -> Path:
        text = os.fspath(path)
        if "://" in str(text):
            raise ValueError(f"AtomicCheckpointIO: path must be a local file, got {text!r}; use Lightning's "
                             "TorchCheckpointIO for remote storage")
        return Path(text)
