"""det_transform on the classes real models use: HF Conv1D, HF RMSNorms and activations, torch
subclasses; what is matched is the same math, anything else is reported with its class."""
import pytest
import torch
from conftest import assert_bitwise
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import activations as hf_act  # noqa: E402
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from lightning_det.nn import (  # noqa: E402
    DetConv1D, DetGELU, DetLayerNorm, DetLinear, DetRMSNorm, DetSiLU, UnsupportedModuleError, det_transform,
    StepState, finalize_grad_digits, register_det_module, set_grad_digits,
)
from lightning_det.nn import transform as transform_mod  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _conv1d(nf=37, nx=33, seed=0):
    torch.manual_seed(seed)
    m = Conv1D(nf, nx)
    with torch.no_grad():
        m.bias.normal_(generator=_gen(seed + 1))
    return m


def test_conv1d_is_detlinear_on_the_transposed_weight():
    # Independent of DetConv1D's code: a DetLinear holding W.T gives the same bytes for y, dx, dW.T, db.
    hf = _conv1d()
    keys = {k: v.shape for k, v in hf.state_dict().items()}
    det = det_transform(hf)
    assert type(det) is DetConv1D and {k: v.shape for k, v in det.state_dict().items()} == keys
    lin = DetLinear(33, 37)
    with torch.no_grad():
        lin.weight.copy_(det.weight.t())
        lin.bias.copy_(det.bias)
    x = torch.randn(3, 5, 33, generator=_gen(2))
    g = torch.randn(3, 5, 37, generator=_gen(3))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = det(xa), lin(xb)
    ya.backward(g)
    yb.backward(g)
    assert_bitwise(ya.detach(), yb.detach(), "y")
    assert_bitwise(xa.grad, xb.grad, "dx")
    assert_bitwise(det.weight.grad, lin.weight.grad.t().contiguous(), "dW")
    assert_bitwise(det.bias.grad, lin.bias.grad, "db")
    # and it is HF's math: close to HF's own forward in fp64
    ref = x.double().reshape(-1, 33) @ det.weight.double() + det.bias.double()
    torch.testing.assert_close(ya.detach().double(), ref.reshape(3, 5, 37), rtol=1e-6, atol=1e-6)


def test_conv1d_rows_and_micro_batches_are_invariant():
    det = det_transform(_conv1d(seed=4))
    x = torch.randn(64, 33, generator=_gen(5))
    g = torch.randn(64, 37, generator=_gen(6))
    full = det(x)
    for m in (1, 7, 33):
        assert_bitwise(det(x[:m]), full[:m].detach(), f"rows m={m}")
    # digit mode: dW over 64 rows in one go == in micro-batches of 7 + 57 (accumulation)
    state = StepState()
    set_grad_digits(det, state)
    det(x).backward(g)
    finalize_grad_digits(state, det.parameters())
    one = [p.grad.clone() for p in det.parameters()]
    det.zero_grad(set_to_none=True)
    det(x[:7]).backward(g[:7])
    det(x[7:]).backward(g[7:])
    finalize_grad_digits(state, det.parameters())
    for a, p in zip(one, det.parameters()):
        assert_bitwise(p.grad, a, "accumulated grad")
    # control: HF's own Conv1D (addmm) gives other dW bytes for the same split
    hf = _conv1d(seed=4)
    hf(x).backward(g)
    w_one = hf.weight.grad.clone()
    hf.zero_grad()
    hf(x[:7]).backward(g[:7])
    hf(x[7:]).backward(g[7:])
    assert not torch.equal(hf.weight.grad, w_one)


def test_inplace_on_conv1d_output_works():
    det = det_transform(_conv1d(nf=33))
    x = torch.randn(2, 4, 33, requires_grad=True)
    h = det(x)
    h += x  # a residual written in place, as models do
    h.relu_().sum().backward()
    assert x.grad is not None and det.weight.grad is not None


