"""Optimizer kernels: the fused AdamW step with stochastic rounding (``ldet::adamw_sr_step``) and
the stochastic fp32 -> bf16 rounding alone (``ldet::sr_round_bf16``), csrc/adamw_sr.h.

:mod:`lightning_det.optim.adamw_sr` validates hyper-parameters and state and derives the host
scalars; these wrappers pass them through unchanged. Seeds are the kernel's int64
reinterpretation of a uint64 seed. The kernels check tensor shapes, dtypes and devices
(csrc/adamw_sr_checks.h).
"""
from __future__ import annotations

import torch

from ._registry import ldet

__all__ = ["adamw_sr_step", "sr_round_bf16"]


def adamw_sr_step(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    decay: float, beta1: float, one_minus_beta1: float, beta2: float, one_minus_beta2: float,
    step_size: float, bias_correction2_sqrt: float, eps: float, seed: int, step: int, base_index: int,
) -> None:
    """Updates ``param``, ``exp_avg`` and ``exp_avg_sq`` in place; element i of param draws its
    rounding from Philox(seed, step, base_index + i)."""
    ldet().adamw_sr_step(param, grad, exp_avg, exp_avg_sq, decay, beta1, one_minus_beta1, beta2,
                         one_minus_beta2, step_size, bias_correction2_sqrt, eps, seed, step, base_index)


def sr_round_bf16(x: torch.Tensor, seed: int, step: int, base_index: int) -> torch.Tensor:
    """fp32 x -> bf16 with the AdamWSR stochastic rounding (element i: Philox(seed, step, base_index + i))."""
    return ldet().sr_round_bf16(x, seed, step, base_index)
