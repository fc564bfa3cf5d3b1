import os

import pytest
import torch

# Keep the 2-core CI machine predictable; tests that care about thread counts set their own.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the lent GPU machine)")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, so NaN compares equal to NaN."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[t.dtype]
    return t.contiguous().view(view)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """torch.equal on bit patterns; on failure print the mismatching elements (Liger style)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ba, bb = bits(a.cpu()), bits(b.cpu())
    if not torch.equal(ba, bb):
        idx = (ba != bb).nonzero()[:10]
        rows = [f"  at {tuple(i.tolist())}: {a.cpu()[tuple(i)].item()!r} vs {b.cpu()[tuple(i)].item()!r}" for i in idx]
        n = int((ba != bb).sum())
        raise AssertionError(f"{what}: {n} of {a.numel()} elements differ\n" + "\n".join(rows))
