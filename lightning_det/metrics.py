"""torchmetrics metrics whose synced value does not depend on the world size.

A stock ``MeanMetric`` keeps a per-rank fp32 running sum, already rounded, and sums the ranks'
states in rank order: the result changes with the world size. These metrics keep their state
as long-accumulator digits (int64, summed exactly by torchmetrics' own ``dist_reduce_fx="sum"``)
and round once in ``compute``.
"""
from __future__ import annotations

import torch
from torchmetrics import Metric

from .ops import det_combine, det_finalize, det_normalize, to_digits
from .ops.exact_scalar import mean_of_acc
from .profile import WORDS

__all__ = ["DetSumMetric", "DetMeanMetric"]


class DetSumMetric(Metric):
    """Exact sum of every value passed to ``update`` on every rank, rounded once (fp32)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("digits", default=torch.zeros(WORDS, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor) -> None:
        value = torch.as_tensor(value, dtype=torch.float32, device=self.digits.device).reshape(-1)
        # det_combine keeps every headroom bound, for any number of values (longacc.h)
        self.digits = det_combine([self.digits, *to_digits(value).unbind(0)])
        self.count += value.numel()

    def compute(self) -> torch.Tensor:
        return det_finalize(det_normalize(self.digits.unsqueeze(0)))[0]


class DetMeanMetric(DetSumMetric):
    """Exact mean over every value on every rank: exact sum / count, rounded once (fp32)."""

    def compute(self) -> torch.Tensor:
        total = det_normalize(self.digits.unsqueeze(0))[0].tolist()
        n = int(self.count)
        if n == 0:
            return torch.tensor(float("nan"))
        return torch.tensor(mean_of_acc(total, n), dtype=torch.float32)
