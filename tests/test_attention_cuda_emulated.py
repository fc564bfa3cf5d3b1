"""The CUDA attention kernels, run on the CPU under an emulation of the CUDA execution model
(tests/csrc/cuda_emu.h: one fiber per thread, barriers, warp shuffles), give the CPU kernels'
bytes: the kernels' tiling, indexing, barriers and chain order checked where CI has no GPU.
Threads of each barrier phase run in ascending, descending and shuffled order, so a missing
barrier shows (test_the_emulation_catches_a_missing_barrier). Timing, resource limits and the
hardware itself are left to the CUDA tests (tests/test_fused_attention.py)."""
import math

import pytest
import torch
from conftest import assert_bitwise
from helpers.attention_inputs import attention_dropout, attention_inputs
from helpers.cuda_emu import load_attention_emu

from lightning_det.ops.attention import (_dropout_args, _fp32_value, _mask4, attention_backward, attention_forward,
                                         attention_probs)


@pytest.fixture(scope="module")
def emu():
    return load_attention_emu()


def test_the_emulation_catches_a_missing_barrier(emu):
    want = torch.tensor([float((t + 1) % 64) for t in range(64)])
    for order in (0, 1, 2):
        assert torch.equal(emu.barrier_probe(True, order), want)
    assert not torch.equal(emu.barrier_probe(False, 0), want)


# (B, H, Hkv, Lq, Lk, E, Ev, mask, causal, dropout): several tiles of each kernel for every head
# dimension class (64, 128, 256), tails in every direction, grouped-query heads
CASES = [
    (1, 2, 1, 150, 150, 64, 64, None, True, False),
    (1, 2, 2, 70, 50, 64, 64, "bool", False, True),
    (1, 2, 2, 67, 67, 128, 128, None, True, True),
    (1, 2, 1, 40, 70, 80, 48, "float", False, False),
    (1, 1, 1, 40, 40, 256, 200, None, True, False),
    (2, 3, 3, 33, 40, 5, 13, None, False, False),
    (1, 1, 1, 20, 90, 64, 64, None, True, False),  # causal, keys no query reaches
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_emulated_cuda_kernels_give_the_cpu_bytes(emu, case, dtype):
    b, h, hkv, lq, lk, e, ev, mask, causal, drop = case
    q, k, v, do, m = attention_inputs(b, h, hkv, lq, lk, e, ev, dtype, mask, seed=lq * 31 + lk)
    scale = 1.0 / math.sqrt(e)
    dropout = attention_dropout(drop, b)
    o, stats = attention_forward(q, k, v, m, scale, causal, dropout)
    grads = attention_backward(do, q, k, v, o, stats, m, scale, causal, dropout)
    probs = attention_probs(q, k, stats, m, scale, causal)
    drop_args, mult = _dropout_args(dropout, b)
    m4, sc = _mask4(m, q, lk), _fp32_value(scale, "scale")
    for order in (0, 1, 2):
        oe, se = emu.attention_fwd(q, k, v, m4, sc, causal, drop_args, mult, order)
        ge = emu.attention_bwd(do, q, k, v, o, stats, m4, sc, causal, drop_args, mult, order)
        pe = emu.attention_probs(q, k, stats, m4, sc, causal, order)
        for name, got, want in zip(("o", "stats", "dq", "dk", "dv", "probs"), (oe, se, *ge, pe),
                                   (o, stats, *grads, probs)):
            assert_bitwise(got, want, f"{name} (thread order {order})")
