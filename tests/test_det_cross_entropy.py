"""det_cross_entropy: accuracy against fp64, row / column-order / thread / world-size invariance,
routing under det_function_mode, errors; PyTorch controls; CPU == CUDA (on the GPU machine).

Rounding bounds (u = 2^-24, fp32 unit roundoff; t_j = max - x_j; p the fp64 softmax; C classes):
  per-row loss, fp32 out:   |l - ref| <= u |ref| + u (2 + ln C)
      (final rounding, plus the exact sum of exp values each within u (1 + t_j) relatively,
       sum_j p_j t_j <= entropy <= ln C, and the one rounding of sum - 1)
  bf16/fp16 out:            add u_out |ref| (rounded via fp32)
  'sum' / 'mean':           the rows' fp32 bounds added up (/ count), plus u_out |ref|
  gradient, fp32:           |g - ref| <= |s| (u p_j (5 + t_j + ln C) + 2u |p_j - y_j|) + tiny
      (s the row's scale; tiny: the format's smallest subnormal), bf16/fp16: plus u_out |ref|
Each is multiplied by 1.01 for second-order terms.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_bitwise, cuda
from torch import nn

import gen
from lightning_det import global_mean
from lightning_det.nn import DetLinear, det_cross_entropy, det_function_mode, det_transform
from lightning_det.nn.loss import cross_entropy_rows, exact_loss_reduce
from lightning_det.ops import det_combine, det_finalize, det_gemm_partial
from lightning_det.parallel import OpAudit
from lightning_det.parallel.loss import feeds_global_loss, global_loss_reduce
from lightning_det.reference.log1p_ref import ce_row_loss_ref, log1p_fp64

U = 2.0 ** -24
U_OUT = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # beyond the fp32 stage
TINY = {torch.float32: 2.0 ** -149, torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24}  # underflow


def _logits(n, c, dtype, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g) * scale
    if n > 3:
        x[1] = -30.0
        x[1, 0] = 10.0  # a confident row: loss ~ e^-40 (tiny), target below
        x[2, :] = 0.0  # a flat row: loss = ln C exactly
    y = torch.randint(0, c, (n,), generator=g)
    if n > 3:
        y[1] = 0
    return x.to(dtype), y, g


def _report(err, bound, what):
    bad = (err > bound).nonzero()[:10]
    rows = [f"  at {tuple(i.tolist())}: err {err[tuple(i)].item():.3e} > bound {bound[tuple(i)].item():.3e}"
            for i in bad]
    assert not len(bad), f"{what}: {int((err > bound).sum())} of {err.numel()} outside the bound\n" + "\n".join(rows)


def _fp64_reference(x, y, ignore_index=-100):
    """Per-row loss, softmax and one-hot in fp64 from PyTorch's own fp64 kernels."""
    xd = x.double()
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y))
    ref = torch.where(valid, F.cross_entropy(xd, safe, reduction="none"), torch.zeros(len(y), dtype=torch.float64))
    p = torch.softmax(xd, dim=1)
    onehot = F.one_hot(safe, x.shape[1]).double()
    t = xd.amax(1, keepdim=True) - xd
    return ref, p, onehot, t, valid


def test_log1p_fp64_vs_math():
    g = torch.Generator().manual_seed(0)
    t = torch.cat([torch.rand(2000, generator=g) * 0.5, torch.rand(2000, generator=g) * 1e6,
                   torch.exp(torch.rand(2000, generator=g) * -80),
                   torch.tensor([0.0, 1e-30, 0.41421356, 0.41421357, 1.0, 3.0, 65535.0])]).double()
    got = log1p_fp64(t)
    ref = torch.tensor([math.log1p(v) for v in t.tolist()], dtype=torch.float64)
    err = (got - ref).abs()
    _report(err, 2.0 ** -51 * torch.maximum(ref.abs(), torch.full_like(ref, 2.0 ** -1022)), "log1p vs math.log1p")
    assert got[t == 0].eq(0).all() and got[t.isnan()].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("c", [1, 5, 33, 123, 1000])
