"""A tiny training run whose parameters reach the loss through broadcasts outside any module.

Launched by tests/test_broadcast_grads.py as `python tests/bcast_harness.py --devices N ...` in a
clean subprocess. The model (:class:`BroadcastNet`) has a ViT's ``cls_token.expand`` + ``cat`` and a
sliced ``pos_embed``, GPT-2's ``wte(tokens) + wpe(position_ids)`` with position_ids of shape
(1, T), a layer scale and bias ``h * gamma + beta``, and ``beta`` used a second time. Rank 0
saves every parameter, the optimizer state, each step's loss and the last gradient sync's
statistics (torch.save) to --out.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402

import lightning_det  # noqa: E402,F401  (registers det_ddp)
from lightning_det import global_mean  # noqa: E402

VOCAB, T, D, CLASSES = 23, 5, 8, 4


class BroadcastNet(nn.Module):
    """Every parameter outside the Linear/Embedding/LayerNorm modules is broadcast over the batch."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(T + 2, D)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D))
        self.pos_embed = nn.Parameter(torch.randn(1, T + 3, D) * 0.5)  # sliced to T + 1 below
        self.ln = nn.LayerNorm(D)
        self.gamma = nn.Parameter(torch.rand(D) + 0.5)
        self.beta = nn.Parameter(torch.randn(D) * 0.1)
        self.fc = nn.Linear(D, D)
        self.act = nn.GELU()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, tokens):
        b, t = tokens.shape
        position_ids = torch.arange(t, device=tokens.device).unsqueeze(0)  # (1, T), as HF GPT-2
        h = self.wte(tokens) + self.wpe(position_ids)  # (b) a det module's output, broadcast
        h = torch.cat([self.cls_token.expand(b, -1, -1), h], dim=1)  # (a) the cls token
        h = h + self.pos_embed[:, : t + 1]  # (a), (d) a slice of a parameter
        h = self.ln(h) * self.gamma + self.beta  # (c) layer scale and bias
        h = h + self.act(self.fc(h)) + self.beta  # (e) beta a second time
        return self.head(h[:, 0])


def make_data(n: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (n, T), generator=g)
    y = (x[:, 0] + x[:, -1]) % CLASSES
    return torch.utils.data.TensorDataset(x, y)


class Module(L.LightningModule):
    def __init__(self, transform: bool):
        super().__init__()
        torch.manual_seed(1234)  # the same initial weights at every world size
        self.net = BroadcastNet()
        if transform:
            from lightning_det.nn import det_transform

            # the root's own parameters (cls_token, pos_embed, gamma, beta) are used only through
            # broadcasts, which det_ddp keeps exact; det_transform reports any module holding
            # parameters itself, so the root is left out of its check explicitly
            det_transform(self.net, strict=True, filter_fn=lambda m, fqn: fqn != "")
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = global_mean(F.cross_entropy(self.net(x), y, reduction="none"))
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--strategy", default="det_ddp")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    per_rank = args.global_batch // (args.devices * args.accum)
    assert per_rank * args.devices * args.accum == args.global_batch, "global batch must divide evenly"
    dl = torch.utils.data.DataLoader(make_data(args.global_batch * args.steps), batch_size=per_rank, shuffle=True)
    det = args.strategy == "det_ddp"
    if det:
        from lightning_det.strategy import DeterministicStrategy

        strategy = DeterministicStrategy(strict=True)
    else:
        strategy = "ddp" if args.devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=args.accum, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=False)
    module = Module(transform=det)
    trainer.fit(module, dl)
    if trainer.global_rank == 0:
        opt = trainer.optimizers[0]
        torch.save({
            "params": {n: t.detach().clone() for n, t in module.net.named_parameters()},
            "opt_state": [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
                          for p in module.net.parameters()],
            "losses": module.losses,
            "sync": dict(getattr(trainer.strategy, "det_last_sync", {})),
            "verified": getattr(trainer.strategy, "det_verified", None),
        }, args.out)


if __name__ == "__main__":
    from lightning_det.parallel.env import run_then_destroy_process_group

    run_then_destroy_process_group(main)