@pytest.mark.parametrize("cls", [LlamaRMSNorm, Qwen2RMSNorm, T5LayerNorm])
def test_hf_rms_norms_become_det_rms_norm(cls):
    m = cls(33, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_(generator=_gen(7))
    x = torch.randn(6, 33, generator=_gen(8))
    want = m(x)
    keys = list(m.state_dict())
    det_transform(nn.Sequential(m))
    assert type(m) is DetRMSNorm and m.eps == 1e-5 and list(m.state_dict()) == keys
    got = m(x)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert_bitwise(m(x[:1]), got[:1].detach(), "row invariance")


def test_gemma_rms_norm_scales_by_one_plus_weight():
    m = GemmaRMSNorm(33, eps=1e-6)
    with torch.no_grad():
        m.weight.normal_(generator=_gen(11))
    x = torch.randn(6, 33, generator=_gen(12))
    want = m(x)
    keys = list(m.state_dict())
    det_transform(nn.Sequential(m))
    assert type(m) is DetRMSNorm and m.weight_offset == 1.0 and m.eps == 1e-6 and list(m.state_dict()) == keys
    got = m(x)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    # the same kernel as a DetRMSNorm holding 1 + weight, and the weight's gradient is that one's
    plain = DetRMSNorm(33, eps=1e-6)
    with torch.no_grad():
        plain.weight.copy_(1.0 + m.weight)
    g = torch.randn(6, 33, generator=_gen(13))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    m(xa).backward(g)
    plain(xb).backward(g)
    assert_bitwise(m(x).detach(), plain(x).detach(), "y")
    assert_bitwise(xa.grad, xb.grad, "dx")
    assert_bitwise(m.weight.grad, plain.weight.grad, "dW")


def test_other_rms_math_is_not_matched():
    # Gemma's forward with another _norm: same structure, other math -> reported, with its class
    class OtherGemmaNorm(GemmaRMSNorm):
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.eps)

    with pytest.raises(UnsupportedModuleError, match=r"0 \(OtherGemmaNorm\)"):
        det_transform(nn.Sequential(OtherGemmaNorm(33)))

    class ScaledRMSNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    with pytest.raises(UnsupportedModuleError, match=r"0 \(ScaledRMSNorm\)"):
        det_transform(nn.Sequential(ScaledRMSNorm(8)))


def test_quick_gelu_relu6_and_sigmoid_are_swapped():
    from lightning_det.nn import DetHardtanh, DetQuickGELU, DetSigmoid

    x = torch.randn(5, 33, generator=_gen(17)) * 4
    for m, cls in ((hf_act.QuickGELUActivation(), DetQuickGELU), (nn.ReLU6(), DetHardtanh),
                   (nn.Hardtanh(-2.0, 3.0), DetHardtanh), (nn.Sigmoid(), DetSigmoid)):
        want = m(x)
        det_transform(nn.Sequential(m))
        assert type(m) is cls
        torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-7)
        assert_bitwise(m(x[:1]), m(x)[:1], f"{cls.__name__} rows")


@pytest.mark.parametrize("make, cls, approximate", [
    (hf_act.SiLUActivation, DetSiLU, None),
    (hf_act.NewGELUActivation, DetGELU, "tanh"),
    (hf_act.GELUActivation, DetGELU, "none"),
    (lambda: hf_act.GELUActivation(use_gelu_python=True), DetGELU, "none"),
    (hf_act.GELUTanh, DetGELU, "tanh"),
    (lambda: hf_act.GELUTanh(use_gelu_tanh_python=True), DetGELU, "tanh"),
])
def test_hf_activations_are_swapped(make, cls, approximate):
    m = make()
    x = torch.randn(5, 33, generator=_gen(9)) * 3
    want = m(x)
    det_transform(nn.Sequential(m))
    assert type(m) is cls
    if approximate is not None:
        assert m.approximate == approximate
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-6)


def test_every_uncovered_module_is_named_with_its_class():
    class OwnNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x / x.norm(dim=-1, keepdim=True) * self.weight

    model = nn.Sequential(nn.Linear(4, 4), hf_act.LaplaceActivation(), nn.Softplus(), nn.Conv3d(1, 1, 1),
                          OwnNorm())
    with pytest.raises(UnsupportedModuleError) as ei:
        det_transform(model)
    msg = str(ei.value)
    for item in ("1 (LaplaceActivation)", "2 (Softplus)", "3 (Conv3d)", "4 (OwnNorm)"):
        assert item in msg, msg
    assert "4 module(s)" in msg and "register_det_module" in msg
    with pytest.warns(UserWarning, match="LaplaceActivation"):
        det_transform(model, strict=False)
    assert model.ldet_unverified == ["1 (LaplaceActivation)", "2 (Softplus)", "3 (Conv3d)", "4 (OwnNorm)"]
    assert type(model[0]) is DetLinear


