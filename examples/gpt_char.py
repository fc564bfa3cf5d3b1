"""A character-level GPT trained on Python's own standard-library sources, under det_ddp or plain DDP.

    python examples/gpt_char.py --devices 2 --steps 20 --digests runs/det-ws2
    python examples/gpt_char.py --devices 1 --steps 20 --digests runs/det-ws1
    lightning-det diff runs/det-ws1 runs/det-ws2          # identical at every step

The model is written the usual way (nn.Embedding for tokens and positions, pre-LN blocks with
nn.LayerNorm, causal multi-head self-attention, a GELU MLP, a final LayerNorm and a Linear head).
With ``--strategy det_ddp`` it goes through ``det_transform`` and its attention is
``DetMultiheadSelfAttention`` (deterministic, batch-invariant); with ``--strategy ddp`` it is the same
model with ``nn.Linear`` + ``F.scaled_dot_product_attention`` and Lightning's own DDP: the
control. Both start from the same weights for the same ``--seed``.

Data: the .py files of a fixed list of standard-library packages (found beside ``os.__file__``),
sorted by path and concatenated, capped at ``--max-chars``; characters are the vocabulary. The
first 90% (by position) is the training text, the last 10% the validation text. The text (and
so the vocabulary) depends on the Python version: compare runs made with the same interpreter.

``--batch-size`` is the GLOBAL batch (sequences per optimizer step); each rank's micro-batch is
``batch_size / (devices * accum)``. See docs/gpt_char.md.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

import lightning as L  # noqa: E402

import lightning_det  # noqa: E402,F401  (registers Trainer(strategy="det_ddp"))
from lightning_det import global_mean  # noqa: E402
from lightning_det.metrics import DetMeanMetric  # noqa: E402
from lightning_det.nn import DetMultiheadSelfAttention, det_transform  # noqa: E402

# Fixed and ordered: the data must be the same bytes in every run on one interpreter.
STDLIB_PACKAGES = ("json", "email", "http", "urllib", "logging", "concurrent", "collections", "html", "wsgiref",
                   "xmlrpc", "asyncio")
VAL_FRACTION = 0.1


# ---- data ---------------------------------------------------------------------------------
def load_text(max_chars: int = 1_500_000) -> str:
    """The concatenated sources of STDLIB_PACKAGES (sorted paths), at most ``max_chars`` characters."""
    root = Path(os.__file__).resolve().parent
    parts, total = [], 0
    for pkg in STDLIB_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(text[: max_chars - total])
            total += len(parts[-1])
            if total >= max_chars:
                return "".join(parts)
    return "".join(parts)


class CharWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` token ids: sample i -> (x, y), y = x shifted by one."""

    def __init__(self, ids: torch.Tensor, seq_len: int, limit: Optional[int] = None) -> None:
        n = (len(ids) - 1) // seq_len
        self.ids, self.seq_len, self.n = ids, seq_len, n if limit is None else min(n, limit)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        w = self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


def make_data(seq_len: int, max_chars: int, val_windows: int):
    text = load_text(max_chars)
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    split = int(len(ids) * (1 - VAL_FRACTION))
    return vocab, CharWindows(ids[:split], seq_len), CharWindows(ids[split:], seq_len, limit=val_windows)


# ---- model --------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    """Causal multi-head self-attention written the usual way (the plain-DDP control).

    Same parameter names and layout as :class:`DetMultiheadSelfAttention`: ``qkv``, ``proj``.
    """

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.dim, self.n_heads = dim, n_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, is_causal: bool = True) -> torch.Tensor:
        b, l, _ = x.shape
        q, k, v = self.qkv(x).view(b, l, 3, self.n_heads, self.dim // self.n_heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return self.proj(y.transpose(1, 2).reshape(b, l, self.dim))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, det: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = DetMultiheadSelfAttention(dim, n_heads) if det else SelfAttention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), is_causal=True)
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """idx (B, L) int64 -> logits (B, L, vocab_size) of the parameters' dtype."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, n_layers: int, n_heads: int, det: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, det) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        for m in self.modules():  # GPT-2 style init (small embeddings), same RNG draws in both variants
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, l = idx.shape
        # positions expanded to (B, L), not broadcast: every position's gradient reaches the
        # embedding's exact row scatter in any loop (a broadcast add of a (1, L, D) output is made
        # exact only inside det_function_mode with a step state, as det_ddp runs the step)
        pos = torch.arange(l, device=idx.device).expand(b, l)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def weights_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---- Lightning ----------------------------------------------------------------------------
