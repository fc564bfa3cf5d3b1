"""Gradients of tensors broadcast across the batch outside any det module (lightning_det.nn.broadcast_grads).

A ViT's ``cls_token.expand`` and ``x + pos_embed``, GPT-2's ``wte(x) + wpe(position_ids)`` with
position_ids (1, T), a layer scale ``x * gamma + beta``, a slice ``pos_embed[:, :T]`` and a
parameter used twice: under det_function_mode with a StepState their gradients are exact digits,
so one batch of 8 and micro-batches of 4 + 4 or 8 x 1 give the same bytes (plain autograd does
not). det_ddp runs of models with broadcast parameters: tests/test_zoo.py.
"""
import itertools
from contextlib import nullcontext

import pytest
import torch
from conftest import assert_bitwise, cuda
from torch import nn

import gen
from broadcast_net import CLASSES, T, VOCAB, BroadcastNet
from lightning_det.nn import StepState, det_function_mode, det_transform, finalize_grad_digits, set_grad_digits
from lightning_det.nn.broadcast_grads import BroadcastGradError, exact_reduce_digits
from lightning_det.ops import det_finalize
from lightning_det.reference.longacc_ref import ExactSum, digits_of, round_sum

B = 8
BROADCAST_PARAMS = ("cls_token", "pos_embed", "gamma", "beta", "wpe.weight")


# ---- the exact reduction --------------------------------------------------------------------
@pytest.mark.parametrize("gshape, shape", [
    ((6, 5, 7), (1, 5, 7)),  # pos_embed
    ((6, 5, 7), (7,)),  # a bias or layer scale: leading dims missing
    ((6, 5, 7), (6, 1, 1)),  # inner dims
    ((3, 4, 5), (1, 4, 1)),
    ((4, 3), ()),  # a scalar parameter
    ((2, 3), (2, 3)),  # no broadcast: the values' own digits
])
def test_reduction_equals_the_integer_reference(gshape, shape):
    g = gen.wide_exponents(gshape, -40, 40, torch.float32, seed=len(gshape) + sum(shape))
    got = exact_reduce_digits(g, shape)
    aligned = (1,) * (len(gshape) - len(shape)) + tuple(shape)
    sums = {}
    for i in itertools.product(*(range(n) for n in gshape)):
        o = tuple(0 if a == 1 else k for a, k in zip(aligned, i))[len(gshape) - len(shape):]
        sums.setdefault(o, ExactSum()).add_value(float(g[i]))
    keys = sorted(sums)
    want = torch.tensor([digits_of(sums[k]) for k in keys], dtype=torch.int64).reshape(*shape, -1)
    assert torch.equal(got, want)
    rounded = torch.tensor([round_sum(sums[k]) for k in keys], dtype=torch.float32).reshape(shape)
    assert_bitwise(det_finalize(got), rounded, "rounded once")


def test_reduction_is_split_invariant_where_the_float_sum_is_not():
    g = gen.wide_exponents((64, 3, 5), -30, 30, torch.float32, seed=3)
    whole = exact_reduce_digits(g, (1, 3, 5))
    halves = exact_reduce_digits(g[:32], (1, 3, 5)) + exact_reduce_digits(g[32:], (1, 3, 5))
    from lightning_det.ops import det_normalize

    assert torch.equal(det_normalize(halves), whole)
    # the control: autograd's float sum over the batch depends on the split
    assert not torch.equal(g.sum(0, keepdim=True), g[:32].sum(0, keepdim=True) + g[32:].sum(0, keepdim=True))


def test_reduction_checks_its_arguments():
    with pytest.raises(ValueError, match=r"shape: \(3,\) does not broadcast"):
        exact_reduce_digits(torch.zeros(2, 4), (3,))
    with pytest.raises(TypeError, match="grad: expected float32"):
        exact_reduce_digits(torch.zeros(2, 4, dtype=torch.float64), (4,))


# ---- a model with every kind of broadcast, in one process -------------------------------------
def _net(transform=True):
    torch.manual_seed(1234)
    net = BroadcastNet()
    if transform:
        det_transform(net, filter_fn=lambda m, fqn: fqn != "")
    return net


