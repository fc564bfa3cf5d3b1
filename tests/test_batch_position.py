"""det_ddp tells the step state where each micro-batch sits in its step's global batch."""
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_det.strategy.det_ddp import DeterministicStrategy
from lightning_det.nn import BatchPosition, current_step_state
import pytest


class _Recorder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        state = current_step_state()
        self.seen.append((state.position, batch[0][:, 0].tolist()))
        return self.lin(batch[0]).sum() * 0  # plain Linear: only positions are under test

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_positions_follow_the_global_order():
    data = torch.arange(24, dtype=torch.float32).repeat_interleave(2).view(24, 2)
    model = _Recorder()
    trainer = pl.Trainer(strategy=DeterministicStrategy(strict=False, audit=False), accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=4, shuffle=False))
    positions = [p for p, _ in model.seen]
    assert positions == [BatchPosition(step=s, offset=o, size=4, global_size=4)
                         for s in range(3) for o in (0, 4)]
    # the two micro-batches of a step hold 8 different samples
    for s in range(3):
        rows = model.seen[2 * s][1] + model.seen[2 * s + 1][1]
        assert len(set(rows)) == 8


def test_position_arguments_are_checked():
    with pytest.raises(ValueError, match="size, global_size"):
        BatchPosition(step=0, offset=0, size=4, global_size=2)
    with pytest.raises(ValueError, match="offset"):
        BatchPosition(step=0, offset=-1, size=4, global_size=4)
