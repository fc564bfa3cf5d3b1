"""AdamWSR: kernel vs reference, tracking of torch.optim.AdamW, unbiased stochastic rounding,
sub-ULP training, determinism (seed, shards, threads, resume), bad input, Lightning, CPU vs GPU."""
from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from lightning_det.optim import AdamWSR, stochastic_round_bf16
from lightning_det.optim import _reference as ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16_ULP_AT_1 = 2.0 ** -7


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    ba, bb = _bits(a).ravel(), _bits(b).ravel()
    bad = np.nonzero(ba != bb)[0]
    if bad.size:
        i = bad[:8]
        raise AssertionError(f"{what}: {bad.size} of {ba.size} elements differ; first at {i.tolist()}: "
                             f"{a.detach().cpu().flatten()[i].tolist()} vs {b.detach().cpu().flatten()[i].tolist()}")


def set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    if g.dtype != p.dtype and hasattr(p, "grad_dtype"):
        p.grad_dtype = None  # torch >= 2.10 refuses a grad of another dtype unless asked
    p.grad = g


# --------------------------------------------------------------------------- Philox
@pytest.mark.parametrize("ctr,key,expect", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answer_vectors(ctr, key, expect):
    # Random123 kat_vectors for philox4x32_10.
    assert ref.philox4x32_10(ctr, key) == expect
    c = [np.array([x], dtype=np.uint64) for x in ctr]
    assert tuple(int(w[0]) for w in ref._philox_np(*c, *key)) == expect


@pytest.mark.parametrize("seed,step,base", [(0, 0, 0), (1, 1, 3), (2**64 - 1, 2**40 + 5, 2**35 + 7)])
def test_sr_round_kernel_matches_reference(seed, step, base):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 123, generator=g) * torch.logspace(-30, 30, 123)
    x[0, :4] = torch.tensor([math.inf, -math.inf, math.nan, 3.4028234e38])
    got = stochastic_round_bf16(x, seed, step, base)
    assert_same_bytes(got, ref.sr_round_bf16(x, seed, step, base), "sr_round_bf16 vs reference")
    assert torch.isposinf(got[0, 0]) and torch.isneginf(got[0, 1]) and torch.isnan(got[0, 2])


# --------------------------------------------------------------------------- kernel vs reference
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference_bitwise(pdt, gdt):
    g = torch.Generator().manual_seed(1)
    shapes = [(5, 123), (7,), (3, 3, 3)]
    params = [torch.randn(s, generator=g).to(pdt) for s in shapes]
    ref_params = [p.clone() for p in params]
    hp = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = AdamWSR(params, seed=2**63 + 11, **hp)
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]
    for t in range(1, 6):
        grads = [torch.randn(s, generator=g).to(gdt) for s in shapes]
        for p, gr in zip(params, grads):
            set_grad(p, gr)
        opt.step()
        base = 0
        for i, (p, gr) in enumerate(zip(ref_params, grads)):
            ref.adamw_sr_step(p, gr, m[i], v[i], lr=hp["lr"], beta1=0.8, beta2=0.95, eps=1e-6,
                              weight_decay=0.1, step=t, seed=2**63 + 11, base_index=base)
            base += p.numel()
    for i, p in enumerate(params):
        assert_same_bytes(p, ref_params[i], f"param {i}")
        assert_same_bytes(opt.state[p]["exp_avg"], m[i], f"exp_avg {i}")
        assert_same_bytes(opt.state[p]["exp_avg_sq"], v[i], f"exp_avg_sq {i}")
        assert opt.state[p]["exp_avg"].dtype == torch.float32 and int(opt.state[p]["step"]) == 5


