"""The tensor digest against its pure-Python reference, and its sensitivity."""
import functools
import operator

import pytest
import torch

from lightning_det.digest import dtype_name, digest_many, tensor_digest
from lightning_det.digest import reference as R


def ref_digest(t: torch.Tensor) -> str:
    c = t.detach().contiguous().reshape(-1)
    data = c.view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return R.digest_bytes(data, dtype_name(t.dtype), tuple(t.shape))


CASES = [
    torch.randn(5, 123, generator=torch.Generator().manual_seed(0)),  # odd shape, < 1 chunk
    torch.randn(3 * 4096 + 7, generator=torch.Generator().manual_seed(1)),  # 3 chunks + a partial word tail
    torch.randn(11, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),  # 66 bytes: tail of 2
    torch.arange(7, dtype=torch.uint8),  # 7 bytes: a single partial word
    torch.tensor(3.5, dtype=torch.float64),  # 0-dim
    torch.empty(0, 4),  # no bytes at all
    torch.tensor([True, False, True]),
    torch.randint(-2**62, 2**62, (4099,), generator=torch.Generator().manual_seed(3)),
]


@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{dtype_name(t.dtype)}{list(t.shape)}")
def test_matches_reference(t):
    assert tensor_digest(t) == ref_digest(t)


def test_chunk_hashes_match_reference_bit_for_bit():
    t = torch.randn(2 * 4096 + 1, generator=torch.Generator().manual_seed(4))
    got = [x % 2**64 for x in torch.ops.ldet.digest_chunks(t).tolist()]
    assert got == R.chunk_hashes(t.numpy().tobytes())


def test_independent_of_thread_count_and_layout():
    t = torch.randn(64, 1000, generator=torch.Generator().manual_seed(5))
    want = tensor_digest(t)
    n = torch.get_num_threads()
    try:
        for k in (1, 2):
            torch.set_num_threads(k)
            assert tensor_digest(t) == want
    finally:
        torch.set_num_threads(n)
    # A transposed view digests its logical (row-major) content, like .contiguous().
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    # A misaligned slice (byte offset not a multiple of 8) reads the same bytes as its copy.
    u = torch.arange(100, dtype=torch.uint8)[3:90]
    assert tensor_digest(u) == tensor_digest(u.clone()) == ref_digest(u)


def test_one_bit_flip_changes_digest():
    t = torch.randn(3000, generator=torch.Generator().manual_seed(6))
    base = tensor_digest(t)
    for idx in (0, 1499, 2999):
        for bit in (0, 17, 31):
            u = t.clone()
            u.view(torch.int32)[idx] ^= 1 << bit
            assert tensor_digest(u) != base, (idx, bit)


def test_swap_changes_digest_where_xor_sum_would_not():
    t = torch.arange(4096, dtype=torch.float32)
    u = t.clone()
    u[[10, 3000]] = u[[3000, 10]]
    assert tensor_digest(u) != tensor_digest(t)
    # Control: an order-insensitive hash (XOR of the words) cannot see the swap.
    def xor(x):
        return functools.reduce(operator.xor, x.view(torch.int32).tolist())

    assert xor(u) == xor(t)
    # Neighbours swapped inside one 8-byte word, too.
    v = t.clone()
    v[[0, 1]] = v[[1, 0]]
    assert tensor_digest(v) != tensor_digest(t)


def test_shape_and_dtype_are_covered():
    t = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    ds = {tensor_digest(t), tensor_digest(t.reshape(4, 6)), tensor_digest(t.reshape(24)),
          tensor_digest(t.view(torch.int32)), tensor_digest(t.view(torch.float16).reshape(6, 4, 2))}
    assert len(ds) == 5  # same bytes, five different tensors


def test_python_layer_handles_what_the_op_would_refuse():
    # The public functions make inputs contiguous before the op sees them, so users never reach
    # the C++ guard (under torch 2.11 a C++ exception thrown from an extension op crashed the
    # process).
    t = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="C++ exceptions from extension ops crash the process under torch < 2.13")
def test_op_argument_checks_name_the_argument():
    with pytest.raises(RuntimeError, match="`self` must be contiguous"):
        torch.ops.ldet.digest_chunks(torch.randn(3, 4).t())


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.ldet.digest_chunks(torch.empty(3 * 4096 + 1))
    assert out.shape == (4,) and out.dtype == torch.long


