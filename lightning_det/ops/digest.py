"""The chunk hashes behind tensor digests (``ldet::digest_chunks``, csrc/hash.h).

:mod:`lightning_det.digest` turns them into the ``ldet-digest-v1`` string; its ``reference``
module defines the format in pure Python over the same chunks.
"""
from __future__ import annotations

import torch

from ._registry import ldet

__all__ = ["CHUNK_BYTES", "digest_chunks", "digest_chunks_many"]

#: Bytes per chunk hash (2048 little-endian uint64 words), fixed by csrc/hash.h.
CHUNK_BYTES = 16384


def digest_chunks(t: torch.Tensor) -> torch.Tensor:
    """The int64 chunk hashes (ceil(nbytes / CHUNK_BYTES),) of a contiguous tensor's bytes, computed
    on its device."""
    return ldet().digest_chunks(t)


def digest_chunks_many(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The chunk hashes of several contiguous tensors on one device, concatenated in list order:
    ``torch.cat([digest_chunks(t) for t in tensors])``, in one launch on CUDA."""
    if not tensors:
        raise ValueError("tensors: expected at least one tensor, got an empty list")
    return ldet().digest_chunks_many(list(tensors))