# --------------------------------------------------------------------------- fp32 tracking
def test_fp32_tracks_torch_adamw_100_steps():
    g = torch.Generator().manual_seed(2)
    init = [torch.randn(17, 31, generator=g), torch.randn(31, generator=g), torch.randn(8, 17, generator=g)]
    ours = [p.clone().requires_grad_() for p in init]
    theirs = [p.clone().requires_grad_() for p in init]

    def groups(ps):
        return [{"params": ps[:2], "lr": 2e-3, "weight_decay": 0.05},
                {"params": ps[2:], "lr": 5e-4, "weight_decay": 0.3, "betas": (0.85, 0.99)}]

    a = AdamWSR(groups(ours), eps=1e-8)
    b = torch.optim.AdamW(groups(theirs), eps=1e-8, foreach=False)
    for _ in range(100):
        for p, q in zip(ours, theirs):
            gr = torch.randn(p.shape, generator=g)
            p.grad, q.grad = gr.clone(), gr.clone()
        a.step()
        b.step()
    err = max((p - q).abs().max().item() for p, q in zip(ours, theirs))
    moved = min((p - i).abs().max().item() for p, i in zip(ours, init))
    assert err < 1e-4, err
    assert moved > 1e-2  # the parameters really trained


# --------------------------------------------------------------------------- unbiased rounding
@pytest.mark.parametrize("frac", [2.0 ** -7, 0.25, 0.5, 0.78125])  # exact in fp32 at 1.0
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased(frac, sign):
    n, seeds = 1 << 18, 4
    x = torch.full((n,), sign * (1.0 + frac * BF16_ULP_AT_1), dtype=torch.float64)
    x32 = x.float()
    assert x32.double().equal(x)  # the test value is exact in fp32
    means = [stochastic_round_bf16(x32, seed=s, step=3).double().mean().item() for s in range(seeds)]
    mean = sum(means) / seeds
    sigma = BF16_ULP_AT_1 * math.sqrt(frac * (1 - frac) / (n * seeds))
    assert abs(mean - x[0].item()) < 5 * sigma + 1e-12, (mean, x[0].item(), sigma)
    nearest = x32.to(torch.bfloat16).double().mean().item()
    assert abs(nearest - x[0].item()) > 50 * sigma  # round-to-nearest is biased: the control


# --------------------------------------------------------------------------- sub-ULP training
def test_sub_ulp_updates_accumulate_only_with_stochastic_rounding():
    n, steps, target = 2048, 6000, 1.5
    lr = BF16_ULP_AT_1 / 40  # Adam's step is ~lr for a steady gradient: 40x below one ULP at 1.0
    sr = torch.ones(n, dtype=torch.bfloat16)
    rn = torch.ones(n, dtype=torch.bfloat16)
    opt = AdamWSR([sr], lr=lr, weight_decay=0.0, seed=7)
    m, v = torch.zeros(n), torch.zeros(n)
    probe = torch.ones(1)  # fp32: the size of one update before rounding
    AdamWSR([probe], lr=lr, weight_decay=0.0).step(closure=lambda: set_grad(probe, probe - target))
    assert abs((probe.item() - 1.0) - lr) < 1e-3 * lr  # each update is ULP/40
    for t in range(1, steps + 1):
        set_grad(sr, sr.float() - target)
        opt.step()
        ref.adamw_sr_step(rn, rn.float() - target, m, v, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.0, step=t, seed=0, base_index=0, rounding="nearest")
    assert torch.all(rn == 1.0)  # round-to-nearest drops every update: 1.0000
    mean = sr.double().mean().item()
    assert abs(mean - target) < 0.02, mean  # SR accumulates them all the way to the target


# --------------------------------------------------------------------------- small bf16 model
def _regression_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 16, generator=g)
    w = (torch.rand(1, 16, generator=g) + 1.0) * torch.sign(torch.randn(1, 16, generator=g))
    y = x @ w.T + 0.5
    return x, y


def _train(kind: str, steps: int = 600, lr: float = 4e-3) -> float:
    x, y = _regression_data()
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 1)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    if kind == "fp32-master":
        opt = torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=0.0)
        fwd = lambda: torch.nn.functional.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16())
    else:
        lin = lin.to(torch.bfloat16)
        opt = (AdamWSR(lin.parameters(), lr=lr, weight_decay=0.0) if kind == "sr"
               else torch.optim.AdamW(lin.parameters(), lr=lr, weight_decay=0.0))
        fwd = lambda: lin(x.bfloat16())
    for _ in range(steps):
        opt.zero_grad()
        loss = ((fwd().float() - y) ** 2).mean()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return ((fwd().float() - y) ** 2).mean().item()


