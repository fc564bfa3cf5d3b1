"""GPT-2-small training steps on one device, plain PyTorch against det_ddp, in bf16 and fp32.

    python benchmarks/gpt_step.py                 # CUDA, GPT-2-small shape: the binding run
    python benchmarks/gpt_step.py --tiny          # a tiny shape on the CPU, under a minute (a smoke run)
    python benchmarks/gpt_step.py --tie-head --runs plain-bf16,det-bf16   # beside it: the head tied

Model: examples/gpt_char.py's (nn.Embedding tokens and positions, pre-LN blocks with causal
multi-head self-attention and a GELU MLP, a final LayerNorm and a Linear head), d_model 768, 12
layers, 12 heads, seq 1024, micro-batch 8, over a word-level vocabulary of --vocab tokens.

Data: real text, the .py files of Python's standard library (sorted paths, beside os.__file__,
capped at --max-chars), split into words, single punctuation characters and whitespace runs; the
vocabulary is the --vocab - 1 most frequent of those (ties by string) and <unk>. Windows of seq + 1
tokens, taken in one seeded global order (lightning_det.data.DeterministicSampler) by every run.

Runs, in one process, each from the same initial weights (--seed) on the same batches:
  plain-bf16        precision bf16-true, torch.optim.AdamW(fused=True), F.scaled_dot_product_attention
  det-bf16          det_ddp, bf16-true, AdamWSR
  plain-fp32        32-true, TF32 off, torch.optim.AdamW(fused=True)
  det-fp32          det_ddp, 32-true, torch.optim.AdamW
  det-bf16-digest   det-bf16 with DigestCallback every step (params, grads, optimizer state)
The plain runs run with PyTorch's settings as the process found them (det_ddp's strict settings,
which it leaves behind, are undone first), TF32 off.

Per run: the median interval between consecutive optimizer-step ends over the last half of the
steps (steps 20-40 of 40; each step end CUDA-synchronized), tokens/s from it, and the peak memory
(CUDA: torch.cuda.max_memory_allocated since the run started; the CPU has no per-run peak: None).
Writes benchmarks/results/<device>-gpt_step.json (or --out) with every row, the shape, and a
`summary`: bf16_step_ratio and fp32_step_ratio (det / plain step time), bf16_memory_ratio and
fp32_memory_ratio (det / plain peak memory), digest_overhead (det-bf16-digest / det-bf16 step
time - 1).

--tie-head ties the head's weight to the token embedding's (Hugging Face GPT-2's tying: that
weight then has two contributions a step, the head's dW and the embedding's rows) in every run;
it writes <device>-gpt_step_tied.json by default. A shape beside the binding one, never instead.

--gemm-route R runs the det runs' training inside lightning_det.ops.gemm_path(R): every exact GEMM
of the step on route R where it can take it (fp64: the rounded outputs, the forward and dgrad;
the wgrad's digits stay auto's), to compare a route with auto's choices on the whole step. Each
row records its gemm_route. The binding run is auto's; write another route's rows with --out.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

GPT2_SMALL = {"d_model": 768, "n_layers": 12, "n_heads": 12, "seq_len": 1024, "micro_batch": 8, "vocab": 32768,
              "steps": 40, "max_chars": 16_000_000}
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 32, "micro_batch": 2, "vocab": 512, "steps": 6,
        "max_chars": 200_000}
RUNS = [  # name, det_ddp, precision, optimizer
    ("plain-bf16", False, "bf16-true", "adamw_fused"),
    ("det-bf16", True, "bf16-true", "adamwsr"),
    ("plain-fp32", False, "32-true", "adamw_fused"),
    ("det-fp32", True, "32-true", "adamw"),
    ("det-bf16-digest", True, "bf16-true", "adamwsr"),
]
TOKEN = re.compile(r"\w+|[^\w\s]|\s+")


def stdlib_tokens(max_chars: int, vocab: int) -> tuple[torch.Tensor, int]:
    """The standard library's sources as token ids over a vocabulary of ``vocab`` (id vocab-1: <unk>)."""
    root = Path(os.__file__).resolve().parent
    words, total = [], 0
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        text = path.read_text(encoding="utf-8", errors="replace")[: max_chars - total]
        words += TOKEN.findall(text)
        total += len(text)
        if total >= max_chars:
            break
    counts = collections.Counter(words)
    if len(counts) < vocab - 1:
        raise SystemExit(f"--vocab {vocab}: the first {total} characters of the standard library hold only "
                         f"{len(counts)} distinct tokens; raise --max-chars")
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: vocab - 1]
    ids = {w: i for i, (w, _) in enumerate(top)}
    unk = vocab - 1
    return torch.tensor([ids.get(w, unk) for w in words], dtype=torch.int64), len(words)


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of seq + 1 tokens: (input, next-token target)."""

    def __init__(self, ids: torch.Tensor, seq_len: int) -> None:
        self.ids, self.seq_len = ids, seq_len

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def __getitem__(self, i: int):
        w = self.ids[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return w[:-1], w[1:]


def plain_settings():
    """PyTorch's global settings as the process found them, to restore before each plain run."""
    snap = {"det": torch.are_deterministic_algorithms_enabled(), "cudnn_det": torch.backends.cudnn.deterministic,
            "cudnn_bench": torch.backends.cudnn.benchmark,
            "bf16_red": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "fp16_red": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}

    def restore() -> None:
        torch.use_deterministic_algorithms(snap["det"])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = snap["cudnn_det"], snap["cudnn_bench"]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = snap["bf16_red"]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = snap["fp16_red"]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # TF32 off, as specified
        torch.set_float32_matmul_precision("highest")

    return restore


