"""Crash-safe file writes: a temp file in the target's folder, fsync, rename, fsync the folder.

A process killed at any point leaves either the previous file or the complete new one under
the target name, never a partial one (POSIX ``rename`` replaces atomically within a file
system). A killed write can leave its temp file (``.NAME.tmp-PID``) behind; it is never read.
No Lightning import.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, BinaryIO

__all__ = ["atomic_write", "fsync_dir", "temp_path"]


def temp_path(path: str | os.PathLike) -> Path:
    """Where :func:`atomic_write` writes ``path``'s bytes before the rename (same folder)."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename or creation in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself is still atomic
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None],
                 before_rename: Callable[[Path], None] | None = None) -> None:
    """Write ``path`` through ``write(f)`` so that a crash never leaves a partial file there.

    ``before_rename(temp)`` runs after the temp file is complete and synced, just before the
    rename: the point where a crash shows that the previous file survives (fault injection).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
