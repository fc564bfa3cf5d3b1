"""Tensor digests: content- and order-sensitive hashes computed on the tensor's own device.

The definition lives in :mod:`lightning_det.digest.reference` (pure Python) and
``csrc/hash.h`` (CPU and CUDA). This layer never imports Lightning.
"""
from .core import PendingDigests, digest_many, digest_many_async, dtype_name, hash_object, tensor_digest
from .reference import FORMAT

__all__ = ["FORMAT", "dtype_name", "tensor_digest", "digest_many", "digest_many_async", "PendingDigests",
           "hash_object"]
