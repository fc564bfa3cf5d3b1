"""Pure-Python reference of the tensor digest (format ``ldet-digest-v1``).

This file is the definition; ``csrc/hash.h`` must compute the same chunk hashes and
``lightning_det.digest.tensor_digest`` the same final string. Tests compare the two. It is
slow (pure Python integers) and meant for tests and for reading, not for training runs.

Definition:
  * bytes: the tensor's row-major contiguous bytes (``nbytes = numel * element_size``);
  * words: little-endian uint64 words, the last one zero-padded;
  * chunk hash: ``h_c = sum(mix(w_i, i) for i in chunk c) mod 2**64`` with 2048 words (16 KiB)
    per chunk and ``i`` the global word index, ``mix(w, i) = fmix64(w ^ ((i + 1) * GOLDEN mod 2**64))``;
  * digest: SHA-256 over a header naming the format, dtype, shape and byte count, followed by
    the chunk hashes as little-endian uint64, as lowercase hex.
"""
from __future__ import annotations

import hashlib

from ..ops.digest import CHUNK_BYTES

FORMAT = "ldet-digest-v1"
CHUNK_WORDS = CHUNK_BYTES // 8
GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1

__all__ = ["FORMAT", "CHUNK_BYTES", "fmix64", "hash_word", "chunk_hashes", "digest_bytes", "header"]


def fmix64(x: int) -> int:
    """SplitMix64 finalizer on a 64-bit integer (a bijection)."""
    x &= MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    x ^= x >> 31
    return x


def hash_word(word: int, index: int) -> int:
    """The per-word mix of a word's value and its global index."""
    return fmix64(word ^ (((index + 1) * GOLDEN) & MASK))


def chunk_hashes(data: bytes) -> list[int]:
    """Per-16KiB-chunk hashes of ``data`` (unsigned 64-bit integers)."""
    n = len(data)
    nwords = (n + 7) // 8
    padded = bytes(data) + b"\0" * (nwords * 8 - n)
    out = []
    for c in range(0, nwords, CHUNK_WORDS):
        acc = 0
        for i in range(c, min(c + CHUNK_WORDS, nwords)):
            acc += hash_word(int.from_bytes(padded[8 * i : 8 * i + 8], "little"), i)
        out.append(acc & MASK)
    return out


def header(dtype_name: str, shape, nbytes: int) -> bytes:
    """The bytes that bind a digest to its dtype, shape and byte count."""
    dims = ",".join(str(int(d)) for d in shape)
    return f"{FORMAT}\ndtype={dtype_name}\nshape=[{dims}]\nnbytes={int(nbytes)}\n".encode()


def digest_from_chunks(dtype_name: str, shape, nbytes: int, chunks_le: bytes) -> str:
    """Final SHA-256 given the chunk hashes already packed as little-endian uint64 bytes."""
    h = hashlib.sha256(header(dtype_name, shape, nbytes))
    h.update(chunks_le)
    return h.hexdigest()


def digest_bytes(data: bytes, dtype_name: str, shape) -> str:
    """The digest of a tensor given its raw bytes, dtype name (e.g. ``"float32"``) and shape."""
    chunks = b"".join(h.to_bytes(8, "little") for h in chunk_hashes(data))
    return digest_from_chunks(dtype_name, shape, len(data), chunks)
