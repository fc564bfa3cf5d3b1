"""The verified set of modules, as data: what det_transform swaps in, and what was checked where.

Keys are ``torch.nn`` class names, or a library class's dotted path. ``also_matches`` lists the
lookalike classes det_transform swaps to the same replacement (rules in
:mod:`lightning_det.nn.transform` and :mod:`lightning_det.nn.lookalikes`).

``invariances`` name rows of the contract table in DESIGN.md section 1 that the tests
(tests/test_det_modules.py) assert for the replacement. ``verified_on`` lists the devices the
tests have passed on; a CUDA entry is added only once they pass on that GPU
(benchmarks/results/<device>-cuda_suite.json records the run).
"""
from __future__ import annotations

__all__ = ["VERIFIED_MODULES", "VERIFIED_FUNCTIONS"]

_COMMON = ["run-to-run", "batch (row count)", "position (odd widths 33, 123)"]

# convolutions and GroupNorm: per-sample results (tests/test_conv.py, tests/test_group_norm.py)
_CNN = ["run-to-run", "batch (row count)", "odd sizes (5 channels, 7 x 9, stride, dilation, groups)"]
# BatchNorm's statistics cross the batch by design: global micro-batch or ghost groups
# (tests/test_batch_norm.py, tests/test_conv_bn_ddp.py)
_BN = ["run-to-run", "global micro-batch statistics", "accumulation (ghost groups)", "running statistics"]

