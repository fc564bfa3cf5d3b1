"""Data-parallel building blocks shared by the Lightning and Fabric strategies (no Lightning import).

- :func:`sync_gradients`: one exact digit all-reduce of every gradient, rounded once into .grad.
- :func:`global_mean`, :func:`global_sum`: losses whose value and gradient do not depend on how the
  batch was split.
- :func:`exact_reduce`: world-size invariant reduction of logged values.
- :func:`apply_strict_environment`: the settings the contract needs, applied before CUDA starts.
- :class:`OpAudit`: records the aten ops of a training step and checks them against the verified set.
"""
from .audit import OpAudit, UnverifiedOpError, VERIFIED_FUNCTIONS, VERIFIED_OPS, trusted
from .env import apply_strict_environment
from .grad_sync import grad_scale_exp, sync_gradients
from .loss import global_mean, global_sum
from .reduce import exact_reduce

__all__ = [
    "sync_gradients",
    "grad_scale_exp",
    "global_mean",
    "global_sum",
    "exact_reduce",
    "apply_strict_environment",
    "OpAudit",
    "UnverifiedOpError",
    "VERIFIED_OPS",
    "VERIFIED_FUNCTIONS",
    "trusted",
]
