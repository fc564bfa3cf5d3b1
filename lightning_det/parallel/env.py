"""The process settings the contract needs, applied before CUDA or NCCL start."""
from __future__ import annotations

import os

import torch

__all__ = ["apply_strict_environment", "STRICT_ENV"]

# Environment variables read when cuBLAS / NCCL initialize (so they must be set first).
STRICT_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS workspaces (needed by use_deterministic_algorithms)
    "NCCL_ALGO": "Ring",  # pin the collective algorithm and protocol: no topology-dependent choice
    "NCCL_PROTO": "Simple",
    "NCCL_NVLS_ENABLE": "0",  # no NVLink multicast (SHARP-style in-switch reductions)
    "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK": "0",
}


def apply_strict_environment() -> dict:
    """Applies and returns the settings: env vars (not overriding the user's), deterministic
    algorithms, TF32 and reduced-precision reductions off, cuDNN benchmark off.

    Our digit all-reduce is integer addition, so NCCL's algorithm cannot change its result;
    pinning it still keeps any float collective a user issues (and timings) reproducible.
    """
    applied = {}
    for k, v in STRICT_ENV.items():
        os.environ.setdefault(k, v)
        applied[k] = os.environ[k]
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.set_float32_matmul_precision("highest")
    applied.update(
        deterministic_algorithms=True,
        cudnn_deterministic=True,
        cudnn_benchmark=False,
        tf32=False,
        reduced_precision_reductions=False,
        float32_matmul_precision="highest",
    )
    return applied


def run_then_destroy_process_group(main, *args, **kwargs):
    """Runs ``main(*args, **kwargs)`` and then destroys the default process group, if any.

    Lightning leaves the group alive at exit; a rank that then dies inside gloo's teardown
    ("terminate called without an active exception") fails a run that had finished.
    """
    import torch.distributed as dist

    try:
        return main(*args, **kwargs)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
