"""Exact modules (no Lightning import): DetLinear and friends, det_transform, and the
digit-gradient hook for det_ddp."""
from .activation import DetGELU, DetReLU, DetSiLU, DetTanh
from .conv1d import DetConv1D
from .attention import DetMultiheadSelfAttention, det_function_mode, det_scaled_dot_product_attention
from .embedding import DetEmbedding
from .functional import det_col_sums, det_exp, det_gelu, det_relu, det_row_sums, det_silu, det_tanh
from .grad_digits import add_grad_digits, finalize_grad_digits, grad_digits, set_grad_digits
from .linear import DetLinear
from .loss import det_cross_entropy
from .norm import DetLayerNorm, DetRMSNorm
from .transform import DET_MODULES, UnsupportedModuleError, det_transform, register_det_module
from .verified import VERIFIED_FUNCTIONS, VERIFIED_MODULES

__all__ = [
    "DetLinear",
    "DetConv1D",
    "DetEmbedding",
    "DetLayerNorm",
    "DetRMSNorm",
    "DetGELU",
    "DetSiLU",
    "DetTanh",
    "DetReLU",
    "DetMultiheadSelfAttention",
    "det_scaled_dot_product_attention",
    "det_function_mode",
    "det_cross_entropy",
    "det_exp",
    "det_gelu",
    "det_silu",
    "det_tanh",
    "det_relu",
    "det_row_sums",
    "det_col_sums",
    "det_transform",
    "register_det_module",
    "UnsupportedModuleError",
    "DET_MODULES",
    "VERIFIED_MODULES",
    "VERIFIED_FUNCTIONS",
    "set_grad_digits",
    "add_grad_digits",
    "grad_digits",
    "finalize_grad_digits",
]
