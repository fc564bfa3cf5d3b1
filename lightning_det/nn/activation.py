"""Det activations: elementwise, position- and batch-invariant, identical on CPU and CUDA.

Each is a subclass of the PyTorch module it replaces (same constructor arguments, no
parameters) whose forward calls the kernels of :mod:`lightning_det.nn.functional`.
Shapes: any; float32/bfloat16/float16 in, same shape and dtype out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .functional import det_gelu, det_sigmoid, det_silu, det_tanh

__all__ = ["DetGELU", "DetSiLU", "DetTanh", "DetSigmoid", "DetReLU", "DetHardtanh", "DetQuickGELU"]


class DetGELU(nn.GELU):
    """``nn.GELU(approximate="none"|"tanh")`` computed by ``csrc/detmath.h`` (fp64, one rounding)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return det_gelu(input, self.approximate)


class DetSiLU(nn.SiLU):
    """``nn.SiLU`` computed by ``csrc/detmath.h``. ``inplace=True`` is honoured by copying back."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = det_silu(input)
        return input.copy_(y) if self.inplace and not torch.is_grad_enabled() else y


class DetTanh(nn.Tanh):
    """``nn.Tanh`` computed by ``csrc/detmath.h``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return det_tanh(input)


class DetSigmoid(nn.Sigmoid):
    """``nn.Sigmoid`` computed by ``csrc/detmath.h``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return det_sigmoid(input)


class DetQuickGELU(nn.Module):
    """Hugging Face's ``QuickGELUActivation`` (CLIP): ``x * sigmoid(1.702 * x)``, with its two
    multiplies as they are (one IEEE rounding each) and :func:`det_sigmoid` for the sigmoid."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input * det_sigmoid(1.702 * input)


class DetReLU(nn.ReLU):
    """``nn.ReLU``. PyTorch's relu is a select (exact, position-invariant); this marks it verified."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.relu(input, inplace=self.inplace)


class DetHardtanh(nn.Hardtanh):
    """``nn.Hardtanh`` (and ``nn.ReLU6``, its subclass, MobileNet's activation): a clamp, exact and
    position-invariant as PyTorch computes it; this marks it verified."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.hardtanh(input, self.min_val, self.max_val, self.inplace)
