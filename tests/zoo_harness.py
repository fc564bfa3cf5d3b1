"""Trains zoo models (tests/zoo_models.py) a few steps in one launch; one JSON line per model and step.

Launched by tests as `python tests/zoo_harness.py --devices N --models a,b ...` in a clean
subprocess; Lightning's launcher starts the other ranks, and every rank fits the models one after
another. Rank 0 writes --out (JSON lines): {"model", "step", "loss_hex", "params_sha256",
"optim_sha256", "step_s"} after every optimizer step (step_s: wall time from the step's first
micro-batch to its end, synchronized on CUDA; benchmarks/zoo_step.py reads it; the first step's
line also has "unchanged", the parameters that step left as they were), or
{"model", "error"} when a model's run raised.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402
from zoo_models import MORE, ZOO, make_data  # noqa: E402

MODELS = {**ZOO, **MORE}

from lightning_det.optim import AdamWSR  # noqa: E402


def tensors_digest(named) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def optimizer_digest(opt) -> str:
    named = []
    for i, (p, state) in enumerate(opt.state.items()):
        for k, v in sorted(state.items()):
            if isinstance(v, torch.Tensor):
                named.append((f"{i}.{k}", v))
    return tensors_digest(named)


class ZooModule(L.LightningModule):
    def __init__(self, name: str, det: bool):
        super().__init__()
        self.entry, self.det = MODELS[name], det
        torch.manual_seed(1234)  # the same initial weights on every rank and world size
        self.model = self.entry.build()
        if det:
            from lightning_det.nn import det_transform

            det_transform(self.model, strict=True)

    def training_step(self, batch, batch_idx):
        return self.entry.loss(self.model, batch)

    def configure_optimizers(self):
        if self.det:
            return AdamWSR(self.parameters(), lr=1e-2, weight_decay=0.01, seed=3)
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)  # what a plain run uses


class Recorder(L.Callback):
    def __init__(self, path: str, name: str):
        self.path, self.name, self.last, self.t0 = path, name, 0, None
        self.initial = None

    def on_train_start(self, trainer, pl_module):
        self.initial = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    @staticmethod
    def _now(pl_module) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.t0 is None:
            self.t0 = self._now(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last:
            return  # a micro-batch of an accumulation window
        step_s, self.t0 = self._now(pl_module) - self.t0, None
        self.last = trainer.global_step
        if trainer.global_rank != 0:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        extra = {}
        if trainer.global_step == 1:  # parameters the first step left as they were
            extra["unchanged"] = sorted(n for n, p in pl_module.model.named_parameters()
                                        if torch.equal(p.detach(), self.initial[n]))
        with open(self.path, "a") as f:
            f.write(json.dumps({**extra,
                "model": self.name, "step": trainer.global_step,
                "loss_hex": struct.pack("<f", float(loss.detach().float())).hex(),
                "params_sha256": tensors_digest(pl_module.model.named_parameters()),
                "buffers_sha256": tensors_digest(pl_module.model.named_buffers()),
                "optim_sha256": optimizer_digest(trainer.optimizers[0]),
                "step_s": step_s,
            }) + "\n")


def fit(args, name: str) -> None:
    entry = MODELS[name]
    n = args.global_batch * args.steps  # the same data and order for every configuration
    per_rank = args.global_batch // (args.devices * args.accum)
    assert per_rank * args.devices * args.accum == args.global_batch, "global batch must divide evenly"
    dl = torch.utils.data.DataLoader(make_data(entry.data, n), batch_size=per_rank, shuffle=True)
    if args.strategy == "det_ddp":
        from lightning_det.strategy import DeterministicStrategy

        kwargs = {} if args.bn_group is None else {"batch_norm_group_size": args.bn_group}
        strategy = DeterministicStrategy(strict=True, **kwargs)
    else:
        strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=args.accum, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Recorder(args.out, name)])
    trainer.fit(ZooModule(name, det=args.strategy == "det_ddp"), dl)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", required=True, help="comma-separated names from zoo_models.ZOO or MORE")
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--strategy", default="det_ddp", choices=["det_ddp", "ddp"])
    p.add_argument("--bn-group", type=int, default=None, help="DeterministicStrategy(batch_norm_group_size=...)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    for name in args.models.split(","):
        try:
            fit(args, name)
        except Exception as e:  # one model's failure is recorded, the others still run
            if int(os.environ.get("RANK", "0")) == 0:
                with open(args.out, "a") as f:
                    f.write(json.dumps({"model": name, "error": f"{type(e).__name__}: {e}"[:4000],
                                        "trace": traceback.format_exc()[-4000:]}) + "\n")
            if args.devices > 1:
                raise  # the other ranks may be waiting in a collective


if __name__ == "__main__":
    from lightning_det.parallel.env import run_then_destroy_process_group

    run_then_destroy_process_group(main)