def test_bf16_model_sr_outtrains_round_to_nearest_and_nears_fp32_master():
    sr, rn, master = _train("sr"), _train("nearest"), _train("fp32-master")
    # Measured (CPU, torch 2.13): sr 0.58, nearest 5.9, fp32 master 0.54.
    assert sr < rn / 5, (sr, rn)
    assert sr < master * 1.5, (sr, master)


# --------------------------------------------------------------------------- determinism
def _run_bf16(seed: int, steps: int = 4, n: int = 100_003, threads: int | None = None):
    g = torch.Generator().manual_seed(4)
    p = torch.randn(n, generator=g).bfloat16()
    opt = AdamWSR([p], lr=1e-3, seed=seed)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            p.grad = torch.randn(n, generator=g).bfloat16()
            opt.step()
    finally:
        torch.set_num_threads(old)
    return p, opt.state[p]


def test_same_seed_same_bytes_any_thread_count():
    p1, s1 = _run_bf16(5, threads=1)
    p2, s2 = _run_bf16(5, threads=2)
    assert_same_bytes(p1, p2, "param")
    assert_same_bytes(s1["exp_avg"], s2["exp_avg"], "exp_avg")
    assert_same_bytes(s1["exp_avg_sq"], s2["exp_avg_sq"], "exp_avg_sq")


def test_different_seed_different_bytes():
    p1, _ = _run_bf16(5)
    p2, _ = _run_bf16(6)
    assert not torch.equal(p1, p2)
    assert (p1 != p2).float().mean().item() > 0.05


@pytest.mark.parametrize("pdt", [torch.bfloat16, torch.float32])
def test_shards_with_base_index_equal_whole_parameter(pdt):
    g = torch.Generator().manual_seed(5)
    a0 = torch.randn(100, generator=g).to(pdt)
    w0 = torch.randn(37, 29, generator=g).to(pdt)
    cuts = [0, 300, 301, 805, w0.numel()]

    def make(sharded, explicit=True):
        a = a0.clone()
        if not sharded:
            w = w0.clone()
            return [a, w], AdamWSR([a, w], seed=9)
        shards = [w0.flatten()[lo:hi].clone() for lo, hi in zip(cuts, cuts[1:])]
        groups = [{"params": [a]}] + [
            {"params": [s], **({"base_index": 100 + lo} if explicit else {"base_index": 0})}
            for s, lo in zip(shards, cuts)]
        return [a] + shards, AdamWSR(groups, seed=9)

    whole, o1 = make(False)
    parts, o2 = make(True)
    ctrl, o3 = make(True, explicit=False)
    for _ in range(4):
        ga, gw = torch.randn(100, generator=g).to(pdt), torch.randn(37 * 29, generator=g).to(pdt)
        whole[0].grad, whole[1].grad = ga, gw.view(37, 29)
        for ps in (parts, ctrl):
            ps[0].grad = ga
            for s, lo, hi in zip(ps[1:], cuts, cuts[1:]):
                s.grad = gw[lo:hi]
        o1.step(), o2.step(), o3.step()
    assert_same_bytes(whole[1].flatten(), torch.cat(parts[1:]), "sharded param")
    for k in ("exp_avg", "exp_avg_sq"):
        assert_same_bytes(o1.state[whole[1]][k].flatten(), torch.cat([o2.state[s][k] for s in parts[1:]]), k)
    if pdt == torch.bfloat16:  # control: without the right base_index the draws differ
        assert not torch.equal(whole[1].flatten(), torch.cat(ctrl[1:]))


def test_default_base_index_is_cumulative_offset_across_groups():
    g = torch.Generator().manual_seed(6)
    ps = [torch.randn(n, generator=g).bfloat16() for n in (10, 33, 7)]
    grads = [torch.randn(p.shape, generator=g).bfloat16() for p in ps]
    a = [p.clone() for p in ps]
    b = [p.clone() for p in ps]
    oa = AdamWSR([{"params": a[:2]}, {"params": a[2:], "lr": 1e-3}], lr=1e-3, seed=3)
    ob = AdamWSR([{"params": [q], "base_index": off} for q, off in zip(b, (0, 10, 43))], lr=1e-3, seed=3)
    for x, y, gr in zip(a, b, grads):
        x.grad, y.grad = gr, gr
    oa.step(), ob.step()
    for x, y in zip(a, b):
        assert_same_bytes(x, y, "default vs explicit base_index")


