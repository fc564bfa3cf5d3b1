"""A small deterministic Lightning run for the digest/resume tests (plain Lightning, CPU).

Usable in-process (``run(...)``) or as a script in a fresh process (resume, torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

# Run as a script in a fresh process: make the checkout importable without an install.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_det.callbacks import DigestCallback, ExactResumeCallback
from lightning_det.data import DeterministicSampler
from lightning_det.strategy.checkpoint_io import AtomicCheckpointIO

N_SAMPLES, IN, HID, OUT = 64, 16, 32, 4


class PerturbableLinear(nn.Linear):
    """Test-only: a Linear whose output can be nudged by one ULP in its first element."""

    perturb = False

    def forward(self, x):
        y = super().forward(x)
        if self.perturb:
            with torch.no_grad():
                mask = torch.zeros(y.shape, dtype=torch.bool)
                mask.view(-1)[0] = True
                bumped = torch.nextafter(y.detach(), torch.full_like(y, float("inf")))
            # Out of place, and only the first element: every other value keeps its exact bits.
            y = torch.where(mask, y + (bumped - y.detach()), y)
        return y


class MLP(pl.LightningModule):
    """Dropout exercises the RNG restore; world-size comparisons turn it off (per-rank masks
    cannot match a single process's mask). ``optim="adamwsr"`` uses lightning_det's AdamWSR."""

    def __init__(self, lr: float = 1e-2, dropout: bool = True, optim: str = "adamw", det: bool = False) -> None:
        super().__init__()
        self.lr, self.optim, self.det = lr, optim, det
        # det runs use plain nn.Linear, which det_transform swaps for DetLinear (it refuses subclasses)
        lin = nn.Linear if det else PerturbableLinear
        self.net = nn.Sequential(lin(IN, HID), nn.ReLU(), nn.Dropout(0.1) if dropout else nn.Identity(),
                                 lin(HID, HID), nn.Tanh(), lin(HID, OUT))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.det:
            # the global mean over every rank's squared errors: value and gradient world-size invariant
            from lightning_det import global_mean

            d = self(x) - y
            return global_mean(d * d)
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        if self.optim == "adamwsr":
            from lightning_det.optim import AdamWSR

            return AdamWSR(self.parameters(), lr=self.lr, weight_decay=0.01, seed=0)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class PerturbAt(Callback):
    """Test-only: nudge module ``name``'s output by one ULP during optimizer step ``step``."""

    def __init__(self, name: str, step: int) -> None:
        self.name, self.step = name, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.get_submodule(self.name).perturb = trainer.global_step + 1 == self.step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.get_submodule(self.name).perturb = False


class CorruptRank(Callback):
    """Test-only: silently change one weight on one rank before step ``step``."""

    def __init__(self, rank: int, name: str, step: int) -> None:
        self.rank, self.name, self.step = rank, name, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step + 1 == self.step:
            with torch.no_grad():
                pl_module.get_parameter(self.name).view(-1)[0] += 1.0


class KillInSave(AtomicCheckpointIO):
    """Test-only: SIGKILL this process inside the save of checkpoint file ``name``, after its temp
    file is complete and before the rename that would publish it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def before_rename(self, temp) -> None:
        if temp.name.startswith(f".{self.name}.tmp-"):
            os.kill(os.getpid(), signal.SIGKILL)


def dataset(seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, IN, generator=g)
    y = torch.randn(N_SAMPLES, OUT, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def run(dirpath: str, *, max_steps: int, batch_size: int = 8, accumulate: int = 1, ckpt_out: str | None = None,
        ckpt_in: str | None = None, perturb: tuple[str, int] | None = None, capture: tuple[int, int] | None = None,
        replica_check: int = 0, corrupt: tuple[int, str, int] | None = None, digest: bool = True,
        devices: int = 1, strategy: str = "auto", seed: int = 0, ckpt_every: int = 0, dropout: bool = True,
        optim: str = "adamw", det: bool = False, write_lag: int | None = None,
        accelerator: str = "cpu", replica_action: str = "warn", gradient_clip_val: float | None = None,
        extra_callbacks: tuple = (), kill_in_save: str | None = None) -> pl.Trainer:
    torch.use_deterministic_algorithms(True)
    pl.seed_everything(seed, verbose=False)
    model = MLP(dropout=dropout, optim=optim, det=det)
    if det:
        # The exact layers (lead's issue): swap nn.Linear for DetLinear in place.
        from lightning_det.nn import det_transform

        det_transform(model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ds = dataset()
    sampler = DeterministicSampler(len(ds), batch_size, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler)
    cbs: list = [ExactResumeCallback(), *extra_callbacks]
    if perturb:
        cbs.append(PerturbAt(*perturb))
    if corrupt:
        cbs.append(CorruptRank(*corrupt))
    if ckpt_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        cbs.append(ModelCheckpoint(dirpath=os.path.join(dirpath, "ckpts"), filename="s{step}", save_top_k=-1,
                                   every_n_train_steps=ckpt_every, auto_insert_metric_name=False))
    if digest:
        cbs.append(DigestCallback(dirpath, check_replicas_every_n_steps=replica_check, capture_steps=capture,
                                  on_replica_mismatch=replica_action,
                                  write_lag=write_lag))
    plugins = [KillInSave(kill_in_save)] if kill_in_save else None
    trainer = pl.Trainer(max_steps=max_steps, accelerator=accelerator, devices=devices, strategy=strategy,
                         plugins=plugins,
                         accumulate_grad_batches=accumulate, gradient_clip_val=gradient_clip_val, callbacks=cbs, logger=False, enable_checkpointing=bool(ckpt_every),
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         deterministic=True, default_root_dir=dirpath)
    trainer.fit(model, loader, ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return trainer


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirpath")
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ckpt-out")
    p.add_argument("--ckpt-in")
    p.add_argument("--replica-check", type=int, default=0)
    p.add_argument("--corrupt", help="RANK:PARAM:STEP")
    p.add_argument("--replica-action", default="warn", choices=["warn", "raise"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--no-dropout", action="store_true")
    p.add_argument("--optim", default="adamw", choices=["adamw", "adamwsr"])
    p.add_argument("--det", action="store_true", help="det_transform the model (DetLinear)")
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps into DIRPATH/ckpts")
    p.add_argument("--kill-in-save", help="SIGKILL inside the save of this checkpoint file name (e.g. s4.ckpt)")
    a = p.parse_args(argv)
    corrupt = None
    if a.corrupt:
        r, n, s = a.corrupt.split(":")
        corrupt = (int(r), n, int(s))
    run(a.dirpath, max_steps=a.max_steps, batch_size=a.batch_size, ckpt_out=a.ckpt_out, ckpt_in=a.ckpt_in,
        replica_check=a.replica_check, corrupt=corrupt, devices=a.devices, strategy=a.strategy,
        dropout=not a.no_dropout, optim=a.optim, det=a.det, replica_action=a.replica_action,
        ckpt_every=a.ckpt_every, kill_in_save=a.kill_in_save)


if __name__ == "__main__":
    from lightning_det.parallel.env import run_then_destroy_process_group

    run_then_destroy_process_group(main)
