"""Data-order tools: a world-size invariant, resumable sampler."""
from .sampler import DeterministicSampler

__all__ = ["DeterministicSampler"]
