"""Optimizers and gradient utilities with deterministic arithmetic (no Lightning import)."""
from .adamw_sr import AdamWSR, stochastic_round_bf16
from .clip import clip_grad_norm_exact_, grad_norm_exact

__all__ = ["AdamWSR", "stochastic_round_bf16", "clip_grad_norm_exact_", "grad_norm_exact"]
