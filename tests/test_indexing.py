"""det_index / det_gather / det_take_along_dim (lightning_det.nn.indexing): PyTorch's selection
forward, and a gradient that is, per input element, +0, the one gradient that picked it, or the
exact sum of those that did, rounded once; routed by det_function_mode."""
import pytest
import torch
from conftest import assert_bitwise, cuda
from helpers.exact_ref import exact_sum, gen, round32, wide

from lightning_det.nn import det_function_mode
from lightning_det.nn.indexing import det_gather, det_index, det_take_along_dim
from lightning_det.parallel import OpAudit


def _grad(fn, x, gy):
    xr = x.clone().requires_grad_()
    fn(xr).backward(gy)
    return xr.grad


def _exact_grad(x_shape, picks, gy):
    """The reference: picks[o] = the row-major input position output o picked."""
    terms = {}
    for p, g in zip(picks.reshape(-1).tolist(), gy.reshape(-1).tolist()):
        terms.setdefault(p, []).append(g)
    out = torch.zeros(x_shape).reshape(-1)
    for p, gs in terms.items():
        out[p] = round32(exact_sum(gs))
    return out.view(x_shape)


def _positions(shape, fn):
    return fn(torch.arange(torch.Size(shape).numel()).view(shape))


INDEXES = [  # name, the index of a (5, 4, 7) tensor x
    ("rows repeated", lambda x: torch.tensor([3, 1, 3, 3, 0])),
    ("list, repeated, middle dim", lambda x: (slice(None), [2, 2, 0, 2])),
    ("pairs (a classifier's last token)", lambda x: (torch.arange(5), torch.tensor([3, 0, 3, 2, 1]))),
    ("pairs repeated, split by a slice", lambda x: (torch.tensor([1, 1, 4]), slice(None), torch.tensor([0, 0, 6]))),
    ("bool mask", lambda x: x > 0),
    ("negative, ellipsis, None", lambda x: (Ellipsis, torch.tensor([-1, 0, -1]), None)),
]


@pytest.mark.parametrize("name,index", INDEXES, ids=[n for n, _ in INDEXES])
def test_index_forward_is_torch_and_grad_the_exact_sum_rounded_once(name, index):
    x = wide((5, 4, 7), 1)
    idx = index(x)
    y = det_index(x, idx)
    assert_bitwise(y, x[idx], "forward")
    gy = wide(y.shape, 2)
    got = _grad(lambda t: det_index(t, idx), x, gy)
    assert_bitwise(got, _exact_grad(x.shape, _positions(x.shape, lambda p: p[idx]), gy), "grad")


def test_repeated_picks_are_summed_exactly_where_torch_rounds_in_order():
    x = torch.zeros(3, 2)
    idx = torch.tensor([0, 0, 0, 2])
    gy = torch.tensor([[2.0**24, 1.0], [1.0, 1.0], [1.0, 3.0], [5.0, 7.0]])
    got = _grad(lambda t: det_index(t, idx), x, gy)
    assert got[0, 0].item() == 2.0**24 + 2  # exact, and representable
    assert_bitwise(got, _exact_grad(x.shape, _positions(x.shape, lambda p: p[idx]), gy))
    # the control: PyTorch adds in order, and 2^24 + 1 rounds back to 2^24 twice
    assert _grad(lambda t: t[idx], x, gy)[0, 0].item() == 2.0**24


def test_grad_does_not_depend_on_where_the_picks_sit_in_the_batch():
    # a (rows, width) table picked by every sample; one batch or two halves, whose gradients
    # add as digits under det_ddp: here the same bytes as the exact sum either way
    table = wide((6, 9), 3)
    idx = torch.randint(0, 6, (40,), generator=gen(4))
    gy = wide((40, 9), 5)
    full = _grad(lambda t: det_index(t, idx), table, gy)
    perm = torch.randperm(40, generator=gen(6))
    assert_bitwise(_grad(lambda t: det_index(t, idx[perm]), table, gy[perm]), full, "picks reordered")
    plain = [_grad(lambda t: t[idx[p]], table, gy[p]) for p in (torch.arange(40), perm)]
    assert not torch.equal(plain[0], plain[1]), "control: PyTorch's sum depends on the picks' order"


GATHERS = [
    ("gather dim -1", lambda t: det_gather(t, -1, torch.randint(0, 7, (5, 4, 11), generator=gen(7))),
     lambda t: torch.gather(t, -1, torch.randint(0, 7, (5, 4, 11), generator=gen(7)))),
    ("gather dim 0, smaller", lambda t: det_gather(t, 0, torch.randint(0, 5, (9, 2, 3), generator=gen(8))),
     lambda t: torch.gather(t, 0, torch.randint(0, 5, (9, 2, 3), generator=gen(8)))),
    ("take_along_dim", lambda t: det_take_along_dim(t, torch.randint(0, 4, (5, 6, 7), generator=gen(9)), 1),
     lambda t: torch.take_along_dim(t, torch.randint(0, 4, (5, 6, 7), generator=gen(9)), 1)),
    ("take_along_dim flat", lambda t: det_take_along_dim(t, torch.randint(0, 140, (30,), generator=gen(10))),
     lambda t: torch.take_along_dim(t, torch.randint(0, 140, (30,), generator=gen(10)))),
]


