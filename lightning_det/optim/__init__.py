"""Optimizers with deterministic arithmetic (no Lightning import)."""
from .adamw_sr import AdamWSR, stochastic_round_bf16

__all__ = ["AdamWSR", "stochastic_round_bf16"]
