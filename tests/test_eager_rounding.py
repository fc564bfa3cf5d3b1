"""Eager rounding (StepState.eager_rounding): a gradient with one provable contribution is
rounded in the backward instead of held as digits. The bytes must equal the digit path's, and
the digit path's must equal a differently split (micro-batched) computation; every parameter
that may get a second contribution (tied, called twice, checkpointed) must stay on digits."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gen
from conftest import cuda
from lightning_det.nn import DetEmbedding, DetGELU, DetLayerNorm, DetLinear, DetRMSNorm, StepState, set_grad_digits
from lightning_det.parallel.grad_sync import sync_gradients

V, D, B, T = 37, 24, 6, 9


class Net(nn.Module):
    """Every Det module that owns parameters; ``tie`` shares the embedding with the head and
    ``twice`` calls one DetLinear two times; ``ckpt`` runs the MLP under activation checkpointing."""

    def __init__(self, tie=False, twice=False, ckpt=None):
        super().__init__()
        torch.manual_seed(1)
        self.emb = DetEmbedding(V, D, padding_idx=0)
        self.ln = DetLayerNorm(D)
        self.up = DetLinear(D, 3 * D)
        self.act = DetGELU()
        self.down = DetLinear(3 * D, D)
        self.rms = DetRMSNorm(D)
        self.head = DetLinear(D, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.twice, self.ckpt = twice, ckpt

    def mlp(self, h):
        return self.down(self.act(self.up(h)))

    def forward(self, tokens):
        h = self.ln(self.emb(tokens))
        if self.ckpt is None:
            h = h + self.mlp(h)
        else:
            h = h + checkpoint(self.mlp, h, use_reentrant=self.ckpt == "reentrant")
        if self.twice:
            h = h + self.down(self.act(self.up(h)))
        return self.head(self.rms(h))


def _batch(seed=0):
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    w = gen.normal((B, T, V), torch.float32, seed + 1)
    return tokens, w


def _loss(net, tokens, w):
    return (net(tokens) * w).sum()


def _step(net, eager, micro=1, device="cpu"):
    """One step in digit mode, the batch in ``micro`` micro-batches, eager rounding around the
    last; returns (grads by name on the CPU, names held as digits, names rounded eagerly)."""
    net = net.to(device)
    state = StepState()
    set_grad_digits(net, state)
    tokens, w = (t.to(device) for t in _batch())
    rows = B // micro
    for i in range(micro):
        with state.eager_rounding(enabled=eager and i == micro - 1):
            _loss(net, tokens[i * rows:(i + 1) * rows], w[i * rows:(i + 1) * rows]).backward()
    digits = {n for n, p in net.named_parameters() if state.grad_digits(p) is not None}
    eager_names = {n for n, p in net.named_parameters() if state.rounded_grad(p) is not None}
    stats = sync_gradients(list(net.parameters()), state)
    assert stats["eager"] == len(eager_names) and stats["rounded_only"] == 0
    return {n: p.grad.cpu() for n, p in net.named_parameters()}, digits, eager_names


def _assert_same(a, b, what):
    for n in a:
        assert torch.equal(a[n], b[n]), f"{what}: grad of {n} differs"


def test_eager_equals_digits_and_micro_batched_digits():
    eager, held, rounded = _step(Net(), eager=True)
    names = {n for n, _ in Net().named_parameters()}
    assert rounded == names and not held, "every parameter has one use: all must round in the backward"
    digits, held, rounded = _step(Net(), eager=False)
    assert held == names and not rounded
    _assert_same(eager, digits, "eager vs digits")
    split, held, rounded = _step(Net(), eager=True, micro=3)
    assert held == names and not rounded, "earlier micro-batches left digits: nothing may round eagerly"
    _assert_same(eager, split, "one batch (eager) vs three micro-batches")
    # and the non-digit path of the same modules (each module rounds its own dW once)
    net = Net()
    tokens, w = _batch()
    _loss(net, tokens, w).backward()
    _assert_same(eager, {n: p.grad for n, p in net.named_parameters()}, "eager vs non-digit modules")


@cuda
def test_cuda_eager_equals_cuda_digits_and_cpu():
    # the CUDA rounded GEMM (dX kernels' epilogue) against the CUDA digit GEMM plus finalize,
    # and both against the CPU: the same bytes
    eager, held, rounded = _step(Net(), eager=True, device="cuda")
    assert not held and rounded
    digits, held, _ = _step(Net(), eager=False, device="cuda")
    assert held
    _assert_same(eager, digits, "cuda eager vs cuda digits")
    cpu, _, _ = _step(Net(), eager=True)
    _assert_same(eager, cpu, "cuda vs cpu")


def test_control_plain_pytorch_micro_batching_changes_the_bits():
    def plain(micro):
        det = Net()
        net = nn.Sequential()  # same weights, plain modules
        emb = nn.Embedding(V, D, padding_idx=0)
        emb.weight.data.copy_(det.emb.weight.data)
        ln, up, down, rms, head = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(3 * D, D), nn.RMSNorm(D), nn.Linear(D, V, bias=False)
        for a, b in ((ln, det.ln), (up, det.up), (down, det.down), (rms, det.rms), (head, det.head)):
            a.load_state_dict(b.state_dict())
        params = [emb.weight, up.weight, down.weight, head.weight]
        tokens, w = _batch()
        rows = B // micro
        for i in range(micro):
            t = tokens[i * rows:(i + 1) * rows]
            h = ln(emb(t))
            h = h + down(F.gelu(up(h)))
            (head(rms(h)) * w[i * rows:(i + 1) * rows]).sum().backward()
        return [p.grad.clone() for p in params]

    one, three = plain(1), plain(3)
    assert any(not torch.equal(a, b) for a, b in zip(one, three)), "plain fp32 accumulation should differ"


@pytest.mark.parametrize("tie,twice", [(True, False), (False, True), (True, True)])
def test_parameters_with_two_contributions_stay_digits(tie, twice):
    eager, held, rounded = _step(Net(tie=tie, twice=twice), eager=True)
    digits, _, _ = _step(Net(tie=tie, twice=twice), eager=False)
    _assert_same(eager, digits, f"tie={tie} twice={twice}")
    two_uses = ({"emb.weight"} if tie else set()) | ({"up.weight", "up.bias", "down.weight", "down.bias"} if twice else set())
    assert two_uses <= held, f"{two_uses - held} got two contributions but was rounded eagerly"
    assert rounded and not (rounded & two_uses)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_segments(mode):
    eager, held, rounded = _step(Net(ckpt=mode), eager=True)
    digits, _, _ = _step(Net(), eager=False)
    _assert_same(eager, digits, f"checkpoint {mode}")
    # the recompute counts a second forward use: the MLP's biases stay on the digit path, and
    # the weights' one contribution waits for another (a Linear's dW can wait as its operands,
    # StepState.contribute's rows) and is rounded when the backward ends
    assert {"up.bias", "down.bias"} <= held and {"up.weight", "down.weight", "ln.weight"} <= rounded


def test_tied_weight_with_reentrant_checkpoint():
    # The tied weight's first use runs under no_grad (a reentrant checkpoint) and is recomputed
    # in the backward only after the head's contribution came: counted in the no_grad forward
    # anyway, so the head's contribution is not taken for the only one.
    class TiedCkpt(Net):
        def forward(self, tokens):
            zero = torch.zeros(1, requires_grad=True)  # a reentrant checkpoint needs a float input with grad
            h = checkpoint(lambda z: z + self.ln(self.emb(tokens)), zero, use_reentrant=True)
            return self.head(self.rms(h))

    got = {}
    for eager in (True, False):
        net = TiedCkpt(tie=True)
        state = StepState()
        set_grad_digits(net, state)
        tokens, w = _batch()
        with state.eager_rounding(enabled=eager):
            _loss(net, tokens, w).backward()
        if eager:
            assert state.grad_digits(net.emb.weight) is not None, "the tied weight must stay on digits"
            assert state.rounded_grad(net.rms.weight) is not None, "single-use parameters still round eagerly"
        sync_gradients(list(net.parameters()), state)
        got[eager] = {n: p.grad.clone() for n, p in net.named_parameters()}
    _assert_same(got[True], got[False], "tied + reentrant checkpoint")


def test_second_backward_through_retained_graph_raises_not_rounds_twice():
    net = Net()
    state = StepState()
    set_grad_digits(net, state)
    tokens, w = _batch()
    with state.eager_rounding():
        loss = _loss(net, tokens, w)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="eager_rounding=False"):
            loss.backward()
    # without eager rounding the same two backwards add exactly
    net = Net()
    state = StepState()
    set_grad_digits(net, state)
    loss = _loss(net, tokens, w)
    loss.backward(retain_graph=True)
    loss.backward()
    assert sync_gradients(list(net.parameters()), state)["exact"] == len(list(net.parameters()))


def _eager_backward():
    net = Net()
    state = StepState()
    set_grad_digits(net, state)
    tokens, w = _batch()
    with state.eager_rounding():
        _loss(net, tokens, w).backward()
    return net, state


def test_sync_rejects_digits_plus_an_ordinary_grad():
    net, state = _eager_backward()
    net.up.weight.grad = torch.ones_like(net.up.weight)  # as if a plain op had used it too
    with pytest.raises(RuntimeError, match=r"params: a parameter of shape \(72, 24\).*ordinary"):
        sync_gradients(list(net.parameters()), state)
    # an all-zero .grad (zero_grad(set_to_none=False)) adds nothing and is accepted
    net = Net()
    state = StepState()
    set_grad_digits(net, state)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    _loss(net, *_batch()).backward()
    ref, _, _ = _step(Net(), eager=False)
    sync_gradients(list(net.parameters()), state)
    _assert_same({n: p.grad for n, p in net.named_parameters()}, ref, "zeroed .grad")


def test_eager_gradient_refuses_a_cross_rank_reduction():
    from lightning_det.nn import finalize_grad_digits

    net, state = _eager_backward()
    with pytest.raises(RuntimeError, match="eagerly rounded"):
        finalize_grad_digits(state, net.parameters(), reduce=lambda acc: acc)
    with pytest.raises(RuntimeError, match="eager_rounding is only for one process"):
        sync_gradients(list(net.parameters()), state, scale_exp=-1)
