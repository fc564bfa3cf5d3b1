"""DetMeanMetric / DetSumMetric: exact, and independent of how values are split across updates."""
from fractions import Fraction

import torch

from lightning_det.metrics import DetMeanMetric, DetSumMetric
from lightning_det.reference import longacc_ref as R
from torchmetrics import MeanMetric


def test_mean_is_exact_and_split_invariant():
    g = torch.Generator().manual_seed(0)
    vals = torch.randn(600, generator=g) * torch.pow(2.0, torch.randint(-20, 20, (600,), generator=g).float())
    whole = DetMeanMetric()
    whole.update(vals)
    parts = DetMeanMetric()
    for chunk in torch.tensor_split(vals, [7, 100, 101, 350]):
        parts.update(chunk)
    assert torch.equal(whole.compute(), parts.compute())
    # the exact mean rounded once: the nearest fp32 to the Fraction (ties cannot occur here)
    exact = Fraction(sum(R.scaled_half(v) for v in vals.double().tolist()), 2 ** 149 * 600)
    got = whole.compute()
    neighbours = [torch.nextafter(got, torch.tensor(d)).item() for d in (-1e30, 1e30)]
    assert all(abs(Fraction(got.item()) - exact) < abs(Fraction(n) - exact) for n in neighbours)
    # control: torchmetrics' own MeanMetric changes bits with the split
    a, b = MeanMetric(), MeanMetric()
    a.update(vals)
    for chunk in torch.tensor_split(vals, [7, 100, 101, 350]):
        b.update(chunk)
    assert not torch.equal(a.compute(), b.compute())


def test_sum_metric():
    m = DetSumMetric()
    m.update(torch.tensor([1.0, 2.0 ** -24]))
    m.update(torch.tensor([2.0 ** -60]))
    assert m.compute().item() == 1.0 + 2.0 ** -23  # rounded once, just above the tie
