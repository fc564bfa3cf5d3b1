"""examples/gpt_char.py: the transformer is bitwise identical at every step under det_ddp at world
sizes 1, 2, 4 and with accumulation; the plain-DDP control differs; the entry point runs.

Multi-process runs are subprocesses of the example itself (clean environment, timeout,
OMP_NUM_THREADS=1), three at a time; each writes DigestCallback digests (loss, grads, params,
optimizer state, RNG states) for every optimizer step, compared with lightning_det's diff_runs.
The CUDA test (run on the lent GPU machine) compares a CPU and a GPU run step by step.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import cuda

from lightning_det.digest.compare import diff_runs, diff_step, load_run
from tests.test_det_ddp import clean_env
from conftest import env_with_mpi

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gpt_char.py"
STEPS = 5
TINY = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--n-layers", "1",
        "--n-heads", "2", "--max-chars", "200000", "--val-windows", "8", "--no-progress-bar"]
# name -> (strategy, devices, accum, precision)
CONFIGS = {
    "det-ws1": ("det_ddp", 1, 1, "32-true"),
    "det-ws2": ("det_ddp", 2, 1, "32-true"),
    "det-ws4": ("det_ddp", 4, 1, "32-true"),
    "det-ws2-acc2": ("det_ddp", 2, 2, "32-true"),
    "det-bf16-ws1": ("det_ddp", 1, 1, "bf16-true"),  # bf16 weights, AdamWSR
    "det-bf16-ws2": ("det_ddp", 2, 1, "bf16-true"),
    "ddp-ws1": ("ddp", 1, 1, "32-true"),
    "ddp-ws2": ("ddp", 2, 1, "32-true"),
    "ddp-ws4": ("ddp", 4, 1, "32-true"),
}


def _example():
    """examples/gpt_char.py as a module (examples/ is not a package)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import gpt_char
    finally:
        sys.path.pop(0)
    return gpt_char