def _data(seed=0):
    tokens = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))
    w = gen.wide_exponents((B, CLASSES), -20, 20, torch.float32, seed + 1)  # order-sensitive float sums
    return tokens, w


def _det_grads(net, splits, eager=False, device="cpu"):
    """Gradients after one step of micro-batches ``splits`` (row ranges), through the StepState."""
    tokens, w = (t.to(device) for t in _data())
    state = StepState()
    set_grad_digits(net, state)
    for p in net.parameters():
        p.grad = None
    for a, b in splits:
        with state.eager_rounding() if eager else nullcontext():
            with det_function_mode(state=state):
                out = net(tokens[a:b])
            (out * w[a:b]).sum().backward()
    no_float = [n for n, p in net.named_parameters() if p.grad is not None]
    assert not no_float, f"float .grad written for {no_float}"
    assert finalize_grad_digits(state, net.parameters()) == len(list(net.parameters()))
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def _plain_grads(net, splits):
    tokens, w = _data()
    for p in net.parameters():
        p.grad = None
    for a, b in splits:
        (net(tokens[a:b]) * w[a:b]).sum().backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


WHOLE, HALVES, ONES = [(0, B)], [(0, 4), (4, B)], [(i, i + 1) for i in range(B)]


def test_micro_batches_give_the_same_bytes_and_plain_autograd_does_not():
    net = _net()
    whole = _det_grads(net, WHOLE)
    for splits in (HALVES, ONES):
        got = _det_grads(net, splits)
        for n in whole:
            assert_bitwise(got[n], whole[n], f"{n} with micro-batches {splits}")
    # the values are the gradient (plain fp32 autograd agrees to rounding)
    plain_net = _net(transform=False)
    ref = _plain_grads(plain_net, WHOLE)
    for n in whole:
        torch.testing.assert_close(whole[n], ref[n], rtol=1e-4, atol=1e-6 * ref[n].abs().max().item())
    # the control: plain autograd sums the broadcast gradients in float, and the split shows
    split = _plain_grads(plain_net, HALVES)
    differ = [n for n in BROADCAST_PARAMS if not torch.equal(split[n], ref[n])]
    assert differ, "plain autograd gave split-invariant gradients here: the test has no teeth"


@cuda
def test_micro_batches_give_the_same_bytes_on_cuda():
    net = _net().cuda()
    whole = _det_grads(net, WHOLE, device="cuda")
    for splits in (HALVES, ONES):
        got = _det_grads(net, splits, device="cuda")
        for n in whole:
            assert_bitwise(got[n], whole[n], f"cuda: {n} with micro-batches {splits}")


def test_eager_rounding_gives_the_digit_paths_bytes():
    net = _net()
    digits = _det_grads(net, WHOLE)
    eager = _det_grads(net, WHOLE, eager=True)
    for n in digits:
        assert_bitwise(eager[n], digits[n], f"{n}: eager vs digits")


def test_bf16_parameters_are_rounded_once_from_the_exact_sum():
    # a bf16 layer scale broadcast against an fp32 activation: the operand is widened to fp32
    # (exact) and the fp32 gradients' exact sum is rounded once to bf16
    gamma = nn.Parameter(gen.normal((5,), torch.float32, 4).to(torch.bfloat16))
    x = gen.wide_exponents((16, 3, 5), -10, 10, torch.float32, 5)
    state = StepState()
    with det_function_mode(state=state):
        y = x * gamma
    assert y.dtype == torch.float32
    y.backward(torch.ones_like(y))
    assert gamma.grad is None
    sums = [ExactSum() for _ in range(5)]
    for row in x.reshape(-1, 5).tolist():
        for k in range(5):
            sums[k].add_value(row[k])
    finalize_grad_digits(state, [gamma])
    assert_bitwise(gamma.grad, torch.tensor([round_sum(s, torch.bfloat16) for s in sums], dtype=torch.bfloat16))


