"""DetLinear: nn.Linear whose forward and backward are exact long-accumulator GEMMs."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ._swap import swap_class

from ..ops import det_linear
from .step_state import StepState

__all__ = ["DetLinear"]


class DetLinear(nn.Linear):
    """``nn.Linear`` with exact, batch- and split-invariant arithmetic.

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear`` (same parameters,
            same ``state_dict`` keys, so checkpoints move freely between the two).

    Shapes: input (..., in_features) of float32/bfloat16/float16; output (..., out_features)
    of the input's dtype. Forward is ``x @ W.T + b`` with the bias added inside the long
    accumulator and a single rounding (:func:`lightning_det.ops.det_linear`). Backward: dX exact
    and rounded once; dW and db exact sums over every leading (batch) dimension, rounded once,
    or, bound to a step state (``step_state``, see :mod:`lightning_det.nn.grad_digits`), left
    unrounded for the step's owner to reduce and round.
    """

    supports_grad_digits = True
    step_state: Optional[StepState] = None  # set by set_grad_digits

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DetLinear":
        """Turns an ``nn.Linear`` into a DetLinear in place, keeping its Parameter objects."""
        return swap_class(linear, nn.Linear, cls, "linear")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.shape[-1] != self.in_features:
            raise ValueError(
                f"input: expected last dimension in_features={self.in_features}, got shape {tuple(input.shape)}"
            )
        state = self.step_state
        if state is None:
            return det_linear(input, self.weight, self.bias)
        return det_linear(input, self.weight, self.bias, grad_sink=state, plans=state.plans)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, exact=True"
