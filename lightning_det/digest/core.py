"""Device-side tensor digests over the compiled ``ldet::digest_chunks`` op."""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import torch

from .. import _build
from ..ops.digest import CHUNK_BYTES, digest_chunks_many
from .reference import digest_from_chunks

__all__ = ["dtype_name", "tensor_digest", "digest_many", "digest_many_async", "PendingDigests", "hash_object"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the name that enters the digest."""
    return str(dtype).replace("torch.", "")


def _prepare(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"digest: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"digest: only dense (strided) tensors are supported, got layout {t.layout}")
    # Digest the values the tensor shows, not a lazily conjugated/negated view of other bytes.
    # Each step only where needed: a step's digests take hundreds of tensors, on the host.
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


class PendingDigests:
    """Digests whose chunk hashes are still on their way from the device.

    Created by :func:`digest_many_async`: the chunk-hash kernels and a non-blocking copy into
    pinned host memory are queued on the current CUDA stream, so the caller does not wait for
    the GPU. :meth:`result` waits for that copy only, then finishes the SHA-256 on the host.
    """

    def __init__(self, meta: list, parts: list) -> None:
        self._meta = meta  # (dtype name, shape, nbytes) per tensor
        self._parts = parts  # (indices, sizes, host int64 tensor, cuda event or None) per device
        self._result: list[str] | None = None

    def ready(self) -> bool:
        return self._result is not None or all(ev is None or ev.query() for _, _, _, ev in self._parts)

    def result(self) -> list[str]:
        if self._result is None:
            chunks: list = [b""] * len(self._meta)
            for idx, sizes, host, ev in self._parts:
                if ev is not None:
                    ev.synchronize()
                flat = host.numpy().tobytes()  # int64 little-endian == the uint64 chunk words
                off = 0
                for i, n in zip(idx, sizes):
                    chunks[i] = flat[off * 8: (off + n) * 8]
                    off += n
            self._result = [digest_from_chunks(d, s, n, c) for (d, s, n), c in zip(self._meta, chunks)]
            self._parts = []
        return self._result


def digest_many_async(tensors: Sequence[torch.Tensor]) -> PendingDigests:
    """Start the digests of several tensors without waiting for their devices.

    Each tensor is hashed on its own device, all of a device's tensors in one pass; per device,
    the short chunk-hash lists (8 bytes per 16 KiB) are copied to pinned host memory
    asynchronously. Call
    ``.result()`` for the hex digests. Tensors may be modified after this returns only in
    stream order (as the optimizer's next step is), since the kernels read them later.
    """
    tensors = list(tensors)
    if not tensors:
        return PendingDigests([], [])
    _build.load()
    prepared = [_prepare(t) for t in tensors]
    if any(t.is_cuda for t in prepared) and not _build.cuda_built():
        raise _build.ExtensionError(
            "digest: a tensor is on CUDA but lightning_det's core was built without its CUDA kernels "
            "(no nvcc found, or LIGHTNING_DET_NO_CUDA=1). Install the CUDA toolkit matching torch "
            f"{torch.version.cuda}, unset LIGHTNING_DET_NO_CUDA and delete the build folder to rebuild. "
            "Copying the tensor to the CPU instead would give the same digest, but a whole GPU tensor is "
            "deliberately never copied to the host."
        )
    meta = [(dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for t in prepared]
    by_dev: dict = {}
    for i, t in enumerate(prepared):
        by_dev.setdefault(t.device, []).append(i)
    parts = []
    for dev, idx in by_dev.items():
        sizes = [-(-meta[i][2] // CHUNK_BYTES) for i in idx]
        # one pass (one launch on CUDA) over every tensor of the device
        flat = digest_chunks_many([prepared[i] for i in idx])
        if dev.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            parts.append((idx, sizes, host, ev))
        else:
            parts.append((idx, sizes, flat.cpu(), None))
    return PendingDigests(meta, parts)


def digest_many(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Digests of several tensors, with one device-to-host copy per device.

    The chunk hashes are computed on each tensor's device; only the short per-chunk lists
    (8 bytes per 16 KiB of data) travel to the host, where SHA-256 binds them to dtype and shape.
    """
    return digest_many_async(tensors).result()


def tensor_digest(t: torch.Tensor) -> str:
    """The ``ldet-digest-v1`` digest (64 hex chars) of one tensor: content, order, dtype, shape.

    Equal for equal bytes on any device (CPU and CUDA share ``csrc/hash.h``); a single changed
    word always changes it; swapping elements, reshaping or reinterpreting the dtype changes it.
    """
    return digest_many([t])[0]


def hash_object(obj) -> str:
    """SHA-256 of a JSON-able host object (RNG states, hyper-parameters), canonically encoded."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()

