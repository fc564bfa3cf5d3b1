"""Exact modules (no Lightning import): DetLinear and friends, det_transform, det_function_mode,
and the step state that carries a training step's gradient digits between the layers."""
from .activation import DetGELU, DetHardtanh, DetQuickGELU, DetReLU, DetSigmoid, DetSiLU, DetTanh
from .batch_norm import DetBatchNorm1d, DetBatchNorm2d
from .conv import DetConv1d, DetConv2d, det_conv1d, det_conv2d
from .group_norm import DetGroupNorm
from .pool import DetAdaptiveAvgPool1d, DetAdaptiveAvgPool2d, DetMaxPool2d
from .attention import DetMultiheadSelfAttention, det_scaled_dot_product_attention
from .broadcast_grads import BroadcastGradError
from .conv1d import DetConv1D
from .dropout import DetDropout, DetDropPath
from .embedding import DetEmbedding
from .functional import (det_col_sums, det_cos, det_exp, det_gelu, det_relu, det_row_sums, det_sigmoid, det_silu,
                         det_sin, det_tanh)
from .function_mode import det_function_mode
from .grad_digits import finalize_grad_digits, set_grad_digits
from .linear import DetLinear
from .loss import det_cross_entropy
from .matmul import det_matmul, det_softmax
from .mha import DetMultiheadAttention, DetTransformerDecoderLayer, DetTransformerEncoder, DetTransformerEncoderLayer
from .norm import DetLayerNorm, DetRMSNorm
from .step_state import BatchPosition, StepState, StepStateMode, current_step_state
from .transform import DET_MODULES, UnsupportedModuleError, det_transform, register_det_module
from .verified import VERIFIED_FUNCTIONS, VERIFIED_MODULES

__all__ = [
    "DetLinear",
    "DetConv1D",
    "DetEmbedding",
    "DetLayerNorm",
    "DetRMSNorm",
    "DetGELU",
    "DetHardtanh",
    "DetQuickGELU",
    "DetSigmoid",
    "DetSiLU",
    "DetTanh",
    "DetReLU",
    "DetConv1d",
    "DetConv2d",
    "det_conv1d",
    "det_conv2d",
    "DetBatchNorm1d",
    "DetBatchNorm2d",
    "DetGroupNorm",
    "DetAdaptiveAvgPool1d",
    "DetAdaptiveAvgPool2d",
    "DetMaxPool2d",
    "DetDropout",
    "DetDropPath",
    "DetMultiheadSelfAttention",
    "DetMultiheadAttention",
    "DetTransformerEncoderLayer",
    "DetTransformerEncoder",
    "DetTransformerDecoderLayer",
    "det_matmul",
    "det_softmax",
    "det_scaled_dot_product_attention",
    "det_function_mode",
    "BroadcastGradError",
    "det_cross_entropy",
    "det_cos",
    "det_exp",
    "det_gelu",
    "det_silu",
    "det_sin",
    "det_tanh",
    "det_sigmoid",
    "det_relu",
    "det_row_sums",
    "det_col_sums",
    "det_transform",
    "register_det_module",
    "UnsupportedModuleError",
    "DET_MODULES",
    "VERIFIED_MODULES",
    "VERIFIED_FUNCTIONS",
    "BatchPosition",
    "StepState",
    "StepStateMode",
    "current_step_state",
    "set_grad_digits",
    "finalize_grad_digits",
]
