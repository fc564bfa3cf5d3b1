"""Device-side tensor digests over the compiled ``ldet::digest_chunks`` op."""
from __future__ import annotations

import hashlib
import json
from typing import Iterable, Sequence

import torch

from .. import _build
from .reference import CHUNK_BYTES, digest_from_chunks

__all__ = ["dtype_name", "tensor_digest", "digest_many", "hash_object"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the name that enters the digest."""
    return str(dtype).replace("torch.", "")


def _register_fake() -> None:
    @torch.library.register_fake("ldet::digest_chunks")
    def _(self):  # noqa: ANN001 - torch.library signature
        nbytes = self.numel() * self.element_size()
        return self.new_empty(((nbytes + CHUNK_BYTES - 1) // CHUNK_BYTES,), dtype=torch.long)


_build.on_load(_register_fake)


def _prepare(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"digest: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"digest: only dense (strided) tensors are supported, got layout {t.layout}")
    # Digest the values the tensor shows, not a lazily conjugated/negated view of other bytes.
    t = t.detach().resolve_conj().resolve_neg()
    return t.contiguous()


def digest_many(tensors: Sequence[torch.Tensor]) -> list[str]:
    """Digests of several tensors, with one device-to-host copy per device.

    The chunk hashes are computed on each tensor's device; only the short per-chunk lists
    (8 bytes per 16 KiB of data) travel to the host, where SHA-256 binds them to dtype and shape.
    """
    tensors = list(tensors)
    if not tensors:
        return []
    _build.load()
    prepared = [_prepare(t) for t in tensors]
    chunks = [torch.ops.ldet.digest_chunks(t) for t in prepared]
    # Group by device so each device syncs once.
    host: list = [None] * len(chunks)
    by_dev: dict = {}
    for i, c in enumerate(chunks):
        by_dev.setdefault(c.device, []).append(i)
    for dev, idx in by_dev.items():
        sizes = [chunks[i].numel() for i in idx]
        flat = torch.cat([chunks[i] for i in idx]) if len(idx) > 1 else chunks[idx[0]]
        flat = flat.cpu().numpy().tobytes()  # int64 little-endian == the uint64 chunk words
        off = 0
        for i, n in zip(idx, sizes):
            host[i] = flat[off * 8 : (off + n) * 8]
            off += n
    out = []
    for t, c in zip(prepared, host):
        out.append(digest_from_chunks(dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size(), c))
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """The ``ldet-digest-v1`` digest (64 hex chars) of one tensor: content, order, dtype, shape.

    Equal for equal bytes on any device (CPU and CUDA share ``csrc/hash.h``); a single changed
    word always changes it; swapping elements, reshaping or reinterpreting the dtype changes it.
    """
    return digest_many([t])[0]


def hash_object(obj) -> str:
    """SHA-256 of a JSON-able host object (RNG states, hyper-parameters), canonically encoded."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=repr).encode()).hexdigest()


def iter_named_tensors(obj, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """Walk nested dicts/lists/tuples in order, yielding ``("a/b/0", tensor)`` pairs."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_named_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_named_tensors(v, f"{prefix}/{i}" if prefix else str(i))