def test_torch_subclasses_that_keep_forward():
    from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

    class MyLayerNorm(nn.LayerNorm):  # timm-style: only __init__ changes
        def __init__(self, n):
            super().__init__(n, eps=1e-6)

    class OwnForward(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.float()).to(x.dtype)

    class ExtraParam(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

    model = nn.Sequential(NonDynamicallyQuantizableLinear(4, 4), MyLayerNorm(4))
    det_transform(model)
    assert type(model[0]) is DetLinear and type(model[1]) is DetLayerNorm and model[1].eps == 1e-6
    for bad in (OwnForward(4), ExtraParam()):
        with pytest.raises(UnsupportedModuleError, match=rf"0 \({type(bad).__name__}\)"):
            det_transform(nn.Sequential(bad))


def test_register_det_module(monkeypatch):
    monkeypatch.setattr(transform_mod, "_REGISTERED", {})

    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.weight = nn.Parameter(torch.ones(3))  # a layer of its own: reported until registered

    def factory(m):
        new = nn.Sequential(DetLinear(3, 3))
        return new

    model = nn.Sequential(Affine())
    with pytest.raises(UnsupportedModuleError, match=r"0 \(Affine\)"):
        det_transform(model)
    register_det_module(Affine, factory)
    det_transform(model)
    assert isinstance(model[0], nn.Sequential) and type(model[0][0]) is DetLinear
    assert model.ldet_unverified == []
    with pytest.raises(TypeError, match="cls: expected an nn.Module subclass"):
        register_det_module(int, factory)
    with pytest.raises(TypeError, match="factory"):
        register_det_module(Affine, None)
    with pytest.raises(ValueError, match="cls: Linear is already covered"):
        register_det_module(nn.Linear, factory)


def test_tiny_hf_models_transform_strictly():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gpt = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=33, n_positions=16,
                                     bos_token_id=0, eos_token_id=0))
    keys = {k: v.shape for k, v in gpt.state_dict().items()}
    det_transform(gpt)
    assert gpt.ldet_unverified == [] and {k: v.shape for k, v in gpt.state_dict().items()} == keys
    assert type(gpt.transformer.h[0].attn.c_attn) is DetConv1D
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=24,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=33))
    det_transform(llama)
    assert llama.ldet_unverified == []
    assert type(llama.model.norm) is DetRMSNorm and type(llama.model.layers[0].mlp.act_fn) is DetSiLU
    idx = torch.randint(0, 33, (2, 7), generator=_gen(10))
    for model in (gpt, llama):
        model.eval()
        out = model(idx, labels=idx)
        out.loss.backward()
        # the same sequence alone gives the same logits bytes as beside another one
        assert_bitwise(model(idx[:1]).logits, out.logits[:1].detach(), type(model).__name__)


def test_falcon_linear_is_a_det_linear():
    from transformers.models.falcon.modeling_falcon import FalconLinear

    torch.manual_seed(3)
    for bias in (True, False):
        m = FalconLinear(33, 7, bias=bias)
        x = torch.randn(5, 33, generator=_gen(14))
        want = m(x)
        det_transform(nn.Sequential(m))
        assert type(m) is DetLinear
        torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-6)


def test_library_wrappers_run_the_det_module_under_their_own_code():
    # OPT's positions (integer arithmetic, then the embedding), Gemma's scaled embedding, ConvNext's
    # channels-first LayerNorm: the library's forward runs unchanged, super().forward is the Det one
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaTextScaledWordEmbedding
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    from lightning_det.nn import DetEmbedding

    torch.manual_seed(4)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    ids = torch.randint(0, 11, (2, 5), generator=_gen(15))
    img = torch.randn(2, 6, 3, 4, generator=_gen(16))
    cases = [(OPTLearnedPositionalEmbedding(16, 8), (mask,), DetEmbedding),
             (GemmaTextScaledWordEmbedding(11, 8, padding_idx=0, embed_scale=8 ** 0.5), (ids,), DetEmbedding),
             (ConvNextLayerNorm(6, data_format="channels_first"), (img,), DetLayerNorm),
             (ConvNextLayerNorm(4, data_format="channels_last"), (img,), DetLayerNorm)]
    for m, args, det in cases:
        cls = type(m)
        want = m(*args)
        keys = list(m.state_dict())
        det_transform(nn.Sequential(m))
        assert isinstance(m, det) and isinstance(m, cls) and list(m.state_dict()) == keys, type(m).__mro__
        assert type(m).__mro__[1:3] == (cls, det)
        got = m(*args)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
        first = tuple(a[:1] for a in args)
        assert_bitwise(m(*first), got[:1].detach(), f"{cls.__name__}: one sample alone")
    # a transformed model still pickles whole (torch.save(model)) and deep-copies
    import copy
    import io

    model = det_transform(nn.Sequential(OPTLearnedPositionalEmbedding(16, 8)))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for again in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        assert type(again[0]) is type(model[0])
        assert_bitwise(again(mask), model(mask).detach(), "pickled / copied")
    # a changed copy of a wrapper's forward is not recognised
    class OtherPositions(OPTLearnedPositionalEmbedding):
        def forward(self, attention_mask, cache_length=0, position_ids=None):
            return super().forward(attention_mask) * 2

    with pytest.raises(UnsupportedModuleError, match=r"0 \(OtherPositions\)"):
        det_transform(nn.Sequential(OtherPositions(16, 8)))