def test_digest_many_matches_single():
    ts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (1, 5000, 9000)]
    assert digest_many(ts) == [tensor_digest(t) for t in ts]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_equals_cpu():
    from lightning_det import _build

    assert _build.cuda_built(), "the core was built without the CUDA kernels"
    for t in CASES + [torch.randn(1 << 20, generator=torch.Generator().manual_seed(8))]:
        assert tensor_digest(t.cuda()) == tensor_digest(t) == ref_digest(t)
    # misaligned device pointer
    u = torch.arange(100, dtype=torch.uint8)
    assert tensor_digest(u.cuda()[3:90]) == tensor_digest(u[3:90])


def test_lower_layers_work_without_lightning():
    # With Lightning made unimportable, every layer below the Lightning glue still imports and
    # runs (`import lightning_det` registers det_ddp only when Lightning is there).
    import subprocess
    import sys

    from tests.conftest import clean_env

    code = ("import sys; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"
            "import torch, lightning_det, lightning_det.ops, lightning_det.nn, lightning_det.optim, "
            "lightning_det.parallel, lightning_det.digest, lightning_det.digest.manifest, "
            "lightning_det.digest.compare, lightning_det.data\n"
            "from lightning_det.ops import det_gemm\n"
            "assert det_gemm(torch.ones(2, 3), torch.ones(4, 3)).sum().item() == 24.0\n"
            "assert lightning_det.digest.tensor_digest(torch.ones(3))")
    subprocess.run([sys.executable, "-c", code], check=True, env=clean_env(), timeout=300)


def _many_cases():
    u = torch.arange(100, dtype=torch.uint8)
    return CASES + [u[3:90], torch.randn(5 * 4096, generator=torch.Generator().manual_seed(9)), torch.empty(0)]


def test_chunks_many_is_the_concatenation_of_each_tensors_chunks():
    ts = _many_cases()  # empty tensors first, between and last; a misaligned slice
    want = torch.cat([torch.ops.ldet.digest_chunks(t.contiguous()) for t in ts])
    got = torch.ops.ldet.digest_chunks_many([t.contiguous() for t in ts])
    assert torch.equal(got, want)
    assert torch.equal(torch.ops.ldet.digest_chunks_many([torch.empty(0), torch.empty(0, 3)]),
                       torch.empty(0, dtype=torch.long))
    # the control: the same bytes hashed as one buffer give other chunks (word indices and chunk
    # boundaries are each tensor's own)
    a, b = ts[0].reshape(-1), ts[1]
    assert not torch.equal(torch.ops.ldet.digest_chunks_many([a, b]), torch.ops.ldet.digest_chunks(torch.cat([a, b])))


def test_digest_many_of_many_tensors_matches_the_reference():
    ts = _many_cases() + [torch.randn(3, 5, generator=torch.Generator().manual_seed(k)).t() for k in range(40)]
    assert digest_many(ts) == [ref_digest(t) for t in ts]


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="C++ exceptions from extension ops crash the process under torch < 2.13")
def test_chunks_many_argument_checks_name_the_tensor():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] must be contiguous"):
        torch.ops.ldet.digest_chunks_many([torch.randn(3), torch.randn(3, 4).t()])
    from lightning_det.ops.digest import digest_chunks_many

    with pytest.raises(ValueError, match="tensors: expected at least one tensor"):
        digest_chunks_many([])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_chunks_many_equal_cpu():
    ts = _many_cases() + [torch.randn(1 << 20, generator=torch.Generator().manual_seed(10))]
    u = torch.arange(100, dtype=torch.uint8).cuda()
    dev = [t.cuda().contiguous() for t in ts] + [u[3:90], u[1:2]]  # device pointers misaligned
    cpu = [t.contiguous() for t in ts] + [u.cpu()[3:90], u.cpu()[1:2]]
    got = torch.ops.ldet.digest_chunks_many(dev)
    assert torch.equal(got.cpu(), torch.ops.ldet.digest_chunks_many(cpu))
    assert digest_many(dev) == [ref_digest(t) for t in cpu]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="C++ exceptions from extension ops crash the process under torch < 2.13")
def test_cuda_chunks_many_names_a_tensor_on_another_device():
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on cpu"):
        torch.ops.ldet.digest_chunks_many([torch.zeros(3, device="cuda"), torch.zeros(3)])