def _model_and_opt(seed=11):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(13, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).bfloat16()
    return net, AdamWSR(net.parameters(), lr=1e-2, seed=seed)


def _train_steps(net, opt, start, stop):
    for t in range(start, stop):
        g = torch.Generator().manual_seed(100 + t)
        x = torch.randn(8, 13, generator=g).bfloat16()
        opt.zero_grad()
        net(x).float().square().mean().backward()
        opt.step()


def test_resume_from_state_dict_continues_bitwise_and_keeps_fp32_moments():
    net, opt = _model_and_opt()
    _train_steps(net, opt, 0, 6)

    net2, opt2 = _model_and_opt()
    _train_steps(net2, opt2, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": net2.state_dict(), "opt": opt2.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    net3, opt3 = _model_and_opt(seed=999)  # the seed comes back from the checkpoint
    net3.load_state_dict(ck["model"])
    opt3.load_state_dict(ck["opt"])
    for p in net3.parameters():
        st = opt3.state[p]
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
        assert st["step"].dtype == torch.int64 and int(st["step"]) == 3
    assert opt3.param_groups[0]["seed"] == 11
    _train_steps(net3, opt3, 3, 6)
    for (k, p), q in zip(net.named_parameters(), net3.parameters()):
        assert_same_bytes(p, q, k)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_same_bytes(opt.state[p][key], opt3.state[q][key], f"{k}.{key}")


def test_plain_torch_load_state_dict_would_cast_moments_to_bf16():
    # The control for the guard above: torch's base class rounds fp32 moments to the param dtype.
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    sd = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((4,), 1 / 3),
                        "exp_avg_sq": torch.full((4,), 1 / 3)}},
          "param_groups": [{"params": [0], "lr": 1e-3}]}
    plain = torch.optim.AdamW([p])
    plain.load_state_dict(sd)
    assert plain.state[p]["exp_avg"].dtype == torch.bfloat16
    ours = AdamWSR([p])
    ours.load_state_dict({**sd, "param_groups": [{**sd["param_groups"][0], **{k: v for k, v in ours.defaults.items()}, "params": [0]}]})
    assert ours.state[p]["exp_avg"].dtype == torch.float32
    assert ours.state[p]["exp_avg"][0].item() == torch.tensor(1 / 3).item()


def test_closure_is_called_with_grad_enabled():
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamWSR([p], lr=0.1)

    def closure():
        assert torch.is_grad_enabled()
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert torch.all(p < 1.0)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(lr=float("nan")), "lr must be finite"),
    (dict(betas=(1.0, 0.9)), r"betas\[0\] must be in \[0, 1\)"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\] must be in \[0, 1\)"),
    (dict(betas=(0.9,)), "betas must be a pair"),
    (dict(eps=-1e-8), "eps must be >= 0"),
    (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(seed=1.5), "seed must be an int"),
])
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdamWSR([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_parameters_and_gradients_raise():
    with pytest.raises(TypeError, match="complex parameters are not supported"):
        AdamWSR([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="must be floating point, got torch.int64"):
        AdamWSR([torch.zeros(2, dtype=torch.int64)])
    with pytest.raises(TypeError, match="float32 or bfloat16, got torch.float16"):
        AdamWSR([torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))])
    with pytest.raises(ValueError, match="'base_index' must be an int >= 0"):
        AdamWSR([{"params": [torch.nn.Parameter(torch.zeros(2))], "base_index": -1}])
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamWSR(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    p = torch.nn.Parameter(torch.zeros(2))
    opt = AdamWSR([p])
    set_grad(p, torch.zeros(2, dtype=torch.float16))
    with pytest.raises(TypeError, match="gradients must be float32 or bfloat16"):
        opt.step()
    with pytest.raises(TypeError, match="x must be float32"):
        stochastic_round_bf16(torch.zeros(2, dtype=torch.float64), seed=0)


# --------------------------------------------------------------------------- state dicts
def _trained_state(dtype=torch.float32, **kwargs):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6, dtype=dtype).reshape(2, 3))
    opt = AdamWSR([p], lr=1e-2, seed=3, **kwargs)
    set_grad(p, torch.full((2, 3), 0.5, dtype=dtype))
    opt.step()
    return p, opt, opt.state_dict()


