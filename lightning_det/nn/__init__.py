"""Exact modules (no Lightning import): DetLinear, and the digit-gradient hook for det_ddp."""
from .grad_digits import add_grad_digits, finalize_grad_digits, grad_digits, set_grad_digits
from .linear import DetLinear

__all__ = ["DetLinear", "set_grad_digits", "add_grad_digits", "grad_digits", "finalize_grad_digits"]