VERIFIED_MODULES: dict[str, dict] = {
    "Linear": {
        "replacement": "DetLinear",
        "also_matches": ["subclasses that keep forward (torch's NonDynamicallyQuantizableLinear)", "HF FalconLinear"],
        "invariances": _COMMON + ["tiling / kernel", "K-sharding", "accumulation (digit mode)", "device"],
        "verified_on": ["cpu", "cuda (H100)", "cuda (H200)"],
    },
    "Embedding": {
        "replacement": "DetEmbedding",
        "also_matches": ["HF OPTLearnedPositionalEmbedding and GemmaTextScaledWordEmbedding (their code around it)"],
        "invariances": _COMMON + ["batch order / split", "accumulation (digit mode)"],
        "verified_on": ["cpu", "cuda (H200)"],
    },
    "LayerNorm": {
        "replacement": "DetLayerNorm",
        "also_matches": ["subclasses that keep forward", "HF ConvNextLayerNorm (its permutes around it)"],
        "invariances": _COMMON + ["accumulation (digit mode)"],
        "verified_on": ["cpu", "cuda (H200)"],
    },
    "RMSNorm": {
        "replacement": "DetRMSNorm",
        "also_matches": ["HF LlamaRMSNorm and its copies (Qwen2RMSNorm, MistralRMSNorm, ...)", "HF T5LayerNorm",
                         "HF GemmaRMSNorm (weight_offset 1: xhat * (1 + weight))"],
        "invariances": _COMMON + ["accumulation (digit mode)"],
        "verified_on": ["cpu", "cuda (H200)"],
    },
    "GELU": {"replacement": "DetGELU", "invariances": list(_COMMON), "verified_on": ["cpu", "cuda (H200)"],
             "also_matches": ["HF GELUActivation", "HF NewGELUActivation", "HF GELUTanh"]},
    "SiLU": {"replacement": "DetSiLU", "invariances": list(_COMMON), "verified_on": ["cpu", "cuda (H200)"],
             "also_matches": ["HF SiLUActivation"]},
    "Tanh": {"replacement": "DetTanh", "invariances": list(_COMMON), "verified_on": ["cpu", "cuda (H200)"]},
    "ReLU": {"replacement": "DetReLU", "invariances": list(_COMMON), "verified_on": ["cpu", "cuda (H200)"]},
    "Sigmoid": {"replacement": "DetSigmoid", "invariances": list(_COMMON), "verified_on": ["cpu", "cuda (H200)"]},
    "Hardtanh": {"replacement": "DetHardtanh", "invariances": list(_COMMON), "verified_on": ["cpu"],
                 "also_matches": ["nn.ReLU6 (its subclass)"]},
    "transformers.activations.QuickGELUActivation": {"replacement": "DetQuickGELU", "invariances": list(_COMMON),
                                                     "verified_on": ["cpu"]},
    "Conv1d": {"replacement": "DetConv1d", "invariances": _CNN + ["accumulation (digit mode)"], "verified_on": ["cpu"],
               "also_matches": ["subclasses that keep forward"]},
    "Conv2d": {"replacement": "DetConv2d", "invariances": _CNN + ["accumulation (digit mode)", "world size (det_ddp)"],
               "verified_on": ["cpu"], "also_matches": ["subclasses that keep forward"]},
    "BatchNorm1d": {"replacement": "DetBatchNorm1d", "invariances": _BN, "verified_on": ["cpu"]},
    "BatchNorm2d": {"replacement": "DetBatchNorm2d", "invariances": _BN + ["world size (det_ddp)"], "verified_on": ["cpu"]},
    "GroupNorm": {"replacement": "DetGroupNorm", "invariances": _CNN + ["accumulation (digit mode)"],
                  "verified_on": ["cpu"]},
    "AdaptiveAvgPool1d": {"replacement": "DetAdaptiveAvgPool1d", "verified_on": ["cpu"],
                          "invariances": ["run-to-run", "batch (row count)", "world size (det_ddp)",
                                          "non-overlapping regions only"]},
    "AdaptiveAvgPool2d": {"replacement": "DetAdaptiveAvgPool2d", "verified_on": ["cpu"],
                          "invariances": ["run-to-run", "world size (det_ddp)", "non-overlapping regions only"]},
    "MaxPool2d": {"replacement": "DetMaxPool2d", "verified_on": ["cpu"],
                  "invariances": ["run-to-run", "batch (row count)", "overlapping windows: exact gradient sums"]},
    "MultiheadAttention": {
        "replacement": "DetMultiheadAttention",
        "also_matches": ["its out_proj (NonDynamicallyQuantizableLinear) becomes DetLinear"],
        "invariances": ["run-to-run", "batch (sequences)", "accumulation (digit mode)", "world size (det_ddp)"],
        "verified_on": ["cpu"],
    },
    "TransformerEncoderLayer": {"replacement": "DetTransformerEncoderLayer", "note": "no eval fast path",
                                "invariances": ["run-to-run", "batch (sequences)", "eval == training forward",
                                                "world size (det_ddp)"], "verified_on": ["cpu"]},
    "TransformerEncoder": {"replacement": "DetTransformerEncoder", "note": "no nested tensors",
                           "invariances": ["run-to-run", "batch (sequences)", "world size (det_ddp)"],
                           "verified_on": ["cpu"]},
    "TransformerDecoderLayer": {"replacement": "DetTransformerDecoderLayer",
                                "invariances": ["run-to-run", "batch (sequences)"], "verified_on": ["cpu"]},
    "Dropout": {
        "replacement": "DetDropout",
        "also_matches": ["subclasses that keep forward"],
        "invariances": ["run-to-run", "batch (row count)", "world size (det_ddp)", "accumulation"],
        "verified_on": ["cpu"],
    },
    "transformers.models.convnext.modeling_convnext.ConvNextDropPath": {
        "replacement": "DetDropPath",
        "also_matches": ["HF SwinDropPath and the other copies of its code"],
        "invariances": ["run-to-run", "batch split", "world size (det_ddp)", "keyed per sample"],
        "verified_on": ["cpu"],
    },
    "transformers.pytorch_utils.Conv1D": {
        "replacement": "DetConv1D",
        "invariances": _COMMON + ["accumulation (digit mode)"],
        "verified_on": ["cpu"],
    },
}

