"""Trusted regions set the det redirect mode aside (host time), and nothing else."""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_det.nn import det_function_mode
from lightning_det.ops.trust import in_trusted, trusted


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _smoothed_ce():
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    return F.cross_entropy(x, torch.tensor([0, 1, 2, 3]), label_smoothing=0.1)


def test_redirect_mode_is_set_aside_inside_trusted_and_restored_after():
    with det_function_mode(strict=True):
        # the mode is active: strict mode refuses an unsupported option (the control)
        with pytest.raises(ValueError, match="label_smoothing"):
            _smoothed_ce()
        with trusted():
            assert in_trusted()
            got = _smoothed_ce()  # not redirected: PyTorch's own function ran
        with pytest.raises(ValueError, match="label_smoothing"):
            _smoothed_ce()  # back after the region
    assert torch.equal(got, _smoothed_ce())


def test_other_modes_stay_inside_trusted():
    counting = _Counting()
    with det_function_mode(strict=True), counting:
        with trusted():
            torch.ones(3) + 1
        inside = counting.calls
    assert inside >= 2  # the user's mode on top still saw the calls
    with counting, det_function_mode(strict=True):  # beneath the det mode: ours is set aside, theirs is not
        before = counting.calls
        with trusted():
            torch.ones(3) + 1
        assert counting.calls - before >= 2