def test_forward_and_grad_vs_fp64(dtype, c):
    x, y, g = _logits(40, c, dtype, seed=c, scale=2.0 if dtype == torch.float16 else 4.0)
    y[7] = -100
    ref, p, onehot, t, valid = _fp64_reference(x, y)
    row_fp32 = U * ref.abs() + U * (2 + math.log(c))
    uo = U_OUT[dtype]
    for reduction in ("none", "sum", "mean"):
        xr = x.clone().requires_grad_()
        loss = det_cross_entropy(xr, y, reduction=reduction)
        assert loss.dtype == dtype
        go = torch.randn(loss.shape, generator=g).to(dtype)
        loss.backward(go)
        n = int(valid.sum())
        if reduction == "none":
            want, bound, s = ref, row_fp32 + uo * ref.abs(), go.double()
        elif reduction == "sum":
            want = ref.sum()
            bound, s = row_fp32.sum() + (U + uo) * want.abs(), go.double().expand(len(y))
        else:
            want = ref.sum() / n
            bound, s = row_fp32.sum() / n + (U + uo) * want.abs(), go.double().expand(len(y)) / n
        _report((loss.double() - want).abs(), 1.01 * bound, f"{reduction} loss")
        s = torch.where(valid, s, torch.zeros_like(s)).unsqueeze(1)
        gref = (p - onehot) * s
        gbound = s.abs() * (U * p * (5 + t + math.log(c)) + 2 * U * (p - onehot).abs()) + TINY[dtype]
        _report((xr.grad.double() - gref).abs(), 1.01 * (gbound + uo * gref.abs()), f"{reduction} grad")
        assert xr.grad[7].eq(0).all() and not torch.signbit(xr.grad[7]).any()  # ignored row: +0.0