#: PyTorch functions that ``det_function_mode`` (applied by det_ddp around training and
#: validation steps) sends to a det version. Same keys as above; tests: tests/test_attention.py,
#: tests/test_fused_attention.py, tests/test_reductions.py, tests/test_indexing.py, tests/test_alibi_routes.py,
#: tests/test_det_cross_entropy.py, tests/test_keyed_dropout.py. "device" is listed once the CUDA
#: test has passed on a GPU.
VERIFIED_FUNCTIONS: dict[str, dict] = {
    "torch.nn.functional.scaled_dot_product_attention": {
        "replacement": "det_scaled_dot_product_attention (fused kernels, csrc/attention.h)",
        "invariances": ["run-to-run", "batch (sequences)", "heads", "grouped-query heads (enable_gqa)",
                        "world size (det_ddp)", "device"],
        "verified_on": ["cpu", "cuda (H200)"],
    },
    "torch.matmul": {
        "replacement": "det_matmul (also @, torch.bmm, torch.mm; two activations, not a Parameter)",
        "invariances": ["run-to-run", "batch (slices)", "exact sum rounded once"],
        "verified_on": ["cpu"],
    },
    "torch.baddbmm": {
        "replacement": "det_matmul of batch1 @ batch2, then alpha *, beta * input and + as IEEE operations "
                       "(also Tensor.baddbmm; an input without a gradient)",
        "invariances": ["run-to-run", "batch (slices)", "exact sum rounded once"],
        "verified_on": ["cpu"],
    },
    "torch.pow (a float tensor to an integer tensor, no gradient)": {
        "replacement": "det_pow_int (fp64 binary powering, one rounding; BLOOM's ALiBi slopes)",
        "invariances": ["run-to-run", "elementwise (position)"],
        "verified_on": ["cpu"],
    },
    "torch.nn.functional.softmax": {
        "replacement": "det_softmax (also torch.softmax, Tensor.softmax, with a dim)",
        "invariances": ["run-to-run", "batch (row count and offset)"],
        "verified_on": ["cpu"],
    },
    "torch.tanh": {
        "replacement": "det_tanh (also Tensor.tanh, F.tanh; torch.sin / torch.cos -> det_sin / det_cos)",
        "invariances": ["run-to-run", "elementwise", "gradient rounded once"],
        "verified_on": ["cpu"],
    },
    "torch.sum / torch.mean / torch.cumsum over dimensions that leave dimension 0": {
        "replacement": "det_sum / det_mean / det_cumsum (also the Tensor methods; lightning_det.nn.reductions)",
        "invariances": ["run-to-run", "batch (row count)", "exact sum (each prefix) rounded once", "device"],
        "verified_on": ["cpu", "cuda (H200)"],
    },
    "torch.Tensor.__getitem__ (tensor or list indices) / torch.gather / torch.take_along_dim": {
        "replacement": "det_index / det_gather / det_take_along_dim (lightning_det.nn.indexing)",
        "invariances": ["run-to-run", "batch (the picks' order)", "exact sum of repeated picks rounded once",
                        "device"],
        "verified_on": ["cpu", "cuda (H200)"],
    },
    "torch.nn.functional.dropout": {
        "replacement": "keyed dropout (lightning_det.nn.dropout; also attention's dropout_p > 0)",
        "invariances": ["run-to-run", "batch (row count)", "world size (det_ddp)", "accumulation"],
        "verified_on": ["cpu"],
    },
    "torch.nn.functional.cross_entropy": {
        "replacement": "det_cross_entropy (nn.CrossEntropyLoss calls it too)",
        "invariances": ["run-to-run", "batch (row count)", "column order", "thread count",
                        "world size (global mean/sum under det_ddp)", "accumulation", "device"],
        "verified_on": ["cpu", "cuda (H100)"],
    },
    "broadcasting functions (+ - * /, where, expand, expand_as, broadcast_to, repeat, ...)": {
        "replacement": "the gradient of a broadcast Parameter (or a view, slice or cast of one, or a "
                       "DetEmbedding output) summed exactly as digits (lightning_det.nn.broadcast_grads)",
        "invariances": ["run-to-run", "batch split / accumulation (digit mode)", "world size (det_ddp)"],
        "verified_on": ["cpu"],
    },
}
