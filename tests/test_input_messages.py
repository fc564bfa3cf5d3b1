"""Clear errors for bad values: an embedding index out of range, NumPy integers as arguments."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_det.data.sampler import DeterministicSampler
from lightning_det.nn import DetEmbedding, StepState, StepStateMode
from lightning_det.ops import det_finalize, det_gemm_partial


def test_embedding_index_out_of_range_names_the_input_and_the_range():
    emb = DetEmbedding(10, 4)
    with pytest.raises(IndexError, match="index out of range in self"):  # control: PyTorch's message
        torch.nn.functional.embedding(torch.tensor([3, 12]), emb.weight)
    with pytest.raises(IndexError, match=r"^input: 1 index value\(s\) outside \[0, 10\) for an embedding of 10 rows, e\.g\. 12$"):
        emb(torch.tensor([3, 12]))
    with pytest.raises(IndexError, match=r"^input: 2 index value\(s\) outside \[0, 10\) .* e\.g\. -4$"):
        emb(torch.tensor([[-1, 2], [-4, 0]]))
    assert emb(torch.zeros(0, dtype=torch.long)).shape == (0, 4)


def test_embedding_index_check_is_deferred_inside_a_training_step():
    emb = DetEmbedding(10, 4)
    idx = torch.tensor([3, 12, 9])
    state = StepState()
    with StepStateMode(state):  # as det_ddp's training step holds it
        out = emb(idx)  # no raise yet, no out-of-range read
        out.sum().backward()
    assert out[1].isnan().all() and torch.equal(out[[0, 2]], emb.weight[[3, 9]].detach())
    with pytest.raises(IndexError, match=r"outside \[0, 10\) .* e\.g\. 12 \(found when det_ddp resolved"):
        state.checks.resolve()
    good = StepState()
    with StepStateMode(good):
        emb(torch.tensor([0, 9]))
    good.checks.resolve()


def test_numpy_integers_are_accepted_as_scale_exp_and_seed():
    x = torch.tensor([[3.0]])
    acc = det_gemm_partial(x, torch.tensor([[1.0]]))
    for exp in (np.int64(-1), np.int32(-1), -1):
        assert det_finalize(acc, scale_exp=exp).item() == 1.5
    with pytest.raises(ValueError, match=r"scale_exp: expected an integer in \[-64, 0\], got 1.0"):
        det_finalize(acc, scale_exp=1.0)
    a = DeterministicSampler(40, 4, seed=np.int64(5))
    b = DeterministicSampler(40, 4, seed=5)
    assert type(a.seed) is int and list(a) == list(b)
    with pytest.raises(TypeError, match="seed: expected an integer, got float 5.5"):
        DeterministicSampler(40, 4, seed=5.5)