def _launch(name, root):
    strategy, devices, accum, precision = CONFIGS[name]
    out = root / name
    cmd = [sys.executable, str(EXAMPLE), "--strategy", strategy, "--devices", str(devices), "--accum", str(accum),
           "--precision", precision, "--digests", str(out), *TINY]
    proc = subprocess.run(cmd, env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    final = [line for line in proc.stdout.splitlines() if line.startswith("gpt_char: steps=")]
    return out, final[-1] if final else ""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_char")
    with ThreadPoolExecutor(max_workers=3) as pool:  # runs spend most of their time starting up
        done = dict(zip(CONFIGS, pool.map(lambda n: _launch(n, root), CONFIGS)))
    return {n: (load_run(path), final) for n, (path, final) in done.items()}


def _same(runs, a, b):
    return diff_runs(runs[a][0], runs[b][0], [0])


def _final(runs, name, keys):
    fields = dict(f.split("=", 1) for f in runs[name][1].split()[1:])
    return {k: fields[k] for k in keys}


@pytest.mark.parametrize("base,other", [("det-ws1", "det-ws2"), ("det-ws1", "det-ws4"),
                                        ("det-bf16-ws1", "det-bf16-ws2")])
def test_det_ddp_identical_at_every_step(runs, base, other):
    res = _same(runs, base, other)
    assert res["common_steps"] == STEPS, res
    assert res["identical"], f"{base} vs {other}: first difference {res.get('step')}: {res.get('differences')}"
    # the final line (train/val loss, weights hash) matches too: validation is world-size invariant
    assert runs[base][1] and runs[base][1] == runs[other][1]


def test_det_ddp_accumulation_identical_at_every_step(runs):
    # With accumulate_grad_batches=2 the recorded loss is, as Lightning defines it, the last
    # micro-batch's loss / 2: a different quantity. Everything the step produced must be equal.
    a, b = runs["det-ws1"][0], runs["det-ws2-acc2"][0]
    assert a.step_numbers(0) == b.step_numbers(0) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert all(a.steps[0][s].get(sec) for sec in ("grads", "params", "optim")), "sections must be recorded"
        diffs = [d for d in diff_step(a.steps[0][s], b.steps[0][s]) if d["section"] != "loss"]
        assert not diffs, f"step {s}: {diffs[:5]}"
    keys = ("steps", "val_loss", "weights_sha256")
    assert _final(runs, "det-ws1", keys) == _final(runs, "det-ws2-acc2", keys)


def test_plain_ddp_control_differs(runs):
    res = _same(runs, "ddp-ws1", "ddp-ws2")
    assert res["common_steps"] == STEPS
    assert not res["identical"], "plain DDP at world size 1 and 2 should differ (else the test has no teeth)"
    # ws1 vs ws2 also differ in data order (RandomSampler vs DistributedSampler). At ws2 and ws4
    # DistributedSampler puts the same samples in each global batch, so there only the
    # arithmetic differs (float all-reduce of gradients, per-rank float reductions).
    res = _same(runs, "ddp-ws2", "ddp-ws4")
    assert not res["identical"], "plain DDP at world size 2 and 4 should differ in its arithmetic"
    sections = {d["section"] for d in res["differences"]}
    assert res["step"] == 1 and "grads" in sections, res["differences"][:3]
    # and the control is a different computation from det_ddp's, not a broken run
    assert not _same(runs, "ddp-ws1", "det-ws1")["identical"]


def test_entry_point_in_process_bf16_adamwsr():
    """main(argv) end to end in this process: bf16-true weights with AdamWSR, world size 1."""
    import torch.distributed as dist

    gpt_char = _example()
    try:
        module = gpt_char.main(["--precision", "bf16-true", "--steps", "2", "--batch-size", "4", "--seq-len", "8",
                                "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--max-chars", "50000",
                                "--val-windows", "4", "--no-progress-bar"])
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    params = list(module.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(torch.isfinite(p.float()).all() for p in params)
    assert module.trainer.global_step == 2
    assert module.trainer.strategy.det_verified is True
    assert torch.isfinite(module.trainer.callback_metrics["val_loss"])


def test_data_split_is_fixed():
    gpt_char = _example()
    vocab, train, val = gpt_char.make_data(16, 20000, 4)
    vocab2, train2, val2 = gpt_char.make_data(16, 20000, 4)
    assert vocab == vocab2 and torch.equal(train.ids, train2.ids) and torch.equal(val.ids, val2.ids)
    assert len(train.ids) + len(val.ids) == 20000 and len(val.ids) == 2000  # 90/10 by position
    x, y = train[3]
    assert torch.equal(x[1:], y[:-1]) and x.shape == (16,)


@cuda
@pytest.mark.parametrize("precision,optimizer", [("32-true", "adamwsr"), ("bf16-true", "auto")])
def test_cuda_step_digests_equal_cpu(tmp_path, precision, optimizer):
    """A whole training step is device invariant: 3 steps at world size 1 on CPU and on CUDA give
    the same loss, gradients, weights and optimizer state at every step (the RNG section holds
    device-specific generator states and is left out). The optimizer is AdamWSR in both: torch's
    AdamW is not promised CPU/CUDA bitwise; det_cross_entropy is what made the loss equal."""
    recs = {}
    for accel in ("cpu", "gpu"):
        out = tmp_path / accel
        cmd = [sys.executable, str(EXAMPLE), "--accelerator", accel, "--precision", precision, "--optimizer", optimizer,
               "--digests", str(out), *TINY[2:], "--steps", "3"]
        proc = subprocess.run(cmd, env=env_with_mpi(), cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{accel} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        recs[accel] = load_run(out).steps[0]
    assert sorted(recs["cpu"]) == sorted(recs["gpu"]) == [1, 2, 3]
    for step in (1, 2, 3):
        a, b = recs["cpu"][step], recs["gpu"][step]
        assert all(a.get(sec) for sec in ("grads", "params", "optim")), "sections must be recorded"
        diffs = [d for d in diff_step(a, b) if d["section"] != "rng"]
        assert not diffs, f"step {step}: cpu vs cuda differ: {diffs[:5]}"
