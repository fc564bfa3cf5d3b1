"""scatter_sum_digits (an embedding's weight gradient): exact grouped row sums as canonical digits,
against an independent route (every value's digits summed as integers), invariant to row order,
and the same bytes on CUDA (rows in chunks, integer atomics) as on the CPU."""
import pytest
import torch
from conftest import assert_bitwise, cuda

import gen
from lightning_det.ops import det_finalize, det_normalize, scatter_sum_digits, to_digits


def reference(a, index, n_out):
    """Each value's exact digits, summed as integers per group, then normalized."""
    d = to_digits(a)
    out = torch.zeros((n_out, a.shape[1], d.shape[-1]), dtype=torch.int64)
    out.index_add_(0, index, d)
    return det_normalize(out)


def adversarial_rows(R, W, seed, dtype=torch.float32):
    a = gen.wide_exponents((R, W), -60, 60, dtype, seed)
    a[3, 0], a[7, 1], a[8, 1], a[9, 2] = float("inf"), float("-inf"), float("inf"), float("nan")
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_integer_sum_of_every_values_digits(dtype):
    a = adversarial_rows(300, 37, 1, torch.float32)
    if dtype == torch.float16:
        a = gen.wide_exponents((300, 37), -14, 14, torch.float32, 1)
    a = a.to(dtype)
    index = torch.randint(0, 10, (300,), generator=torch.Generator().manual_seed(2))
    index[index == 6] = 5  # group 6 receives nothing: exact zeros; group 10 does not exist
    got = scatter_sum_digits(a, index, 11)
    assert torch.equal(got, reference(a, index, 11))
    assert not got[6].any() and not got[10].any()


def test_row_order_never_shows_and_plain_index_add_does():
    a = torch.tensor([[1e8], [1.0], [-1e8], [3.0]])
    index = torch.tensor([0, 0, 0, 1])
    want = det_finalize(scatter_sum_digits(a, index, 2), torch.float32)
    assert torch.equal(want, torch.tensor([[1.0], [3.0]]))
    for perm in ([2, 1, 0, 3], [1, 3, 2, 0], [3, 0, 2, 1]):
        p = torch.tensor(perm)
        assert torch.equal(scatter_sum_digits(a[p], index[p], 2), scatter_sum_digits(a, index, 2))
    plain = [torch.zeros(2, 1).index_add_(0, index[p], a[p]) for p in (torch.tensor([0, 1, 2, 3]),
                                                                         torch.tensor([0, 2, 1, 3]))]
    assert not torch.equal(plain[0], plain[1]), "control: float index_add_ unexpectedly order-free"


def test_bad_arguments_name_themselves():
    a = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"index: expected values in \[0, 4\), got 5"):
        scatter_sum_digits(a, torch.tensor([0, 1, 2, 5]), 4)
    with pytest.raises(ValueError, match=r"index: expected shape \(4,\)"):
        scatter_sum_digits(a, torch.tensor([0, 1, 2]), 4)
    with pytest.raises(TypeError, match="index"):
        scatter_sum_digits(a, torch.tensor([0, 1, 2, 3], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="a: expected a 2-D"):
        scatter_sum_digits(torch.ones(4), torch.tensor([0, 1, 2, 3]), 4)
    with pytest.raises(ValueError, match="n_out"):
        scatter_sum_digits(a, torch.tensor([0, 1, 2, 3]), -1)
    with pytest.raises(TypeError, match="a: expected dtype"):
        scatter_sum_digits(a.double(), torch.tensor([0, 1, 2, 3]), 4)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_chunks_and_atomics_give_the_cpu_bytes(dtype):
    # 5000 rows = 79 chunks of 64 sorted rows: groups span chunks (group 0 holds ~half the rows),
    # chunks hold several groups; specials in some columns
    g = torch.Generator().manual_seed(3)
    a = adversarial_rows(5000, 70, 4).to(dtype)
    index = torch.where(torch.rand(5000, generator=g) < 0.5, 0, torch.randint(0, 9, (5000,), generator=g))
    want = scatter_sum_digits(a, index, 9)
    assert torch.equal(want, reference(a, index, 9))
    got = scatter_sum_digits(a.cuda(), index.cuda(), 9)
    assert torch.equal(got.cpu(), want)
    p = torch.randperm(5000, generator=g)
    assert torch.equal(scatter_sum_digits(a[p].cuda(), index[p].cuda(), 9).cpu(), want)
    assert_bitwise(det_finalize(got, dtype).cpu(), det_finalize(want, dtype))