def test_views_and_repeat_route_into_the_viewed_elements():
    p = nn.Parameter(gen.normal((2, 6, 3), torch.float32, 6))
    x = gen.normal((4, 4, 3), torch.float32, 7)
    state = StepState()
    with det_function_mode(state=state):
        y = x + p[1:, 1:5]  # a slice: rows 1..4 of the second block only
        z = p[:1, :1].repeat(4, 2, 1)  # tiled
    (y.sum() + 3 * z.sum()).backward()
    finalize_grad_digits(state, [p])
    want = torch.zeros(2, 6, 3)
    want[1:, 1:5] = 4.0
    want[0, 0] += 3 * 8.0
    assert_bitwise(p.grad, want, "slice + repeat")


def test_hf_gpt2_position_embedding_is_exact_across_micro_batches():
    # GPT-2 adds wpe(position_ids), position_ids of shape (1, T), to the (B, T, D) token embeddings
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = det_transform(transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa"))
    tokens, _ = _data()
    w = gen.wide_exponents((B, T, VOCAB), -20, 20, torch.float32, 3)

    def grads(splits):
        state = StepState()
        set_grad_digits(model, state)
        for a, b in splits:
            with det_function_mode(state=state):
                logits = model(tokens[a:b]).logits
            (logits * w[a:b]).sum().backward()
        assert all(p.grad is None for p in model.parameters()), "a float .grad was written"
        finalize_grad_digits(state, model.parameters())
        out = {n: p.grad for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad = None
        return out

    whole, halves = grads(WHOLE), grads(HALVES)
    for n in whole:
        assert_bitwise(halves[n], whole[n], n)


# ---- what cannot be routed -------------------------------------------------------------------
class _Derived(nn.Module):
    """A tensor computed from a parameter (not a view of it) broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(1, 4, 8))

    def forward(self, x):
        return x + self.p * 2


def test_strict_names_the_function_shapes_and_grad_fn_chain():
    with pytest.raises(BroadcastGradError) as ei:
        with det_function_mode(state=StepState()):
            _Derived()(torch.randn(3, 4, 8))
    msg = str(ei.value)
    for part in ("Tensor.add broadcasts", "(1, 4, 8)", "(3, 4, 8)", "dimension 0 (the batch)",
                 "MulBackward0 <- _ExactBroadcastBackward <- AccumulateGrad(Parameter (1, 4, 8))", "strict=False"):
        assert part in msg, msg
    # the fix the message suggests: expand the Parameter, then compute at full shape
    m, x, state = _Derived(), torch.randn(3, 4, 8), StepState()
    with det_function_mode(state=state):
        y = x + m.p.expand_as(x) * 2
    y.sum().backward()
    assert m.p.grad is None and finalize_grad_digits(state, [m.p]) == 1
    assert torch.equal(m.p.grad, torch.full((1, 4, 8), 6.0))
    # non-strict: PyTorch's own broadcast (its float sum is for the op audit to report)
    from lightning_det.parallel.audit import OpAudit

    x = torch.randn(3, 4, 8)
    m = _Derived()
    with OpAudit(m) as audit:
        with det_function_mode(strict=False, state=StepState()):
            y = m(x)
        y.sum().backward()
    assert torch.equal(y, x + 2)
    assert ("aten.sum", "backward of AddBackward0", 1) in audit.violations(), audit.violations()


def test_broadcasts_that_do_not_cross_the_batch_are_left_to_pytorch():
    x = torch.randn(3, 4, 8, requires_grad=True)
    with det_function_mode(state=StepState()):
        h = x * 3  # an activation: (3, 4, 8), requires grad, not a Parameter
        a = h - h.amax(-1, keepdim=True)  # a row statistic, broadcast along the last dim
        b = h.repeat(2, 1, 1)  # copies of each sample
        c = h[:1].expand(1, 4, 8)  # batch dimension 1 stays 1
    assert a.grad_fn.name() == "SubBackward0" and b.grad_fn.name() == "RepeatBackward0"
    assert c.grad_fn.name() == "ExpandBackward0"
    with pytest.raises(BroadcastGradError, match=r"Tensor.expand broadcasts a tensor of shape \(1, 4, 8\)"):
        with det_function_mode(state=StepState()):
            h[:1].expand(3, 4, 8)


def test_float64_cannot_be_routed_and_says_so():
    p = nn.Parameter(torch.ones(4, dtype=torch.float64))
    with pytest.raises(BroadcastGradError, match="float64 has no exact digit reduction"):
        with det_function_mode(state=StepState()):
            torch.ones(2, 4, dtype=torch.float64) * p


def test_without_a_state_nothing_is_routed():
    p = nn.Parameter(torch.ones(4))
    with det_function_mode():
        y = torch.ones(2, 4) * p
    y.sum().backward()
    assert torch.equal(p.grad, torch.full((4,), 2.0))


# Multi-process det_ddp runs with broadcast parameters (GPT-2's position embedding, a ViT's
# cls_token and position embedding) at world sizes 1, 2 and 4 and with accumulation: tests/test_zoo.py.

def test_activation_expanded_along_other_dims_gets_the_exact_sum():
    # HF's repeat_kv: (B, Hkv, 1, L, D) -> (B, Hkv, n_rep, L, D). The copies' gradients are summed
    # exactly and rounded once (reference: the exact sum of fp32 values, rounded once by the
    # Python-integer reference); autograd's own float sum is audited, the routed one is not.
    from lightning_det.parallel.audit import OpAudit

    g = torch.Generator().manual_seed(5)
    kv = (torch.randn(2, 2, 1, 3, 4, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 2, 1, 3, 4), generator=g))
          ).requires_grad_()
    up = torch.randn(2, 2, 5, 3, 4, generator=g) * torch.exp2(torch.randint(-20, 20, (2, 2, 5, 3, 4), generator=g))
    with OpAudit(outside="test") as audit:
        with det_function_mode(state=StepState()):
            y = kv.expand(2, 2, 5, 3, 4)
        (y * up).sum().backward()
    assert not [v for v in audit.violations() if v[0] == "aten.sum" and "Expand" in v[1]], audit.violations()
    want = torch.empty_like(kv)
    for idx in itertools.product(*(range(s) for s in kv.shape)):
        b, h, _, l, d = idx
        acc = ExactSum()
        for r in range(5):
            acc.add_value(float(up[b, h, r, l, d]))
        want[idx] = round_sum(acc)
    assert_bitwise(kv.grad, want, "exact sum over the copies")
    plain = kv.detach().clone().requires_grad_()
    (plain.expand(2, 2, 5, 3, 4) * up).sum().backward()
    assert not torch.equal(plain.grad, want)  # the float sum rounds on the way


# ---- an embedding's output at its own shape (gpt_char: tok(idx) + pos(arange.expand(B, T))) ----
class _TokPos(nn.Module):
    def __init__(self, vocab=11, t=5, d=6):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)

    def forward(self, idx):
        b, t = idx.shape
        return self.tok(idx) + self.pos(torch.arange(t, device=idx.device).expand(b, t))


def _tok_pos_grads(net, idx, w, splits):
    state = StepState()
    set_grad_digits(net, state)
    for a, b in splits:
        with det_function_mode(state=state):
            out = net(idx[a:b])
        (out * w[a:b]).sum().backward()
    assert all(p.grad is None for p in net.parameters()), "a float .grad was written"
    finalize_grad_digits(state, net.parameters())
    out = {n: p.grad.clone() for n, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = None
    return out


def test_embedding_output_at_its_own_shape_scatters_the_full_gradient(monkeypatch):
    import lightning_det.nn.broadcast_grads as bg

    torch.manual_seed(3)
    net = det_transform(_TokPos())
    idx = torch.randint(0, 11, (B, 5), generator=torch.Generator().manual_seed(4))
    w = gen.wide_exponents((B, 5, 6), -30, 30, torch.float32, 5)  # order-sensitive float sums
    # both operands take the embedding's own scatter of the full gradient: no (B, T, D, 19)
    # digits of the operand are made
    made = []
    with monkeypatch.context() as m:
        m.setattr(bg, "to_digits", lambda x, real=bg.to_digits: made.append(tuple(x.shape)) or real(x))
        whole = _tok_pos_grads(net, idx, w, WHOLE)
    assert made == []
    for splits in (HALVES, ONES):
        got = _tok_pos_grads(net, idx, w, splits)
        for n in whole:
            assert_bitwise(got[n], whole[n], f"{n} {splits}")
    # the data-movement path, an independent implementation, gives the same bytes
    with monkeypatch.context() as m:
        m.setattr(bg, "_det_op_sink", lambda t, state, shape: None)
        moved = _tok_pos_grads(net, idx, w, WHOLE)
    for n in whole:
        assert_bitwise(moved[n], whole[n], f"{n} moved")
    # control: plain autograd's float sums over the positions depend on the split (a half's sum
    # is added to the other's, where the whole batch sums the rows one after another)
    plain = _TokPos()
    plain.load_state_dict(net.state_dict())

    def plain_grads(splits):
        for p in plain.parameters():
            p.grad = None
        for a, b in splits:
            (plain(idx[a:b]) * w[a:b]).sum().backward()
        return torch.cat([p.grad.flatten() for p in plain.parameters()])

    assert not torch.equal(plain_grads(WHOLE), plain_grads(HALVES))


class _TokPosTwice(_TokPos):
    """The token embedding's output also used outside a route: its own backward runs too."""

    def forward(self, idx):
        b, t = idx.shape
        e = self.tok(idx)
        return e + self.pos(torch.arange(t, device=idx.device).expand(b, t)) + torch.tanh(e)


def _tok_pos_eager_grads(net, idx, w):
    state = StepState()
    set_grad_digits(net, state)
    with state.eager_rounding():
        with det_function_mode(state=state):
            out = net(idx)
        (out * w).sum().backward()
    finalize_grad_digits(state, net.parameters())
    out = {n: p.grad.clone() for n, p in net.named_parameters()}
    for p in net.parameters():
        p.grad = None
    return out


@pytest.mark.parametrize("model", [_TokPos, _TokPosTwice])
def test_embedding_routes_round_eagerly_without_the_vocabulary_digits(monkeypatch, model):
    import lightning_det.nn.embedding as emb

    vocab = 64  # more rows than the 40 positions: only the occurring rows get digits
    torch.manual_seed(5)
    net = det_transform(model(vocab=vocab))
    idx = torch.randint(0, 13, (B, 5), generator=torch.Generator().manual_seed(6)) * 4  # rows 0, 4, .., 48
    w = gen.wide_exponents((B, 5, 6), -30, 30, torch.float32, 7)
    digits = _tok_pos_grads(net, idx, w, WHOLE)
    halves = _tok_pos_grads(net, idx, w, HALVES)
    rows, own_backward = [], []
    real_backward = emb._DetEmbeddingFn.backward
    with monkeypatch.context() as m:
        m.setattr(emb, "scatter_sum_digits", lambda a, i, n, real=emb.scatter_sum_digits: rows.append(n) or real(a, i, n))
        m.setattr(emb._DetEmbeddingFn, "backward",
                  staticmethod(lambda ctx, gy: own_backward.append(1) or real_backward(ctx, gy)))
        eager = _tok_pos_eager_grads(net, idx, w)
    for n in digits:
        assert_bitwise(eager[n], digits[n], f"{n}: eager vs digits")
        assert_bitwise(halves[n], digits[n], f"{n}: halves vs whole")
    if model is _TokPos:
        # rounded at once from the 40 positions' segment sums: no (64, 6, 19) digits
        assert own_backward == [] and vocab not in rows and B * 5 in rows
    else:
        # the output's other use runs the embedding's own backward: two contributions, digits
        assert own_backward == [1] and vocab in rows
    # the rows that never occur are +0.0, as the digit path's
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[idx.unique()] = False
    g = eager["tok.weight"][untouched]
    assert torch.equal(g, torch.zeros_like(g)) and not torch.signbit(g).any()


@cuda
@pytest.mark.parametrize("model", [_TokPos, _TokPosTwice])
def test_embedding_routes_round_eagerly_to_the_cpu_bytes_on_cuda(model):
    torch.manual_seed(5)
    net = det_transform(model(vocab=64))
    idx = torch.randint(0, 13, (B, 5), generator=torch.Generator().manual_seed(6)) * 4
    w = gen.wide_exponents((B, 5, 6), -30, 30, torch.float32, 7)
    cpu = _tok_pos_eager_grads(net, idx, w)
    got = _tok_pos_eager_grads(net.cuda(), idx.cuda(), w.cuda())
    for n in cpu:
        assert_bitwise(got[n].cpu(), cpu[n], f"{n}: cuda vs cpu")


class _TiedTokPos(_TokPos):
    """Hugging Face GPT-2's tying: the head's weight is the token embedding's, so that weight gets
    two contributions (the head's dW, then the embedding's rows)."""

    def __init__(self, vocab=64, t=5, d=6, pad=None):
        super().__init__(vocab, t, d)
        if pad is not None:
            self.tok = nn.Embedding(vocab, d, padding_idx=pad)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        return self.head(super().forward(idx))


class _TiedTokPosTwice(_TiedTokPos):
    """The tied embedding's output also used outside a route: three contributions."""

    def forward(self, idx):
        b, t = idx.shape
        e = self.tok(idx)
        return self.head(e + self.pos(torch.arange(t, device=idx.device).expand(b, t)) + torch.tanh(e))


def _full_digits_grads(monkeypatch, net, idx, w):
    """The gradients through full-shape digits only: every contribution without add_into, rows
    or row_sums, one micro-batch (the reference for the in-place and the row-wise paths)."""
    real_contribute = StepState.contribute
    with monkeypatch.context() as m:
        m.setattr(StepState, "contribute", lambda self, p, d, r, add_into=None, **kw: real_contribute(self, p, d, r))
        return _tok_pos_grads(net, idx, w, WHOLE)


@pytest.mark.parametrize("eager", [False, True])
def test_tied_embedding_rows_add_into_the_heads_digits(monkeypatch, eager):
    import lightning_det.nn.embedding as emb

    vocab = 64
    torch.manual_seed(8)
    net = det_transform(_TiedTokPosTwice(vocab=vocab) if eager else _TiedTokPos(vocab=vocab))
    idx = torch.randint(0, 13, (B, 5), generator=torch.Generator().manual_seed(9)) * 4
    w = gen.wide_exponents((B, 5, vocab), -30, 30, torch.float32, 10)
    rows = []
    with monkeypatch.context() as m:
        m.setattr(emb, "scatter_sum_digits", lambda a, i, n, real=emb.scatter_sum_digits: rows.append(n) or real(a, i, n))
        got = _tok_pos_eager_grads(net, idx, w) if eager else _tok_pos_grads(net, idx, w, HALVES)
    # the rows went into the head's digits: segments of a micro-batch's positions (40, or 20 in
    # halves; eager, three contributions: the route's and the embedding's own backward's), no
    # (64, 6, 19)
    assert vocab not in rows and rows.count(B * 5 if eager else B * 5 // 2) == 2
    full = _full_digits_grads(monkeypatch, net, idx, w)
    for n in full:
        assert_bitwise(got[n], full[n], f"{n}: rows added vs full digits")


def _recording_gemm_partial(monkeypatch, made):
    """lightning_det.ops.linear's ldet ops, with each gemm_partial's row count appended to made."""
    import lightning_det.ops.linear as lin

    real_ops = lin._ops

    class Recording:
        def __getattr__(self, name):
            fn = getattr(real_ops(), name)
            if name != "gemm_partial":
                return fn
            return lambda x, *a: made.append(x.shape[0]) or fn(x, *a)

    monkeypatch.setattr(lin, "_ops", lambda: Recording())


@pytest.mark.parametrize("pad", [None, 4])
def test_tied_head_and_embedding_round_eagerly_without_the_vocabulary_digits(monkeypatch, pad):
    """The head's dW waits for the embedding's rows: only the occurring rows get digits (from both
    contributions), every other row is the head's dW rounded on its own: the digit path's bytes."""
    import lightning_det.nn.embedding as emb

    vocab = 64
    torch.manual_seed(8)
    net = det_transform(_TiedTokPos(vocab=vocab, pad=pad))
    idx = torch.randint(0, 13, (B, 5), generator=torch.Generator().manual_seed(9)) * 4  # rows 0, 4, .., 48
    w = gen.wide_exponents((B, 5, vocab), -30, 30, torch.float32, 10)
    full = _full_digits_grads(monkeypatch, net, idx, w)
    made, rows = [], []
    with monkeypatch.context() as m:
        _recording_gemm_partial(m, made)
        m.setattr(emb, "scatter_sum_digits", lambda a, i, n, real=emb.scatter_sum_digits: rows.append(n) or real(a, i, n))
        eager = _tok_pos_eager_grads(net, idx, w)
    assert made == [B * 5] and vocab not in rows  # the 40 positions' rows, never (64, 6, 19)
    for n in full:
        assert_bitwise(eager[n], full[n], f"{n}: eager vs full digits")
    # rows that do not occur (and the padding row) hold the head's dW alone, rounded once; the
    # occurring rows differ from it by the embedding's rows
    from lightning_det.ops import det_gemm

    x = (net.tok(idx) + net.pos(torch.arange(5).expand(B, 5))).detach()
    head_only = det_gemm(w.reshape(-1, vocab).t().contiguous(), x.reshape(-1, 6).t().contiguous())
    occurring = torch.zeros(vocab, dtype=torch.bool)
    occurring[idx.unique()] = True
    if pad is not None:
        occurring[pad] = False
    assert_bitwise(eager["tok.weight"][~occurring], head_only[~occurring], "rows not occurring: the head's dW")
    assert not torch.equal(eager["tok.weight"][occurring], head_only[occurring])


@cuda
def test_tied_head_and_embedding_round_eagerly_to_the_cpu_bytes_on_cuda():
    vocab = 64
    torch.manual_seed(8)
    net = det_transform(_TiedTokPos(vocab=vocab, pad=4))
    idx = torch.randint(0, 13, (B, 5), generator=torch.Generator().manual_seed(9)) * 4
    w = gen.wide_exponents((B, 5, vocab), -30, 30, torch.float32, 10)
    cpu = _tok_pos_eager_grads(net, idx, w)
    got = _tok_pos_eager_grads(net.cuda(), idx.cuda(), w.cuda())
    for n in cpu:
        assert_bitwise(got[n].cpu(), cpu[n], f"{n}: cuda vs cpu")


def test_a_waiting_contribution_alone_is_rounded_at_the_end():
    """A tied weight whose second counted use brings no contribution (its output is not used):
    the head's dW waited, and is rounded on its own when the eager backward ends."""
    vocab = 64
    torch.manual_seed(8)
    net = det_transform(_TiedTokPos(vocab=vocab))
    idx = torch.randint(0, 13, (B, 5), generator=torch.Generator().manual_seed(9)) * 4
    x = torch.randn(B, 5, 6, generator=torch.Generator().manual_seed(2))
    w = gen.wide_exponents((B, 5, vocab), -30, 30, torch.float32, 10)

    def grads(eager):
        state = StepState()
        set_grad_digits(net, state)
        with state.eager_rounding(enabled=eager):
            with det_function_mode(state=state):
                net.tok(idx)  # a counted use with no backward
                out = net.head(x)
            (out * w).sum().backward()
        finalize_grad_digits(state, net.parameters())
        g = net.head.weight.grad.clone()
        net.head.weight.grad = None
        return g

    assert_bitwise(grads(True), grads(False), "waiting then rounded vs digits")


@pytest.mark.parametrize("pad", [None, 7])
def test_row_sums_added_in_place_equal_the_full_digits(pad):
    from lightning_det.nn.embedding import _add_row_sums, _row_sum_digits
    from lightning_det.ops import det_normalize, scatter_sum_digits

    vocab, n = 50, 30  # fewer positions than rows: the segment path
    gen_idx = torch.Generator().manual_seed(11)
    idx = torch.randint(0, 10, (n,), generator=gen_idx) * 5 + 2  # rows 2, 7 (the padding row), ...
    idx[:3] = torch.tensor([7, 0, 49])
    g = gen.wide_exponents((n, 4), -40, 40, torch.float32, 12)
    prev = scatter_sum_digits(gen.wide_exponents((vocab, 4), -40, 40, torch.float32, 13), torch.arange(vocab), vocab)
    acc = prev.clone()
    _add_row_sums(acc, g, idx, pad)
    want = det_normalize(prev + _row_sum_digits(g, idx, vocab, pad))
    assert torch.equal(det_normalize(acc), want)
    if pad is not None:
        assert torch.equal(det_normalize(acc)[pad], prev[pad])  # the padding row got nothing
    assert not torch.equal(det_normalize(acc), prev)