class GPTModule(L.LightningModule):
    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        super().__init__()
        self.args, self.vocab_size = args, vocab_size
        self.det = args.strategy == "det_ddp"
        torch.manual_seed(args.seed)  # the same initial weights at every world size and strategy
        self.model = CharGPT(vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads, det=self.det)
        if self.det:
            det_transform(self.model, strict=True)
        # exact state (long-accumulator digits): the synced value is the same at any world size
        self.val_loss = DetMeanMetric()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _token_losses(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x).float()  # exact widening; the loss is computed in fp32
        return F.cross_entropy(logits.view(-1, self.vocab_size), y.reshape(-1), reduction="none")

    def training_step(self, batch, batch_idx):
        losses = self._token_losses(batch)
        # det_ddp: the exact mean over every token of every rank (value and gradient invariant to
        # the split). Plain DDP: the usual per-rank mean, DDP averages the gradients.
        loss = global_mean(losses) if self.det else losses.mean()
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_loss.update(self._token_losses(batch))
        self.log("val_loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)

    def configure_optimizers(self):
        a = self.args
        use_sr = a.optimizer == "adamwsr" or (a.optimizer == "auto" and a.precision == "bf16-true")
        if use_sr:
            from lightning_det.optim import AdamWSR

            # bf16 weights without an fp32 master copy: stochastic rounding keeps small updates
            return AdamWSR(self.parameters(), lr=a.lr, weight_decay=a.weight_decay, seed=a.seed)
        return torch.optim.AdamW(self.parameters(), lr=a.lr, weight_decay=a.weight_decay)


class FinalReport(L.Callback):
    """Rank 0 prints the last losses and the weights' SHA-256 when training ends."""

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank != 0:
            return
        m = trainer.callback_metrics
        parts = [f"steps={trainer.global_step}"]
        for k in ("train_loss", "val_loss"):
            if k in m:
                parts.append(f"{k}={float(m[k]):.6f}")
        parts.append(f"weights_sha256={weights_sha256(pl_module.model)}")
        print("gpt_char: " + " ".join(parts), flush=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--devices", type=int, default=1, help="world size (processes)")
    p.add_argument("--accum", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--strategy", choices=["det_ddp", "ddp"], default="det_ddp")
    p.add_argument("--precision", choices=["32-true", "bf16-true"], default="32-true")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="GLOBAL batch (sequences per optimizer step)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--optimizer", choices=["auto", "adamw", "adamwsr"], default="auto",
                   help="auto: AdamWSR under bf16-true (no master copy), torch AdamW otherwise; "
                        "adamw under bf16-true is the round-to-nearest baseline")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="weights and data order")
    p.add_argument("--val-every", type=int, default=0, help="validate every this many optimizer steps (0: at the end)")
    p.add_argument("--val-windows", type=int, default=96,
                   help="validation sequences (first ones of the validation text); keep it divisible by the world size")
    p.add_argument("--max-chars", type=int, default=1_500_000, help="cap on the training + validation text")
    p.add_argument("--digests", metavar="DIR", help="write per-step digests (lightning_det DigestCallback) here")
    p.add_argument("--log-dir", metavar="DIR", help="CSV logs (train_loss, val_loss per step) here")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per process (0: leave as is)")
    p.add_argument("--no-progress-bar", dest="progress_bar", action="store_false")
    args = p.parse_args(argv)
    per_rank, rem = divmod(args.batch_size, args.devices * args.accum)
    if rem or per_rank == 0:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of devices * accum = "
                f"{args.devices * args.accum}")
    if args.strategy == "det_ddp" and args.val_windows % args.devices:
        # DistributedSampler would pad the validation set with repeats: val_loss would depend on N
        p.error(f"--val-windows {args.val_windows} must be divisible by --devices {args.devices} under det_ddp")
    if args.d_model % args.n_heads:
        p.error(f"--n-heads {args.n_heads} must divide --d-model {args.d_model}")
    args.micro_batch = per_rank
    return args


def main(argv: Optional[Sequence[str]] = None, callbacks: Optional[Sequence[L.Callback]] = None) -> GPTModule:
    """Trains as the command line says; returns the trained LightningModule (on every rank).

    ``callbacks``: extra Lightning callbacks (e.g. benchmarks/multi_gpu.py's timer), run before
    the DigestCallback's hooks."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # python, numpy and torch RNGs: their states are part of the digests (nothing here draws from
    # python/numpy, but an unseeded state would differ between runs)
    L.seed_everything(args.seed, verbose=False)
    vocab, train_ds, val_ds = make_data(args.seq_len, args.max_chars, args.val_windows)
    if args.strategy == "ddp" and args.devices == 1:
        # one process without det_ddp: the same global sample order det_ddp uses, so quality runs
        # compare arithmetic, not data order (Lightning keeps a sampler it is given at one device)
        from lightning_det.data import DeterministicSampler

        sampler = DeterministicSampler(len(train_ds), args.micro_batch, seed=args.seed)
        train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=sampler)
    else:
        train_dl = DataLoader(train_ds, batch_size=args.micro_batch, shuffle=True)  # det_ddp replaces the sampler
    val_dl = DataLoader(val_ds, batch_size=max(1, args.batch_size // args.devices), shuffle=False)

    if args.strategy == "det_ddp":
        from lightning_det.strategy import DeterministicStrategy

        # the seed of its global sample order (DeterministicSampler); strict op audit on step 1
        strategy = DeterministicStrategy(seed=args.seed, strict=True)
    else:
        strategy = "ddp" if args.devices > 1 else "auto"
    callbacks = [FinalReport(), *(callbacks or ())]
    if args.digests:
        from lightning_det.callbacks import DigestCallback

        callbacks.append(DigestCallback(args.digests))
    logger = False
    if args.log_dir:
        from lightning.pytorch.loggers import CSVLogger

        logger = CSVLogger(args.log_dir, name="gpt_char")
    val_every = args.val_every or args.steps
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision,
        max_steps=args.steps, accumulate_grad_batches=args.accum,
        # counted in micro-batches, so scale by accum to validate every `val_every` optimizer steps
        val_check_interval=val_every * args.accum, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_model_summary=False,
        enable_progress_bar=args.progress_bar, callbacks=callbacks,
    )
    module = GPTModule(args, len(vocab))
    if trainer.global_rank == 0:
        print(f"gpt_char: {len(train_ds)} train / {len(val_ds)} val sequences of {args.seq_len}, vocab {len(vocab)}, "
              f"{count_params(module.model):,} parameters, strategy {args.strategy}, world size {args.devices}, "
              f"accum {args.accum}, precision {args.precision}", flush=True)
    trainer.fit(module, train_dl, val_dl)
    return module


if __name__ == "__main__":
    from lightning_det.parallel.env import run_then_destroy_process_group

    run_then_destroy_process_group(main)
