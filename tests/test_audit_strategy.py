"""The first step's audit under det_ddp, in this process at world size 1: the message lists every
op with its count and where it ran (module with class, training_step, or an autograd node), and
the run is labelled unverified whenever the audit found something, strict or not."""
import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_det.nn import det_transform
from lightning_det.parallel import UnverifiedOpError
from lightning_det.strategy import DeterministicStrategy


class _Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        # Softplus left out by filter_fn: an op outside the verified set, inside a module
        self.net = det_transform(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Softplus(), nn.Linear(5, 1)),
                                 filter_fn=lambda m, _fqn: not isinstance(m, nn.Softplus))

    def training_step(self, batch, _idx):
        (x,) = batch
        return self.net(x).square().mean()  # a float mean over the batch, in training_step itself

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy):
    torch.manual_seed(0)
    module = _Net()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(8, 6)), batch_size=4)
    try:
        trainer.fit(module, data)
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return strategy


def _assert_lists_everything(msg):
    for line in ("aten.softplus x1 in 'net.2' (Softplus)",  # the module named with its class
                 "aten.mean x1 in training_step"):  # not "module 'backward'"
        assert line in msg, msg


def test_strict_error_lists_every_op_and_labels_the_run_unverified():
    strategy = DeterministicStrategy(strict=True)
    with pytest.raises(UnverifiedOpError) as ei:
        _fit(strategy)
    _assert_lists_everything(str(ei.value))
    assert strategy.det_verified is False
    assert ("aten.mean", "training_step", 1) in ei.value.violations


def test_non_strict_warns_with_everything_and_det_verified_false():
    with pytest.warns(UserWarning, match="outside lightning_det's verified set") as rec:
        strategy = _fit(DeterministicStrategy(strict=False))
    msg = "\n".join(str(w.message) for w in rec if "verified set" in str(w.message))
    _assert_lists_everything(msg)
    assert strategy.det_verified is False