def test_small_losses_keep_relative_accuracy():
    # sum_j e_j - 1 is rounded, not sum_j e_j: a confident row's tiny loss stays relatively exact.
    x = torch.full((4, 50), -20.0)
    x[:, 0] = torch.tensor([0.0, 2.0, 5.0, 9.0])
    y = torch.zeros(4, dtype=torch.long)
    loss = det_cross_entropy(x, y, reduction="none")
    # reference: log1p(sum of the other exp terms), in Python (fp64 logsumexp - x_t would cancel)
    ref = torch.tensor([math.log1p(math.fsum(math.exp(v - r[0]) for v in r[1:])) for r in x.double().tolist()],
                       dtype=torch.float64)
    assert ((loss.double() - ref).abs() <= 4 * U * ref).all(), (loss, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", [5, 33, 123, 384])
def test_row_count_invariance(dtype, c):
    x, y, g = _logits(70, c, dtype, seed=100 + c)
    y[5] = -100
    gy = torch.randn(70, generator=g).to(dtype)
    xf = x.clone().requires_grad_()
    full = det_cross_entropy(xf, y, reduction="none")
    full.backward(gy)
    for m in (1, 2, 7, 31, 64):
        xm = x[:m].clone().requires_grad_()
        lm = det_cross_entropy(xm, y[:m], reduction="none")
        lm.backward(gy[:m])
        assert_bitwise(lm.detach(), full.detach()[:m], f"loss m={m}")
        assert_bitwise(xm.grad, xf.grad[:m], f"grad m={m}")
    # and at an offset: rows 40.. computed alone
    xo = x[40:].clone().requires_grad_()
    lo = det_cross_entropy(xo, y[40:], reduction="none")
    lo.backward(gy[40:])
    assert_bitwise(lo.detach(), full.detach()[40:], "loss offset 40")
    assert_bitwise(xo.grad, xf.grad[40:], "grad offset 40")


@pytest.mark.parametrize("c", [5, 33, 1000])
def test_column_order_invariance_and_torch_control(c):
    x, y, g = _logits(64, c, torch.float32, seed=200 + c)
    perm = torch.randperm(c, generator=g)
    xp, yp = x[:, perm], torch.argsort(perm)[y]  # the same problem, classes listed in another order
    a, b = x.clone().requires_grad_(), xp.clone().requires_grad_()
    la, lb = det_cross_entropy(a, y, reduction="none"), det_cross_entropy(b, yp, reduction="none")
    gy = torch.randn(64, generator=g)
    la.backward(gy)
    lb.backward(gy)
    assert_bitwise(lb.detach(), la.detach(), "loss, permuted classes")
    assert_bitwise(b.grad, a.grad[:, perm], "grad, permuted classes")
    # Control: PyTorch's float row sums depend on the column order (measured: 2, 12, 10 of 64 rows).
    ta, tb = F.cross_entropy(x, y, reduction="none"), F.cross_entropy(xp, yp, reduction="none")
    assert not torch.equal(ta, tb), "torch cross_entropy should change bits under a column permutation"


def test_thread_count_and_rerun_invariance():
    x, y, _ = _logits(256, 517, torch.float32, seed=3)
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            xr = x.clone().requires_grad_()
            loss = det_cross_entropy(xr, y)
            loss.backward()
            out.append((loss.detach(), xr.grad))
    finally:
        torch.set_num_threads(before)
    for loss, grad in out[1:]:
        assert_bitwise(loss, out[0][0], "loss")
        assert_bitwise(grad, out[0][1], "grad")


def _shards(n, k):
    step = n // k
    return [slice(i * step, (i + 1) * step) for i in range(k)]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_world_size_combination_matches_full_batch(reduction):
    """Per-shard losses combined the way det_ddp does (digits and counts summed over ranks, then
    one rounding; gradient scale from the global count) give the full batch's bits, N = 1..4."""
    x, y, g = _logits(48, 33, torch.float32, seed=5)
    y[torch.randperm(48, generator=g)[:9]] = -100  # shards hold different numbers of counted rows
    xf = x.clone().requires_grad_()
    full = det_cross_entropy(xf, y, reduction=reduction)
    full.backward()
    for k in (1, 2, 3, 4):
        parts = _shards(48, k)
        totals = []  # first pass: what each rank contributes to the all-reduce

        def capture(total, count):
            totals.append((total, count))
            return total, count

        for sl in parts:
            rows, valid, n = cross_entropy_rows(x[sl], y[sl])
            exact_loss_reduce(rows.detach(), reduction, mask=valid, count=n, combine=capture)
        reduced = (det_combine([t for t, _ in totals]), sum(c for _, c in totals))
        grads = []
        for sl in parts:  # second pass: each rank's loss after the (simulated) all-reduce
            xs = x[sl].clone().requires_grad_()
            rows, valid, n = cross_entropy_rows(xs, y[sl])
            loss = exact_loss_reduce(rows, reduction, mask=valid, count=n, combine=lambda t, c: reduced)
            assert_bitwise(loss.detach(), full.detach(), f"{reduction} value, {k} shards")
            loss.backward()
            grads.append(xs.grad)
        assert_bitwise(torch.cat(grads), xf.grad, f"{reduction} grads, {k} shards")


def test_mean_equals_global_mean_of_rows_and_control():
    # det 'mean' == global_mean over the per-row losses (what det_ddp computes at world size 1)
    x, y, _ = _logits(48, 33, torch.float32, seed=6)
    y[3] = -100
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    la = det_cross_entropy(a, y)
    lb = global_mean(det_cross_entropy(b, y, reduction="none"), mask=y != -100)
    # the strategies skip their 1/N gradient scale for a loss a global loss feeds, only
    assert feeds_global_loss(lb / 2) and not feeds_global_loss(la), "global_mean's node must be marked"
    la.backward()
    lb.backward()
    assert_bitwise(la.detach(), lb.detach(), "mean vs global_mean")
    assert_bitwise(a.grad, b.grad, "grads")
    # Control: PyTorch's mean over the batch differs from the mean of per-shard means (the
    # plain-DDP combination) for some split (measured: 2-3 of the 3 splits for most seeds).
    differs = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(48, 33, generator=g) * 4, torch.randint(0, 33, (48,), generator=g)
        full = F.cross_entropy(x, y)
        differs += [(seed, k) for k in (2, 3, 4)
                    if not torch.equal(full, sum(F.cross_entropy(x[s], y[s]) for s in _shards(48, k)) / k)]
    assert differs, "torch's mean and its per-shard combination should differ for some split"


def _mean_cases():
    """(values, out_dtype) whose exact mean over a power-of-two count lands on rounding edges."""
    t = torch.tensor
    one, u = 1.0, 2.0 ** -23
    return [
        (gen.normal((4096,), seed=12), torch.float32),
        (gen.wide_exponents((1024,), -60, 60, seed=13), torch.float32),
        (t([one, one, one, one + 2 * u]), torch.float32),  # mean 1 + 2^-24: a tie, to even (1)
        (t([one + u, one + u, one + u, one + 3 * u]), torch.float32),  # 1 + 3 * 2^-24: a tie, to even
        (t([2.0 ** -149, 0.0, 0.0, 0.0]), torch.float32),  # 2^-151: rounds to +0
        (t([-(2.0 ** -149), 0.0, 0.0, 0.0]), torch.float32),  # a negative value that rounds to zero: -0
        (t([3 * 2.0 ** -149, 0.0, 0.0, 0.0]), torch.float32),  # 0.75 of the smallest subnormal: up
        (t([1.0, -1.0, 0.0, 0.0]), torch.float32),  # exact zero: +0
        (t([1e5, 1e5, 1e5, 1e5]), torch.float16),  # beyond fp16's range: inf
        (gen.normal((512,), seed=14), torch.bfloat16),
        (t([1.0, float("nan"), 0.0, 0.0]), torch.float32),
        (t([1.0, float("inf"), 0.0, 0.0]), torch.float32),
        (t([float("-inf"), float("inf"), 0.0, 0.0]), torch.float32),
        (t([5.0]), torch.float32),  # 2^0
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_power_of_two_mean_rounds_on_the_device_like_the_host_route(monkeypatch, device):
    # A mean over 2^k elements is rounded by det_finalize (the division by 2^k inside the one
    # rounding, on the values' device: no host read); other counts go through Python integers
    # (mean_of_acc). The bytes must be those of the integer route on every rounding edge.
    import lightning_det.nn.loss as loss_mod
    from lightning_det.ops import det_normalize, to_digits
    from lightning_det.ops.exact_scalar import mean_of_acc

    for values, dtype in _mean_cases():
        total = det_normalize(to_digits(values).sum(0, keepdim=True))
        ref = torch.tensor(mean_of_acc(total[0].tolist(), values.numel(), dtype), dtype=torch.float32).to(dtype)
        got = exact_loss_reduce(values.to(device), "mean", out_dtype=dtype)
        assert got.device.type == device
        assert_bitwise(got.cpu(), ref, f"mean of {values.numel()} values -> {dtype}: {values[:4].tolist()}")

    def host_read(*a, **k):
        raise AssertionError("the mean was read back to the host")

    monkeypatch.setattr(loss_mod, "mean_of_acc", host_read)
    exact_loss_reduce(torch.ones(8, device=device), "mean")  # 2^3: rounded on the device
    with pytest.raises(AssertionError, match="read back"):  # control: 3 is not a power of two
        exact_loss_reduce(torch.ones(3, device=device), "mean")


def test_mean_gradient_scales_by_powers_of_two_for_per_rank_means():
    # A per-rank det 'mean' with N = 2^k ranks: each rank's logit gradient is exactly N times the
    # full batch's, so the strategy's 2^-k inside the one rounding gives the same weight gradient.
    g = torch.Generator().manual_seed(8)
    h = torch.randn(32, 16, generator=g)
    x, y, _ = _logits(32, 9, torch.float32, seed=8)
    xf = x.clone().requires_grad_()
    det_cross_entropy(xf, y).backward()
    want = det_finalize(det_gemm_partial(xf.grad.t().contiguous(), h.t().contiguous()))
    for k in (2, 4):
        accs = []
        for sl in _shards(32, k):
            xs = x[sl].clone().requires_grad_()
            det_cross_entropy(xs, y[sl]).backward()
            assert_bitwise(xs.grad, xf.grad[sl] * k, f"logit grad x {k}")
            accs.append(det_gemm_partial(xs.grad.t().contiguous(), h[sl].t().contiguous()))
        got = det_finalize(det_combine(accs), scale_exp=-(k.bit_length() - 1))
        assert_bitwise(got, want, f"head weight grad, {k} ranks")


def test_ignore_index_semantics_match_torch():
    x, y, _ = _logits(10, 6, torch.float32, seed=9)
    for ignore in (-100, 0):
        yy = y.clone()
        yy[::3] = ignore
        for reduction in ("none", "sum", "mean"):
            a, b = x.clone().requires_grad_(), x.clone().double().requires_grad_()
            la = det_cross_entropy(a, yy, ignore_index=ignore, reduction=reduction)
            lb = F.cross_entropy(b, yy, ignore_index=ignore, reduction=reduction)
            la.sum().backward()
            lb.sum().backward()
            torch.testing.assert_close(la.double(), lb, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-5, atol=1e-7)
    # every row ignored: nan mean (as torch), zero gradient
    a = x.clone().requires_grad_()
    loss = det_cross_entropy(a, torch.full((10,), -100))
    loss.backward()
    assert loss.isnan() and a.grad.eq(0).all()
    assert det_cross_entropy(x[:0], y[:0], reduction="sum").item() == 0.0
    assert det_cross_entropy(x[:0], y[:0], reduction="none").shape == (0,)


def test_function_mode_routes_cross_entropy_and_module():
    x, y, _ = _logits(20, 17, torch.float32, seed=10)
    y[2] = -100
    for reduction in ("none", "sum", "mean"):
        want = det_cross_entropy(x, y, reduction=reduction)
        with det_function_mode():
            got_f = F.cross_entropy(x, y, reduction=reduction)
            got_m = nn.CrossEntropyLoss(reduction=reduction)(x, y)
        with det_function_mode(loss_reduce=global_loss_reduce):  # det_ddp's mode, one process
            got_g = F.cross_entropy(x, y, reduction=reduction)
        for got in (got_f, got_m, got_g):
            assert_bitwise(got, want, f"routed {reduction}")
    # PyTorch's own differs in some bits (teeth for the comparison above)
    assert not torch.equal(F.cross_entropy(x, y, reduction="none"), det_cross_entropy(x, y, reduction="none"))


def test_function_mode_passes_the_row_count_to_a_loss_reduce_that_takes_it(monkeypatch):
    # The mode knows the valid rows' count from the target check; a loss_reduce taking count=
    # (det_ddp's global_loss_reduce) gets it and does not read the mask back. One without count=
    # is still called as before. Both give det_cross_entropy's bytes.
    import lightning_det.nn.loss as loss_mod

    x, y, _ = _logits(20, 17, torch.float32, seed=15)
    y[2], y[5] = -100, -100
    seen = []

    def with_count(values, mask, reduction, out_dtype, count=None):
        seen.append(count)
        return global_loss_reduce(values, mask, reduction, out_dtype, count=count)

    def without_count(values, mask, reduction, out_dtype):
        return global_loss_reduce(values, mask, reduction, out_dtype)

    want = det_cross_entropy(x, y)
    real_sum = torch.Tensor.sum

    def bool_sums(loss_reduce):  # the mask sums a call makes (each one read back to the host)
        reads = []
        monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: (reads.append(t.dtype), real_sum(t, *a, **k))[1])
        with det_function_mode(loss_reduce=loss_reduce):
            loss = F.cross_entropy(x, y)
        monkeypatch.undo()
        return loss, reads.count(torch.bool)

    old, n_old = bool_sums(without_count)
    new, n_new = bool_sums(with_count)
    assert seen == [18], f"count passed: {seen}"
    assert n_new == n_old - 1, f"mask sums: {n_new} with count=, {n_old} without (the control)"
    assert_bitwise(new, want, "with count")
    assert_bitwise(old, want, "without count")


def test_function_mode_strict_and_fallback():
    x, y, _ = _logits(8, 5, torch.float32, seed=11)
    with det_function_mode():
        with pytest.raises(ValueError, match="label_smoothing: det_cross_entropy supports only"):
            F.cross_entropy(x, y, label_smoothing=0.1)
        with pytest.raises(ValueError, match="weight: "):
            nn.CrossEntropyLoss(weight=torch.ones(5))(x, y)
    with det_function_mode(strict=False):
        with pytest.warns(UserWarning, match="label_smoothing.*PyTorch's F.cross_entropy runs instead"):
            got = F.cross_entropy(x, y, label_smoothing=0.1)
    assert torch.equal(got, F.cross_entropy(x, y, label_smoothing=0.1))


def test_audit_passes_mean_loss_under_the_mode():
    model = det_transform(nn.Sequential(nn.Embedding(10, 6), nn.LayerNorm(6), nn.GELU(), nn.Linear(6, 4)))
    idx, tgt = torch.randint(0, 10, (7,)), torch.randint(0, 4, (7,))
    with OpAudit(model) as audit:
        with det_function_mode(loss_reduce=global_loss_reduce):
            loss = F.cross_entropy(model(idx), tgt)
        loss.backward()
    assert audit.violations() == [], audit.violations()


def test_argument_errors():
    x = torch.randn(4, 5)
    y = torch.randint(0, 5, (4,))
    cases = [
        (dict(weight=torch.ones(5)), ValueError, "weight: "),
        (dict(label_smoothing=0.1), ValueError, "label_smoothing: "),
        (dict(size_average=True), ValueError, "size_average/reduce: "),
        (dict(reduce=False), ValueError, "size_average/reduce: "),
        (dict(reduction="avg"), ValueError, "reduction: expected 'mean', 'sum' or 'none'"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
    ]
    for kwargs, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            det_cross_entropy(x, y, **kwargs)
    bad_inputs = [
        (x.double(), y, ValueError, "input: det_cross_entropy expects float32, bfloat16 or float16"),
        (x.reshape(4, 5, 1), y, ValueError, r"input: det_cross_entropy expects 2-D \(N, C\)"),
        (x[:, :0], y, ValueError, r"input: expected at least one class"),
        (x, y.int(), TypeError, "target: expected int64"),
        (x, y.float().softmax(0), ValueError, "target: class-probability"),
        (x, y[:3], ValueError, r"target: expected shape \(4,\)"),
        (x, y.to("meta"), ValueError, "target: expected device cpu"),
        (x, torch.tensor([0, 5, 1, -1]), ValueError, r"target: 2 value\(s\) outside \[0, 5\)"),
    ]
    for inp, tgt, exc, msg in bad_inputs:
        with pytest.raises(exc, match=msg):
            det_cross_entropy(inp, tgt)
    with pytest.raises(ValueError, match="mask: expected a bool tensor"):
        global_mean(torch.ones(3), mask=torch.ones(3))


def test_det_ddp_mean_cross_entropy_world_size_invariant():
    """The harness's plain F.cross_entropy(..., ignore_index) under det_ddp (strict audit): world
    sizes 1, 2 and 3 give the same weights and logged losses at every step, although the ranks
    hold different numbers of counted rows. (Lightning processes on gloo; ~1 minute.)"""
    from tests.test_det_ddp import losses, run, weights

    base = run(1, loss="mean-ignore")
    for devices in (2, 3):
        other = run(devices, loss="mean-ignore")
        assert weights(other) == weights(base), f"weights differ at world size {devices}"
        assert losses(other) == losses(base), f"logged losses differ at world size {devices}"
    # accumulation (no ignored rows: each micro-batch then holds half of the counted rows)
    assert weights(run(1, accum=2, loss="mean")) == weights(run(1, loss="mean"))


# ---- CUDA (the lent GPU machine) ----------------------------------------------------------
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", [5, 33, 123, 1000, 50257])
def test_cuda_matches_cpu(dtype, c):
    x, y, g = _logits(64 if c < 50000 else 8, c, dtype, seed=300 + c)
    y[3] = -100
    for reduction in ("none", "sum", "mean"):
        out = {}
        for dev in ("cpu", "cuda"):
            xr = x.to(dev, copy=True).requires_grad_()  # a fresh leaf on each device
            loss = det_cross_entropy(xr, y.to(dev), reduction=reduction)
            go = torch.linspace(-1, 1, loss.numel()).reshape(loss.shape).to(dtype).to(dev)
            loss.backward(go)
            out[dev] = (loss.detach().cpu(), xr.grad.cpu())
        assert_bitwise(out["cuda"][0], out["cpu"][0], f"{reduction} loss, cpu vs cuda")
        assert_bitwise(out["cuda"][1], out["cpu"][1], f"{reduction} grad, cpu vs cuda")


@cuda
def test_cuda_log1p_matches_cpu():
    t = torch.cat([torch.rand(100000, dtype=torch.float64), torch.rand(100000, dtype=torch.float64) * 1e6])
    t = t.float().double()  # fp32 values, as the loss passes them
    assert_bitwise(log1p_fp64(t.cuda()).cpu(), log1p_fp64(t), "log1p fp64, cpu vs cuda")


def _row_loss_inputs():
    """m, picked, t_minus (fp32) across log1p's branches and edges, with NaN and inf rows."""
    g = torch.Generator().manual_seed(11)
    n = 20000
    t = torch.cat([torch.rand(n, generator=g) * 0.5, torch.rand(n, generator=g) * 1e6,
                   torch.exp(torch.rand(n, generator=g) * -80), torch.rand(n, generator=g) * 3e38,
                   torch.tensor([0.0, 1e-30, 0.41421356, 0.41421357, 0.41421354, 1.0, 3.0, 65535.0,
                                 float("nan"), 2.0 ** -149])])
    m = torch.randn(t.numel(), generator=g) * torch.pow(2.0, torch.randint(-30, 30, (t.numel(),), generator=g).float())
    picked = m - torch.rand(t.numel(), generator=g) * 20
    m[-3], picked[-4] = float("inf"), float("nan")
    picked[-3] = float("inf")  # inf - inf
    # rows whose loss is log1p(t) minus its own fp32 rounding: the fp32 result shows the fp64
    # log1p's low bits, so a kernel computing another fp64 log1p differs here
    t2 = torch.rand(n, generator=g) * torch.pow(10.0, torch.randint(-6, 6, (n,), generator=g).float())
    return (torch.cat([m, torch.zeros(n)]), torch.cat([picked, torch.log1p(t2.double()).float()]), torch.cat([t, t2]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_row_loss_kernel_matches_eager_reference(device):
    # The row losses come from one kernel (csrc/detmath.h ce_row_loss) that runs the eager
    # reference's IEEE operations in its order: the bytes must be the reference's (NaN canonical).
    from lightning_det.ops.cross_entropy import ce_row_loss

    m, picked, t = _row_loss_inputs()
    got = ce_row_loss(m.to(device), picked.to(device), t.to(device)).cpu()
    ref = ce_row_loss_ref(m, picked, t)
    assert_bitwise(got, ref, f"row losses on {device} vs the eager reference")
    assert got.isnan().sum() == 3, "the NaN, inf - inf and NaN-target rows"
    # control: with torch's own fp64 log1p some rows differ
    plain = ((m.double() - picked.double()) + torch.log1p(t.double())).float()
    fin = ref.isfinite()
    assert not torch.equal(plain[fin], ref[fin]), "control: torch.log1p matched the reference everywhere"


@cuda
def test_cuda_control_torch_cross_entropy_differs():
    # The control: PyTorch's own cross_entropy gives different bits on CPU and CUDA somewhere.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1000, generator=g) * 4
    y = torch.randint(0, 1000, (4096,), generator=g)
    a = F.cross_entropy(x, y, reduction="none")
    b = F.cross_entropy(x.cuda(), y.cuda(), reduction="none").cpu()
    assert not torch.equal(a, b), "torch cross_entropy was CPU/CUDA bitwise equal here: the control has no teeth"


@cuda
def test_cuda_det_linear_head_with_loss_matches_cpu():
    # a head and the loss together, as in a model: forward, loss and every gradient
    out = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        head = DetLinear(32, 77).to(dev)
        h = torch.randn(50, 32, generator=torch.Generator().manual_seed(1)).to(dev).requires_grad_()
        y = torch.randint(0, 77, (50,), generator=torch.Generator().manual_seed(2)).to(dev)
        loss = det_cross_entropy(head(h), y)
        loss.backward()
        out[dev] = [t.detach().cpu() for t in (loss, h.grad, head.weight.grad, head.bias.grad)]
    for name, a, b in zip(("loss", "dh", "dW", "db"), out["cpu"], out["cuda"]):
        assert_bitwise(b, a, f"{name}, cpu vs cuda")