@pytest.mark.parametrize("name,det,plain", GATHERS, ids=[n for n, _, _ in GATHERS])
def test_gathers_forward_is_torch_and_grad_the_exact_sum_rounded_once(name, det, plain):
    x = wide((5, 4, 7), 11)
    y = det(x)
    assert_bitwise(y, plain(x), "forward")
    gy = wide(y.shape, 12)
    assert_bitwise(_grad(det, x, gy), _exact_grad(x.shape, _positions(x.shape, plain), gy), "grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_round_the_exact_sum_once(dtype):
    x = torch.zeros(4, 3, dtype=dtype)
    idx = torch.tensor([1, 1, 1, 1, 2])
    g = gen(13)
    # exponents within 20 binades: the exact sum of four is a float64, rounded once to the half
    gy = (torch.randn(5, 3, generator=g) * torch.exp2(torch.randint(-10, 10, (5, 3), generator=g).float())).to(dtype)
    got = _grad(lambda t: det_index(t, idx), x, gy)
    assert got.dtype == dtype
    want = gy[:4].double().sum(0).to(dtype)
    assert_bitwise(got[1], want, "exact sum rounded once")
    assert torch.equal(got[2], gy[4]) and torch.equal(got[0], torch.zeros(3, dtype=dtype))


def test_function_mode_routes_and_the_audit_sees_no_float_scatter():
    x = wide((5, 6), 14).requires_grad_()
    last = torch.tensor([5, 2, 0, 5, 1])
    with det_function_mode():
        picked = x[torch.arange(5), last]
        rows = x[[0, 0, 3]]
        gathered = x.gather(1, last[:, None].expand(5, 3))
        sliced = x[1:3]  # basic indexing: PyTorch's own view
    for t in (picked, rows, gathered):
        assert type(t.grad_fn).__name__ == "_DetSelectBackward"
    assert sliced._base is x
    loss = picked.sum() + rows.sum() + gathered.sum()
    with OpAudit() as audit:
        loss.backward()
    assert not [v for v in audit.violations() if "index" in v[0] or "scatter" in v[0]], audit.violations()
    # the control: unrouted, the backward scatters floats with accumulate=True, outside the verified set
    y = x.detach().requires_grad_()
    with OpAudit() as audit:
        (y[[0, 0, 3]].sum() + y.gather(1, last[:, None]).sum()).backward()
    names = {v[0] for v in audit.violations()}
    assert {"aten.index_put", "aten.scatter_add"} & names or any("accumulate" in n for n in names), names


def test_no_grad_and_integer_tensors_are_left_to_torch():
    x = wide((4, 3), 15)
    ints = torch.arange(12).view(4, 3)
    with det_function_mode():
        a = x[[0, 2]]
        b = ints[[1, 1]]
        with torch.no_grad():
            c = x.clone().requires_grad_()[[0]]
    assert a.grad_fn is None and b.grad_fn is None and c.grad_fn is None


def test_bad_arguments_name_themselves():
    x = wide((4, 3), 16)
    with pytest.raises(TypeError, match="index: expected an int64 tensor"):
        det_gather(x, 0, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(TypeError, match="input: expected a float32"):
        det_gather(torch.zeros(4, 3, dtype=torch.int64), 0, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="x: expected a float32"):
        det_index(torch.zeros(4, dtype=torch.float64), [0])
    with pytest.raises(IndexError):  # PyTorch's own bounds check, at the forward
        det_index(x, torch.tensor([9]))


@cuda
def test_cuda_gives_the_cpu_bytes():
    x = wide((64, 33), 17)
    idx = torch.randint(0, 64, (500,), generator=gen(18))
    gy = wide((500, 33), 19)
    cpu = _grad(lambda t: det_index(t, idx), x, gy)
    gpu = _grad(lambda t: det_index(t, idx.cuda()), x.cuda(), gy.cuda())
    assert_bitwise(gpu.cpu(), cpu, "det_index grad")
    gi = torch.randint(0, 33, (64, 50), generator=gen(20))
    gy2 = wide((64, 50), 21)
    cpu = _grad(lambda t: det_gather(t, 1, gi), x, gy2)
    gpu = _grad(lambda t: det_gather(t, 1, gi.cuda()), x.cuda(), gy2.cuda())
    assert_bitwise(gpu.cpu(), cpu, "det_gather grad")
    # the control: PyTorch's CUDA scatter of these repeats is not the exact sum
    plain = _grad(lambda t: t[idx.cuda()], x.cuda(), gy.cuda()).cpu()
    assert not torch.equal(plain, cpu)