def run(name, det, precision, optimizer, shape, ds, vocab, args, restore_plain, extra_callbacks=(),
        tie_head=False) -> dict:
    """One run of RUNS; ``extra_callbacks`` join the Trainer's (benchmarks/tools/step_timeline.py profiles with one);
    ``tie_head``: the head's weight is the token embedding's."""
    import lightning as L

    import _real_data
    from lightning_det.data import DeterministicSampler

    gpt = _real_data.gpt_char_module()
    cuda = args.device == "cuda"

    class Module(gpt.GPTModule):
        def configure_optimizers(self):
            if optimizer == "adamw_fused":
                return torch.optim.AdamW(self.parameters(), lr=self.args.lr, weight_decay=self.args.weight_decay,
                                         fused=True)
            return super().configure_optimizers()  # AdamWSR for "adamwsr", torch AdamW for "adamw"

    times = []

    class StepEnds(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    if not det:
        restore_plain()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    margs = argparse.Namespace(strategy="det_ddp" if det else "ddp", seq_len=shape["seq_len"], d_model=shape["d_model"],
                               n_layers=shape["n_layers"], n_heads=shape["n_heads"], seed=args.seed, lr=args.lr,
                               weight_decay=0.01, precision=precision,
                               optimizer={"adamwsr": "adamwsr"}.get(optimizer, "adamw"))
    L.seed_everything(args.seed, verbose=False)
    mb = shape["micro_batch"]
    if det:
        from lightning_det.strategy import DeterministicStrategy

        strategy = DeterministicStrategy(seed=args.seed)  # replaces the sampler by its own, same order
        loader = torch.utils.data.DataLoader(ds, batch_size=mb, shuffle=True)
    else:
        strategy = "auto"
        sampler = DeterministicSampler(len(ds), mb, seed=args.seed)  # det_ddp's order at one device
        loader = torch.utils.data.DataLoader(ds, batch_size=mb, sampler=sampler)
    callbacks = [StepEnds(), *extra_callbacks]
    digest_dir = None
    if name.endswith("-digest"):
        from lightning_det.callbacks import DigestCallback

        digest_dir = tempfile.mkdtemp(prefix="gpt_step-digests-")
        callbacks.append(DigestCallback(digest_dir))
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision=precision,
                        max_steps=shape["steps"], limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                        callbacks=callbacks)
    module = Module(margs, vocab)
    if tie_head:
        module.model.head.weight = module.model.tok.weight
    from lightning_det.ops import gemm_path

    t0 = time.perf_counter()
    with gemm_path(args.gemm_route if det else "auto"):  # det_linear's backward keeps the forward's route
        trainer.fit(module, loader)
    wall = time.perf_counter() - t0
    steps = shape["steps"]
    if len(times) != steps:
        raise RuntimeError(f"{name}: {len(times)} optimizer steps recorded, expected {steps}")
    window = [b - a for a, b in zip(times[steps // 2 - 1:], times[steps // 2:])]
    step_s = statistics.median(window)
    row = {"run": name, "det_ddp": det, "precision": precision,
           "optimizer": {"adamw_fused": "torch.optim.AdamW(fused=True)", "adamwsr": "lightning_det AdamWSR",
                         "adamw": "torch.optim.AdamW"}[optimizer],
           "digests": digest_dir is not None, "gemm_route": args.gemm_route if det else None,
           "step_ms": round(step_s * 1e3, 3),
           "step_ms_window": [round(w * 1e3, 3) for w in window],
           "tokens_per_s": round(mb * shape["seq_len"] / step_s, 1),
           "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "parameters": sum(p.numel() for p in module.parameters()), "wall_s": round(wall, 1),
           "final_train_loss": float(trainer.callback_metrics["train_loss"])}
    peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.2f} GiB"
    print(f"{name:16s} step {row['step_ms']:10.2f} ms  {row['tokens_per_s']:10.0f} tokens/s  peak {peak}  "
          f"loss {row['final_train_loss']:.4f}", flush=True)
    del trainer, module, loader
    return row


def _ratio(a, b):
    return None if a is None or b is None else round(a / b, 4)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda (cpu with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a tiny shape (a smoke run, not the benchmark's shape)")
    for k, v in GPT2_SMALL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} ({TINY[k]} with --tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--runs", default=",".join(r[0] for r in RUNS), help="comma list, a subset of the runs")
    p.add_argument("--tie-head", action="store_true", help="the head's weight is the token embedding's (as GPT-2's)")
    p.add_argument("--gemm-route", default="auto", choices=["auto", "kernel", "slices", "fp64"],
                   help="the det runs' exact GEMMs on this route (gemm_path); default auto, the binding run's")
    p.add_argument("--out", default=None, help="results path (default benchmarks/results/<device>-gpt_step.json, "
                   "<device>-gpt_step_tied.json with --tie-head)")
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (--tiny runs on the CPU)")
    shape = {k: getattr(args, k) if getattr(args, k) is not None else (TINY if args.tiny else GPT2_SMALL)[k]
             for k in GPT2_SMALL}
    if shape["steps"] < 4:
        p.error(f"--steps {shape['steps']}: expected at least 4 (the median is over the last half)")
    if shape["d_model"] % shape["n_heads"]:
        p.error(f"--d-model {shape['d_model']} must be a multiple of --n-heads {shape['n_heads']}")
    chosen = args.runs.split(",")
    unknown = set(chosen) - {r[0] for r in RUNS}
    if unknown:
        p.error(f"--runs: unknown {sorted(unknown)}; choose among {[r[0] for r in RUNS]}")
    from _common import write

    t0 = time.perf_counter()
    ids, n_tokens = stdlib_tokens(shape["max_chars"], shape["vocab"])
    ds = Windows(ids, shape["seq_len"])
    need = shape["steps"] * shape["micro_batch"]
    if len(ds) < need:
        raise SystemExit(f"{len(ds)} windows of {shape['seq_len'] + 1} tokens, {need} needed: raise --max-chars")
    unk = float((ids == shape["vocab"] - 1).float().mean())
    print(f"gpt_step: {n_tokens} tokens ({unk:.1%} <unk>), vocab {shape['vocab']}, {len(ds)} windows "
          f"({time.perf_counter() - t0:.0f} s); shape {shape}", flush=True)
    restore_plain = plain_settings()
    rows = [run(*spec, shape, ds, shape["vocab"], args, restore_plain, tie_head=args.tie_head)
            for spec in RUNS if spec[0] in chosen]
    by = {r["run"]: r for r in rows}

    def get(run_name, key):
        return by[run_name][key] if run_name in by else None

    summary = {"bf16_step_ratio": _ratio(get("det-bf16", "step_ms"), get("plain-bf16", "step_ms")),
               "fp32_step_ratio": _ratio(get("det-fp32", "step_ms"), get("plain-fp32", "step_ms")),
               "bf16_memory_ratio": _ratio(get("det-bf16", "peak_bytes"), get("plain-bf16", "peak_bytes")),
               "fp32_memory_ratio": _ratio(get("det-fp32", "peak_bytes"), get("plain-fp32", "peak_bytes")),
               "digest_overhead": None}
    if get("det-bf16-digest", "step_ms") and get("det-bf16", "step_ms"):
        summary["digest_overhead"] = round(by["det-bf16-digest"]["step_ms"] / by["det-bf16"]["step_ms"] - 1, 4)
    model = {"model": "examples/gpt_char.py CharGPT", "tiny": args.tiny, "tied_head": args.tie_head, **shape,
             "tokenizer": "stdlib .py text: words, punctuation, whitespace runs; top vocab-1 + <unk>",
             "tokens": n_tokens, "unk_share": round(unk, 4), "parameters": rows[0]["parameters"] if rows else None}
    out = write("gpt_step_tied" if args.tie_head else "gpt_step", args.device, rows,
                extra={"shape": model, "summary": summary}, path=args.out)
    print(f"summary {summary}\nwrote {out}")


if __name__ == "__main__":
    main()
