"""Real GEMM operands for the benchmarks: activations, output gradients and weights of the
example model (examples/gpt_char.py), captured after a short plain fp32 training run on the CPU.

How the values are made (deterministic: fixed seeds, built-in data, no network):
  1. CharGPT (det=False: plain nn.Linear and SDPA) is built with torch.manual_seed(seed) on the
     text of examples/gpt_char.py (standard-library sources, capped at ``max_chars``).
  2. ``steps`` AdamW steps (gpt_char's lr and weight decay) on batches of ``batch`` windows drawn
     with a seeded generator, fp32, on the CPU.
  3. One more forward + backward (no optimizer step) on ``capture_batch`` further windows, with a
     forward hook on every nn.Linear: it keeps the layer's input (tokens x in_features) and, through
     a tensor hook on the output, the loss gradient of the output (tokens x out_features). The loss
     is the mean cross-entropy over every token of that batch, as in training.
The capture is cached in this process only (no file). The same interpreter, torch version and
CPU thread count give the same values; the text, and so the values, depend on the Python version
(gpt_char says so), and torch's CPU kernels may change low bits with the thread count. The
results record the Python and torch versions.
"""
from __future__ import annotations

import functools
import importlib.util
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

# small enough to train in seconds on one CPU core; capture_batch * seq_len = 4096 tokens, so the
# wgrad GEMM (K = tokens) needs no tiling up to K = 4096
CAPTURE = dict(d_model=128, n_layers=2, n_heads=4, seq_len=64, batch=16, steps=25, lr=3e-3, weight_decay=0.01,
               capture_batch=64, max_chars=400_000, seed=0)

# how a (rows, cols) operand is formed from a captured (R, C) matrix; the results quote this
FILL_RULE = ("rows sampled with replacement (seeded) from the source rows; columns j = 0..cols-1 take "
             "source column j mod C (the first cols columns when cols <= C, else the row tiled)")

NAMES = {"act": "input activations (tokens x in)", "grad": "output gradients of the mean loss (tokens x out)",
         "weight": "weight (out x in)"}

# the three GEMMs of one Linear layer, as det_gemm(x, w) = x @ w.T: the (x, w) source matrices
GEMMS = {
    "fwd": ("act", "weight"),          # y = a @ W.T: tokens x in, out x in
    "dgrad": ("grad", "weight.T"),     # dA = g @ W: tokens x out, in x out
    "wgrad": ("grad.T", "act.T"),      # dW = g.T @ a: out x tokens, in x tokens
}


def gpt_char_module():
    """examples/gpt_char.py as a module (examples/ is not a package)."""
    name = "_ldet_example_gpt_char"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "gpt_char.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _batch(ds, idx):
    xs, ys = zip(*(ds[int(i)] for i in idx))
    return torch.stack(xs), torch.stack(ys)


def _loss(model, batch, vocab_size):
    x, y = batch
    return F.cross_entropy(model(x).view(-1, vocab_size), y.reshape(-1))


def _hook_linears(model, store):
    """Forward hooks keeping each nn.Linear's input and its output's gradient, by module name."""
    handles = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue

        def fwd(m, inputs, out, name=name):
            store[name] = {"act": inputs[0].detach().reshape(-1, m.in_features).clone(),
                           "weight": m.weight.detach().clone()}
            out.register_hook(lambda g: store[name].__setitem__("grad", g.detach().reshape(-1, m.out_features).clone()))

        handles.append(mod.register_forward_hook(fwd))
    return handles


@functools.lru_cache(maxsize=None)
def capture(**overrides):
    """{"layers": {name: {"act", "grad", "weight"}}, "meta": {...}} from the procedure in the module doc."""
    cfg = dict(CAPTURE, **overrides)
    gpt = gpt_char_module()
    t0 = time.perf_counter()
    vocab, train_ds, _ = gpt.make_data(cfg["seq_len"], cfg["max_chars"], val_windows=1)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(cfg["seed"])
        model = gpt.CharGPT(len(vocab), cfg["seq_len"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"], det=False)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    losses = []
    for _ in range(cfg["steps"]):
        loss = _loss(model, _batch(train_ds, torch.randint(len(train_ds), (cfg["batch"],), generator=g)), len(vocab))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    store: dict = {}
    handles = _hook_linears(model, store)
    try:
        batch = _batch(train_ds, torch.randint(len(train_ds), (cfg["capture_batch"],), generator=g))
        model.zero_grad(set_to_none=True)
        _loss(model, batch, len(vocab)).backward()
    finally:
        for h in handles:
            h.remove()
    meta = dict(cfg, vocab_size=len(vocab), train_windows=len(train_ds), first_loss=losses[0], last_loss=losses[-1],
                tokens=cfg["capture_batch"] * cfg["seq_len"], python=platform.python_version(),
                torch=torch.__version__, seconds=round(time.perf_counter() - t0, 2),
                layers={k: [list(v["act"].shape), list(v["grad"].shape)] for k, v in store.items()})
    return {"layers": store, "meta": meta}


def describe(which: str, shape) -> str:
    base, _, t = which.partition(".")
    return f"{NAMES[base]}{', transposed' if t else ''}: {tuple(shape)}"


def source_matrix(layer: dict, which: str) -> torch.Tensor:
    """One of "act", "grad", "weight" of a captured layer, optionally ".T" (transposed)."""
    base, _, t = which.partition(".")
    m = layer[base]
    return m.t().contiguous() if t == "T" else m


def fill(src: torch.Tensor, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A (rows, cols) matrix of real values from src (R, C), formed as FILL_RULE says."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(src.shape[0], (rows,), generator=g)
    c = torch.arange(cols) % src.shape[1]
    return src[r][:, c].contiguous()


def operands(layer_name: str, gemm: str, M: int, N: int, K: int, seed: int = 1):
    """(x (M, K), w (N, K), source) fp32 CPU tensors for det_gemm(x, w), from the captured layer."""
    layer = capture()["layers"][layer_name]
    xs, ws = (source_matrix(layer, s) for s in GEMMS[gemm])
    x, w = fill(xs, M, K, seed), fill(ws, N, K, seed + 1)
    source = {"layer": layer_name, "gemm": gemm, "x": describe(GEMMS[gemm][0], xs.shape),
              "w": describe(GEMMS[gemm][1], ws.shape), "fill": FILL_RULE, "x_seed": seed, "w_seed": seed + 1}
    return x, w, source
