"""A small training run for the multi-process tests: prints one JSON line per optimizer step.

Launched by tests as `python tests/ddp_harness.py --devices N ...` in a clean subprocess;
Lightning's own launcher starts the other ranks. Rank 0 writes --out (JSON lines):
{"step", "loss_hex", "weights_sha256"} after every optimizer step.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning as L  # noqa: E402

import lightning_det  # noqa: E402,F401  (registers det_ddp)
from lightning_det import global_mean  # noqa: E402


def weights_digest(module, buffers: bool = False) -> str:
    h = hashlib.sha256()
    for name, p in (module.named_buffers() if buffers else module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class TinyResNet(nn.Module):
    """A ResNet-like net on (B, 3, 6, 5) images: Conv2d, BatchNorm2d, ReLU(inplace=True), a 3 x 3
    stride-2 max pool, a residual ``+=``, a strided conv, global average pooling, Linear."""

    def __init__(self, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        self.conv_a, self.bn_a = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv_b, self.bn_b = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.stem(x)
        out = self.relu(self.bn_a(self.conv_a(x)))
        out = self.bn_b(self.conv_b(out))
        out += x
        out = self.relu(out)
        return self.fc(torch.flatten(self.pool(self.down(out)), 1))


class HFCausalLM(nn.Module):
    """A tiny random Hugging Face causal LM (no download) whose forward returns HF's own loss
    (``labels=``): dropouts 0, so ranks draw no masks."""

    def __init__(self, family: str, impl: str, vocab: int):
        super().__init__()
        if family == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(vocab_size=vocab, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=impl)
            self.lm = GPT2LMHeadModel(cfg)
        else:  # 4 query heads over 2 key/value heads: grouped-query attention
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=8, attn_implementation=impl)
            self.lm = LlamaForCausalLM(cfg)

    def forward(self, x):
        return self.lm(input_ids=x, labels=x).loss


def make_model(kind: str, vocab: int, dim: int, classes: int) -> nn.Module:
    if kind == "resnet":
        return TinyResNet(classes)
    if kind in ("gpt2-eager", "llama-eager"):
        family, impl = kind.split("-")
        return HFCausalLM(family, impl, vocab)
    if kind == "mlp":  # Embedding -> LayerNorm -> Linear -> GELU -> Linear
        return nn.Sequential(nn.Embedding(vocab, dim), nn.Flatten(), nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 64),
                             nn.GELU(), nn.Linear(64, classes))
    if kind == "linear":  # Linear/ReLU only
        return nn.Sequential(nn.Flatten(), nn.Linear(4 * dim, 64), nn.ReLU(), nn.Linear(64, classes))
    raise ValueError(kind)


class Module(L.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        torch.manual_seed(1234)  # the same initial weights on every rank and world size
        self.net = make_model(args.model, 50, 8, 5)
        if args.transform:
            from lightning_det.nn import det_transform

            det_transform(self.net, strict=True)

    def forward(self, x):
        if self.args.model == "linear":
            x = torch.nn.functional.one_hot(x, 50)[..., :8].float()
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if isinstance(self.net, HFCausalLM):  # HF's own loss: F.cross_entropy inside the model
            loss = self(x)
            self.log("train_loss", loss, sync_dist=True)
            return loss
        logits = self(x)
        if self.args.loss == "global":
            loss = global_mean(F.cross_entropy(logits, y, reduction="none"))
        elif self.args.loss == "mean-ignore":
            # class-0 targets ignored: ranks hold different numbers of counted rows
            loss = F.cross_entropy(logits, torch.where(y == 0, -100, y), ignore_index=-100)
        else:
            loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Recorder(L.Callback):
    def __init__(self, path):
        self.path = path
        self.last = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.last:
            return  # a micro-batch of an accumulation window
        self.last = trainer.global_step
        loss = trainer.callback_metrics["train_loss"].float().item()
        if trainer.global_rank == 0:
            from lightning_det.ops import last_slices_plan

            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss_hex": struct.pack("<f", loss).hex(),
                                    "weights_sha256": weights_digest(pl_module),
                                    "buffers_sha256": weights_digest(pl_module, buffers=True),
                                    # the step's last slice GEMM took a guessed plan (counts not read)
                                    "plan_guessed": last_slices_plan()["residues_x"] == -1}) + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--strategy", default="det_ddp")
    p.add_argument("--model", default="mlp")
    p.add_argument("--loss", default="global", choices=["global", "mean", "mean-ignore"])
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--no-transform", dest="transform", action="store_false")
    p.add_argument("--non-strict", dest="strict", action="store_false")
    p.add_argument("--gemm-plans", default="auto", help="DeterministicStrategy(gemm_plans=...)")
    p.add_argument("--gemm-path", default="auto", help="lightning_det.ops.gemm_path for the whole run")
    p.add_argument("--bn-group", type=int, default=0, help="DeterministicStrategy(batch_norm_group_size=...)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    n = args.global_batch * args.steps  # the same data and order for every configuration
    x = torch.randint(0, 50, (n, 4), generator=g)
    y = (x.sum(1) % 5)
    if args.model == "resnet":  # images whose class is the sign pattern of two pixels
        x = torch.randn(n, 3, 6, 5, generator=g)
        y = ((x[:, 0, 1, 1] > 0).long() * 2 + (x[:, 2, 4, 3] > 0).long()) % 5
    ds = torch.utils.data.TensorDataset(x, y)
    per_rank = args.global_batch // (args.devices * args.accum)
    assert per_rank * args.devices * args.accum == args.global_batch, "global batch must divide evenly"
    dl = torch.utils.data.DataLoader(ds, batch_size=per_rank, shuffle=True)
    strategy = args.strategy if args.strategy != "ddp" or args.devices > 1 else "auto"
    if args.strategy == "det_ddp":
        from lightning_det.strategy import DeterministicStrategy

        strategy = DeterministicStrategy(strict=args.strict, gemm_plans=args.gemm_plans,
                                         batch_norm_group_size=args.bn_group or None)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        accumulate_grad_batches=args.accum, gradient_clip_val=args.clip or None,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Recorder(args.out)], deterministic=False)
    from lightning_det.ops import gemm_path

    with gemm_path(args.gemm_path):
        trainer.fit(Module(args), dl)


if __name__ == "__main__":
    from lightning_det.parallel.env import run_then_destroy_process_group

    run_then_destroy_process_group(main)