def _with_state(sd, **entries):
    st = {**sd["state"][0], **entries}
    return {"state": {0: {k: v for k, v in st.items() if v is not None}}, "param_groups": sd["param_groups"]}


def test_powi_refuses_a_negative_exponent_instead_of_looping():
    import threading
    from lightning_det.optim.adamw_sr import _powi

    outcome = []

    def run():
        try:
            _powi(0.9, -2)
        except ValueError as e:
            outcome.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=5)
    assert not t.is_alive(), "_powi(0.9, -2) did not return"
    assert outcome and "step count must be an int >= 0" in outcome[0]
    assert _powi(0.9, 5) == 0.9 * ((0.9 * 0.9) * (0.9 * 0.9))  # binary exponentiation, unchanged


@pytest.mark.parametrize("step", [-1, -2, -7, 1.5, torch.tensor(-3), torch.tensor([1, 2]), "two"])
def test_load_state_dict_refuses_a_bad_step_before_step_runs(step):
    p, opt, sd = _trained_state()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match=r"'step' of parameter 0 must be"):
        opt.load_state_dict(_with_state(sd, step=step))
    for k, v in before.items():  # nothing changed
        assert torch.equal(opt.state[p][k], v)


@pytest.mark.parametrize("missing", ["exp_avg_sq", "exp_avg", "step"])
def test_load_state_dict_names_a_missing_entry(missing):
    p, opt, sd = _trained_state()
    with pytest.raises(ValueError, match=f"the state of parameter 0 has no '{missing}'"):
        opt.load_state_dict(_with_state(sd, **{missing: None}))


