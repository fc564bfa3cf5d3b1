"""DetLinear: forward/backward against exact references, split invariance of dW, state_dict."""
import pytest
import torch
from conftest import assert_bitwise
from torch import nn

import gen
from lightning_det.nn import DetLinear, StepState, finalize_grad_digits, set_grad_digits
from lightning_det.reference import longacc_ref as R


def make(in_f=123, out_f=17, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = DetLinear(in_f, out_f, dtype=dtype)
    with torch.no_grad():
        lin.bias.copy_(gen.normal((out_f,), dtype, seed + 1))
    return lin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_grads_are_correctly_rounded(dtype):
    lin = make(dtype=dtype)
    x = gen.normal((2, 3, 123), dtype, 5).requires_grad_()
    gy = gen.normal((2, 3, 17), dtype, 6)
    y = lin(x)
    y.backward(gy)
    x2, g2 = x.detach().reshape(-1, 123), gy.reshape(-1, 17)
    W, b = lin.weight.detach(), lin.bias.detach()
    # exact references (Python integers), each rounded once to the tensor's dtype
    assert_bitwise(y.detach().reshape(-1, 17), R.gemm_rounded(x2, W, b, dtype), "forward")
    assert_bitwise(x.grad.reshape(-1, 123), R.gemm_rounded(g2, W.t(), None, dtype), "dX")
    assert_bitwise(lin.weight.grad, R.gemm_rounded(g2.t(), x2.t(), None, dtype), "dW")
    assert_bitwise(lin.bias.grad, R.gemm_rounded(g2.t(), torch.ones(1, 6, dtype=dtype), None, dtype).reshape(-1), "db")
    # and within the rounding bound of an fp64 reference (half an ulp of the output format)
    eps = torch.finfo(dtype).eps
    ref = x2.double() @ W.double().T + b.double()
    err = (y.detach().reshape(-1, 17).double() - ref).abs()
    assert bool((err <= ref.abs() * eps / 2 + torch.finfo(dtype).tiny).all())


def test_dw_invariant_to_batch_splits_in_digit_mode():
    lin = make(in_f=64, out_f=8)
    ref_lin = nn.Linear(64, 8)
    ref_lin.load_state_dict(lin.state_dict())
    x = gen.normal((48, 64), seed=7)
    gy = gen.normal((48, 8), seed=8)

    def digits_grad(splits):
        lin.zero_grad(set_to_none=True)
        state = StepState()
        set_grad_digits(lin, state)
        for part_x, part_g in zip(torch.tensor_split(x, splits), torch.tensor_split(gy, splits)):
            lin(part_x).backward(part_g)
        assert lin.weight.grad is None and state.grad_digits(lin.weight) is not None
        finalize_grad_digits(state, lin.parameters())
        set_grad_digits(lin, None)
        return lin.weight.grad.clone(), lin.bias.grad.clone()

    whole_w, whole_b = digits_grad([])
    lin.zero_grad(set_to_none=True)
    lin(x).backward(gy)
    assert_bitwise(whole_w, lin.weight.grad, "digit mode on one batch == ordinary mode")
    for splits in ([24], [5, 30], [1, 2, 3, 40], list(range(4, 48, 4))):
        w, b = digits_grad(splits)
        assert_bitwise(w, whole_w, f"dW splits {splits}")
        assert_bitwise(b, whole_b, f"db splits {splits}")
    # control: nn.Linear with .grad accumulation over the same micro-batches changes bits
    def plain(splits):
        ref_lin.zero_grad(set_to_none=True)
        for part_x, part_g in zip(torch.tensor_split(x, splits), torch.tensor_split(gy, splits)):
            ref_lin(part_x).backward(part_g)
        return ref_lin.weight.grad.clone()
    assert not torch.equal(plain([]), plain(list(range(4, 48, 4))))


def test_row_invariance_of_forward():
    lin = make(in_f=33, out_f=5)
    x = gen.normal((40, 33), seed=9)
    full = lin(x)
    for m in (1, 2, 7, 39):
        assert_bitwise(lin(x[:m]), full[:m], f"m={m}")


def test_loads_linear_state_dict_and_back():
    torch.manual_seed(0)
    plain = nn.Linear(10, 4)
    det = DetLinear(10, 4)
    det.load_state_dict(plain.state_dict())
    assert set(det.state_dict()) == {"weight", "bias"}
    plain2 = nn.Linear(10, 4)
    plain2.load_state_dict(det.state_dict())
    assert torch.equal(plain2.weight, plain.weight)
    nobias = DetLinear(10, 4, bias=False)
    nobias.load_state_dict(nn.Linear(10, 4, bias=False).state_dict())
    x = torch.randn(3, 10)
    assert nobias(x).shape == (3, 4)
    assert "in_features=10, out_features=4, bias=False" in repr(nobias)


def test_from_linear_keeps_parameter_objects():
    plain = nn.Linear(6, 3)
    w, b = plain.weight, plain.bias
    det = DetLinear.from_linear(plain)
    assert det is plain and det.weight is w and det.bias is b and isinstance(det, DetLinear)


def test_bad_input_shape():
    with pytest.raises(ValueError, match=r"^input: expected last dimension in_features=6"):
        DetLinear(6, 2)(torch.randn(3, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_grad_is_the_exact_column_sum_with_specials(dtype):
    # db = exact column sums of dY rounded once: the bytes of the GEMM against a row of ones
    # (the route it replaced) and of the Python-integer reference; inf / NaN columns as IEEE says
    from lightning_det.ops import det_gemm, det_gemm_partial

    lin = make(in_f=40, out_f=9, dtype=dtype)
    x = gen.normal((300, 40), dtype, 11)
    gy = gen.wide_exponents((300, 9), -40, 40, dtype, seed=12)
    gy[5, 2], gy[7, 3], gy[8, 3], gy[9, 4] = float("inf"), float("inf"), float("-inf"), float("nan")
    lin(x).backward(gy)
    ones = torch.ones(1, 300, dtype=dtype)
    assert_bitwise(lin.bias.grad, det_gemm(gy.t(), ones, out_dtype=dtype).reshape(-1), "db vs the GEMM with ones")
    finite = [0, 1, 5, 6, 7, 8]
    assert_bitwise(lin.bias.grad[finite], R.gemm_rounded(gy.t()[finite], ones, None, dtype).reshape(-1), "db exact")
    assert lin.bias.grad[2] == float("inf") and lin.bias.grad[3].isnan() and lin.bias.grad[4].isnan()
    # digit mode: the same digits as the GEMM route's
    lin.zero_grad(set_to_none=True)
    state = StepState()
    set_grad_digits(lin, state)
    lin(x).backward(gy)
    assert torch.equal(state.grad_digits(lin.bias), det_gemm_partial(gy.t(), ones).squeeze(-2))
    set_grad_digits(lin, None)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("in_f,out_f", [(0, 4), (8, 0), (0, 0)])
@pytest.mark.parametrize("digits", [False, True])
def test_zero_features_match_nn_linear_bytes(in_f, out_f, digits):
    # nn.Linear(0, N): the output is the bias broadcast and dW is empty; nn.Linear(K, 0): an empty
    # output and a zero dX. Integer-valued gradients keep nn.Linear's float sums exact, so its
    # bytes are the reference.
    ref = nn.Linear(in_f, out_f)
    with torch.no_grad():
        ref.bias.copy_(gen.normal((out_f,), torch.float32, 3))
        ref.weight.copy_(gen.normal((out_f, in_f), torch.float32, 4))
    lin = DetLinear(in_f, out_f)
    lin.load_state_dict(ref.state_dict())
    state = StepState() if digits else None
    set_grad_digits(lin, state)
    x = gen.normal((2, 3, in_f), torch.float32, 5)
    gy = torch.randint(-4, 5, (2, 3, out_f)).float()
    got, want = [], []
    for module, out in ((lin, got), (ref, want)):
        xi = x.clone().requires_grad_()
        y = module(xi)
        y.backward(gy)
        out += [y.detach(), xi.grad, module.weight.grad, module.bias.grad]
    if digits:
        assert lin.weight.grad is None
        finalize_grad_digits(state, lin.parameters())
        got[2:] = [lin.weight.grad, lin.bias.grad]
    for g, w, what in zip(got, want, ["forward", "dX", "dW", "db"]):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        assert_bitwise(g, w, f"Linear({in_f}, {out_f}) {what}")
