"""Hugging Face attention in its "eager" form under strict det_ddp on CPU/gloo: tiny random Llama
and GPT-2 (HF's own loss through labels=) give the same weights and losses at world sizes 1 and 2.
The libraries' default paths (sdpa, nn.MultiheadAttention) run in tests/test_zoo.py.

Each run is a subprocess of tests/ddp_harness.py (test_det_ddp.run_rows: clean environment,
OMP_NUM_THREADS=1), the harness's global batch of 24, 2 optimizer steps.
"""
import pytest

pytest.importorskip("transformers")
from test_det_ddp import run  # noqa: E402

STEPS = 2


def _det(model, devices):
    return run(devices, model=model, steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-eager", "gpt2-eager"])
def test_eager_attention_models_are_world_size_invariant(model):
    # HF's "eager" attention: torch.matmul and softmax routed to det_matmul / det_softmax. The
    # default ("sdpa") paths of the same families, and their plain-DDP controls, are in test_zoo.py.
    assert _det(model, 1) == _det(model, 2), f"{model}: det_ddp world size 1 vs 2 differ"
