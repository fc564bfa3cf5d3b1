"""det_transform: in-place swaps keeping Parameters and state_dict keys, checkpoint round trips,
strict / non-strict handling of modules outside the verified set."""
import io

import pytest
import torch
from torch import nn

import gen
from lightning_det.nn import (
    DET_MODULES,
    VERIFIED_MODULES,
    DetEmbedding,
    DetGELU,
    DetLayerNorm,
    DetLinear,
    DetReLU,
    DetRMSNorm,
    DetSiLU,
    DetTanh,
    UnsupportedModuleError,
    det_transform,
)


class Block(nn.Module):
    def __init__(self, d=33):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(2 * d, d)
        self.gate = nn.SiLU()
        self.rms = nn.RMSNorm(d)
        self.squash = nn.Tanh()
        self.relu = nn.ReLU()

    def forward(self, h):
        h = h + self.fc2(self.act(self.fc1(self.norm(h))))
        return self.relu(self.squash(self.rms(self.gate(h))))


class Model(nn.Module):
    def __init__(self, v=13, d=33):
        super().__init__()
        self.emb = nn.Embedding(v, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.head = nn.Linear(d, v)

    def forward(self, idx):
        return self.head(self.blocks(self.emb(idx)))


class WithParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def _model(seed=0):
    torch.manual_seed(seed)
    return Model()


def test_swaps_in_place_keeping_parameters_and_keys():
    m = _model()
    params = dict(m.named_parameters())
    keys = list(m.state_dict().keys())
    assert det_transform(m) is m
    assert m.ldet_unverified == []
    assert list(m.state_dict().keys()) == keys
    for name, p in m.named_parameters():
        assert p is params[name], name
    expect = {"emb": DetEmbedding, "head": DetLinear, "blocks.0.norm": DetLayerNorm, "blocks.0.fc1": DetLinear,
              "blocks.0.act": DetGELU, "blocks.0.gate": DetSiLU, "blocks.0.rms": DetRMSNorm,
              "blocks.0.squash": DetTanh, "blocks.1.relu": DetReLU}
    mods = dict(m.named_modules())
    for fqn, cls in expect.items():
        assert type(mods[fqn]) is cls, fqn
    assert mods["blocks.0.act"].approximate == "tanh"
    # idempotent
    det_transform(m)
    assert m.ldet_unverified == []


def test_transformed_model_matches_plain_within_rounding():
    plain, det = _model(), det_transform(_model())
    idx = torch.randint(0, 13, (4, 9), generator=torch.Generator().manual_seed(1))
    yp, yd = plain(idx), det(idx)
    torch.testing.assert_close(yd, yp, rtol=1e-4, atol=1e-5)
    yp.square().mean().backward()
    yd.square().mean().backward()
    for (n, a), b in zip(plain.named_parameters(), det.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-6, msg=n)
    # row invariance of the whole transformed model: a sub-batch gives the same bytes
    assert torch.equal(det(idx[:1]), yd[:1].detach())


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


def test_checkpoints_load_both_ways():
    plain = _model(1)
    det = det_transform(_model(2))
    det.load_state_dict(_roundtrip(plain.state_dict()))
    for a, b in zip(plain.state_dict().values(), det.state_dict().values()):
        assert torch.equal(a, b)
    det2 = det_transform(_model(3))
    plain2 = _model(4)
    plain2.load_state_dict(_roundtrip(det2.state_dict()))
    for a, b in zip(det2.state_dict().values(), plain2.state_dict().values()):
        assert torch.equal(a, b)


class OwnForwardLayerNorm(nn.LayerNorm):
    def forward(self, x):  # a covered class whose forward computes something else
        return super().forward(x) * 2


@pytest.mark.parametrize("bad, cls", [(nn.Conv3d(3, 3, 1), "Conv3d"), (OwnForwardLayerNorm(4), "OwnForwardLayerNorm")])
def test_strict_raises_naming_fqn_and_class(bad, cls):
    m = _model()
    m.blocks[1].extra = bad
    with pytest.raises(UnsupportedModuleError, match=rf"blocks\.1\.extra \({cls}\).*strict=False") as ei:
        det_transform(m)
    assert isinstance(ei.value, ValueError)


def test_loose_parameters_are_listed_not_rejected():
    # a user module holding a parameter directly: kept, listed, and checked where it is used
    # (tests/test_broadcast_grads.py: exact under det_ddp through broadcasting functions; an
    # unverified use is refused at run time)
    m = _model()
    m.blocks[1].extra = WithParam()
    det_transform(m)
    assert m.ldet_unverified == []
    assert m.ldet_loose_params == [f"blocks.1.extra.{n}" for n, _ in WithParam().named_parameters()]


def test_non_strict_warns_and_records():
    m = _model()
    m.blocks[0].conv = nn.Conv3d(3, 3, 1)
    m.scale = nn.Parameter(torch.ones(1))  # the root itself holds a parameter: loose, checked at run time
    with pytest.warns(UserWarning, match="unverified"):
        det_transform(m, strict=False)
    assert m.ldet_unverified == ["blocks.0.conv (Conv3d)"]
    assert m.ldet_loose_params == ["scale"]
    assert type(m.head) is DetLinear  # the covered modules were still swapped


def test_filter_fn_selects_modules():
    m = _model()
    m.conv = nn.Conv1d(3, 3, 1)
    det_transform(m, filter_fn=lambda mod, fqn: fqn != "head" and not isinstance(mod, nn.Conv1d))
    assert type(m.head) is nn.Linear and type(m.emb) is DetEmbedding
    assert m.ldet_unverified == []


def test_user_subclasses_are_not_swapped():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    m = nn.Sequential(MyLinear(3, 3))
    with pytest.raises(UnsupportedModuleError, match=r"0 \(MyLinear\)"):
        det_transform(m)


def test_unsupported_embedding_options_raise():
    m = nn.Sequential(nn.Embedding(5, 3, max_norm=1.0))
    with pytest.raises(ValueError, match="max_norm"):
        det_transform(m)


def test_verified_table_covers_every_swap():
    names = {c.__name__ for c in DET_MODULES}
    assert {v["replacement"] for v in VERIFIED_MODULES.values()} == names
    for k, v in VERIFIED_MODULES.items():
        assert "cpu" in v["verified_on"] and v["invariances"]
        if "." not in k:  # a torch.nn class; dotted keys name a library's class
            assert getattr(nn, k).__name__ == k