def test_load_state_dict_checks_moments_seed_and_base_index():
    p, opt, sd = _trained_state()
    with pytest.raises(ValueError, match=r"exp_avg of parameter 0 has shape \(3, 2\), the parameter \(2, 3\)"):
        opt.load_state_dict(_with_state(sd, exp_avg=torch.zeros(3, 2)))
    with pytest.raises(ValueError, match="exp_avg_sq of parameter 0 must be float32, got torch.float64"):
        opt.load_state_dict(_with_state(sd, exp_avg_sq=torch.zeros(2, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match="exp_avg of parameter 0 must be a tensor"):
        opt.load_state_dict(_with_state(sd, exp_avg=[0.0] * 6))
    with pytest.raises(ValueError, match=r"unexpected entries \['max_exp_avg_sq'\]"):
        opt.load_state_dict(_with_state(sd, max_exp_avg_sq=torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="state for parameter 5, which no param group lists"):
        opt.load_state_dict({"state": {**sd["state"], 5: sd["state"][0]}, "param_groups": sd["param_groups"]})
    no_seed = [{k: v for k, v in sd["param_groups"][0].items() if k != "seed"}]
    with pytest.raises(ValueError, match="param_groups\\[0\\] has no 'seed'"):
        opt.load_state_dict({"state": sd["state"], "param_groups": no_seed})
    with_base = [{**sd["param_groups"][0], "base_index": 12}]
    with pytest.raises(ValueError, match="'base_index' is 12 in the state dict but None in this optimizer"):
        opt.load_state_dict({"state": sd["state"], "param_groups": with_base})
    # a good state dict still loads, with an integer-valued float step as torch.optim.AdamW saves it
    opt.load_state_dict(_with_state(sd, step=torch.tensor(4.0)))
    assert opt.state[p]["step"].dtype == torch.int64 and int(opt.state[p]["step"]) == 4


def test_plain_adamw_state_is_refused_with_the_way_to_convert_it():
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6).reshape(2, 3))
    plain = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1)
    p.grad = torch.full((2, 3), 0.5)
    plain.step()
    sd = plain.state_dict()
    ours = AdamWSR([p], lr=1e-2, seed=3)
    with pytest.raises(ValueError, match=r"convert_adamw_state_dict\(state_dict, seed=\.\.\.\)"):
        ours.load_state_dict(sd)
    ours.load_state_dict(AdamWSR.convert_adamw_state_dict(sd, seed=3))
    st = ours.state[p]
    assert st["step"].dtype == torch.int64 and int(st["step"]) == 1
    for k in ("exp_avg", "exp_avg_sq"):
        assert st[k].dtype == torch.float32 and torch.equal(st[k], plain.state[p][k])
    assert ours.param_groups[0]["weight_decay"] == 0.1 and ours.param_groups[0]["seed"] == 3
    before = p.detach().clone()
    ours.step()  # continues: step 2's bias corrections
    assert int(ours.state[p]["step"]) == 2 and not torch.equal(p.detach(), before)
    amsgrad = torch.optim.AdamW([p], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad=True, which AdamWSR does not implement"):
        AdamWSR.convert_adamw_state_dict(amsgrad, seed=0)


def test_numpy_integer_seed_is_accepted_and_stored_as_int():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = AdamWSR([p], seed=np.uint64(2**64 - 1))
    assert type(opt.param_groups[0]["seed"]) is int and opt.param_groups[0]["seed"] == 2**64 - 1
    a, b = AdamWSR([p], seed=np.int64(9)), AdamWSR([p], seed=9)
    assert a.param_groups[0]["seed"] == b.param_groups[0]["seed"] == 9
    with pytest.raises(ValueError, match="seed must be an int"):
        AdamWSR([p], seed=np.float64(9.0))


# --------------------------------------------------------------------------- Lightning
def test_lightning_configure_optimizers_bf16_true():
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y.float())

        def configure_optimizers(self):
            return AdamWSR(self.parameters(), lr=1e-2, weight_decay=0.01, seed=1)

    def fit():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        model = Tiny()
        w0 = model.net.weight.detach().clone()
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="bf16-true", max_steps=12,
                            enable_progress_bar=False, logger=False, enable_checkpointing=False,
                            enable_model_summary=False)
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
        return model, trainer, w0

    model, trainer, w0 = fit()
    opt = trainer.optimizers[0]
    assert isinstance(opt, AdamWSR)
    assert model.net.weight.dtype == torch.bfloat16  # no fp32 master copy
    st = opt.state[model.net.weight]
    assert st["exp_avg"].dtype == torch.float32 and int(st["step"]) == 12
    assert not torch.equal(model.net.weight.float(), w0.bfloat16().float())
    model2, _, _ = fit()
    assert_same_bytes(model.net.weight, model2.net.weight, "Lightning rerun")


# --------------------------------------------------------------------------- CUDA
@cuda
@pytest.mark.parametrize("pdt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16])
def test_cpu_and_cuda_give_the_same_bytes(pdt, gdt):
    g = torch.Generator().manual_seed(8)
    # Bases 0, 1000000, 1000615, 2000616: the third is not a multiple of 8 (scalar path).
    shapes = [(1000_000,), (5, 123), (1000_001,), (3, 7)]
    cpu = [torch.randn(s, generator=g).to(pdt) for s in shapes]
    gpu = [p.clone().cuda() for p in cpu]
    oc = AdamWSR(cpu, lr=1e-3, weight_decay=0.05, seed=2**40 + 3)
    og = AdamWSR(gpu, lr=1e-3, weight_decay=0.05, seed=2**40 + 3)
    for _ in range(5):
        for p, q in zip(cpu, gpu):
            gr = (torch.randn(p.shape, generator=g) * 1e-2).to(gdt)
            set_grad(p, gr)
            set_grad(q, gr.cuda())
        oc.step()
        og.step()
    for i, (p, q) in enumerate(zip(cpu, gpu)):
        assert_same_bytes(p, q, f"param {i}")
        for k in ("exp_avg", "exp_avg_sq"):
            assert_same_bytes(oc.state[p][k], og.state[q][k], f"{k} {i}")


@cuda
def test_sr_round_cpu_and_cuda_give_the_same_bytes():
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(9))
    assert_same_bytes(stochastic_round_bf16(x, 5, 6, 77), stochastic_round_bf16(x.cuda(), 5, 6, 77), "sr")
