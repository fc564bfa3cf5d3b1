"""det_ddp on CPU/gloo: world-size, accumulation and clipping invariance, with plain-DDP controls.

Each run is a subprocess (clean environment, timeout, OMP_NUM_THREADS=1) of tests/ddp_harness.py;
Lightning's launcher starts the other ranks. Rank 0 records, after every optimizer step, the
SHA-256 of all weights and the logged (sync_dist) loss.
"""
import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import clean_env

HARNESS = Path(__file__).with_name("ddp_harness.py")
ROOT = HARNESS.parent.parent
MODEL = os.environ.get("LDET_DDP_TEST_MODEL", "mlp")


@lru_cache(maxsize=None)
def run_rows(devices=1, accum=1, strategy="det_ddp", loss="global", clip=0.0, transform=True, model=MODEL, steps=4,
             strict=True, gemm_plans="auto", gemm_path="auto", bn_group=0):
    """The harness's rows (dicts), one per optimizer step."""
    out = Path(os.environ.get("PYTEST_TMP", "/tmp")) / (
        f"ldet-ddp-{model}-{devices}-{accum}-{strategy}-{loss}-{clip}-{transform}-{steps}-{gemm_plans}-{gemm_path}-"
        f"{bn_group}-{os.getpid()}.jsonl")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(HARNESS), "--devices", str(devices), "--accum", str(accum), "--strategy", strategy,
           "--loss", loss, "--clip", str(clip), "--model", model, "--steps", str(steps), "--out", str(out),
           "--gemm-plans", gemm_plans, "--gemm-path", gemm_path, "--bn-group", str(bn_group)]
    if not transform:
        cmd.append("--no-transform")
    if not strict:
        cmd.append("--non-strict")
    proc = subprocess.run(cmd, env=clean_env(MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed ({' '.join(cmd[2:])}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    return tuple(rows)


def run(*args, **kw):
    """(weights SHA-256, loss bytes) of every optimizer step."""
    return tuple((r["weights_sha256"], r["loss_hex"]) for r in run_rows(*args, **kw))


def weights(rows):
    return [w for w, _ in rows]


def losses(rows):
    return [l for _, l in rows]


@pytest.mark.parametrize("devices", [2, 3])  # 4: tests/test_zoo.py
def test_world_size_invariance(devices):
    base = run(1)
    other = run(devices)
    assert weights(other) == weights(base), f"weights differ at world size {devices}"
    assert losses(other) == losses(base), f"logged global losses differ at world size {devices}"


@pytest.mark.parametrize("devices,accum", [(1, 2), (1, 4), (2, 2)])
def test_accumulation_invariance(devices, accum):
    assert weights(run(devices, accum)) == weights(run(1)), f"weights differ with devices={devices} accum={accum}"


def test_plain_mean_loss_power_of_two_world_sizes():
    # The harness's "mean" loss: under det_ddp F.cross_entropy(reduction="mean") is the exact
    # global mean (det_cross_entropy), so the weights match; run non-strict as well, to show the
    # non-strict path keeps that.
    assert weights(run(2, loss="mean", strict=False)) == weights(run(1, loss="mean", strict=False))


@pytest.mark.parametrize("devices,accum", [(2, 1), (1, 2), (2, 2)])
def test_clipping_invariance(devices, accum):
    clipped = run(1, clip=0.05)
    assert weights(clipped) != weights(run(1)), "the clip value must actually clip"
    assert weights(run(devices, accum, clip=0.05)) == weights(clipped)


def test_control_plain_ddp_differs():
    # The same harness with Lightning's own DDP and no transform: world size changes the bits.
    one = run(1, strategy="ddp", transform=False, loss="mean")
    two = run(2, strategy="ddp", transform=False, loss="mean")
    assert weights(one) != weights(two)


def test_strict_mode_raises_on_uncovered_op():
    with pytest.raises(RuntimeError, match=r"(?s)UnverifiedOpError.*outside lightning_det's verified set.*aten\.mm"):
        run(1, transform=False, model="linear", steps=1)


def test_cached_gemm_plans_give_the_same_bytes_and_really_guess():
    # every GEMM on the integer slices (forced: the harness model's GEMMs are below the auto
    # threshold), planned from each call's summaries or from cached guesses
    sync = run_rows(gemm_plans="sync", gemm_path="slices", accum=2)
    cached = run_rows(gemm_plans="cached", gemm_path="slices", accum=2)
    assert [r["weights_sha256"] for r in cached] == [r["weights_sha256"] for r in sync]
    assert [r["loss_hex"] for r in cached] == [r["loss_hex"] for r in sync]
    assert not any(r["plan_guessed"] for r in sync)
    assert all(r["plan_guessed"] for r in cached[1:]), cached  # from the second step every key was seen
    # "auto" on the CPU plans from the summaries
    assert not any(r["plan_guessed"] for r in run_rows(gemm_path="slices", accum=2))


def test_gemm_plans_argument_is_checked():
    from lightning_det.strategy import DeterministicStrategy
    from lightning_det.strategy.det_ddp import gemm_plans_mode

    with pytest.raises(ValueError, match="gemm_plans"):
        DeterministicStrategy(gemm_plans="often")
    assert gemm_plans_mode("auto", "cuda") == "cached" and gemm_plans_mode("auto", "cpu") == "default"
    assert gemm_plans_mode("sync", "cuda") == "sync"


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_clipping_is_exact_under_every_precision_plugin(precision):
    # Lightning picks the precision plugin from `precision=`; under det_ddp, whichever it picks
    # clips by the exact norm (the same bytes as clip_grad_norm_exact_), keeping its own class.
    import pickle

    import torch
    from lightning.pytorch import Trainer

    from lightning_det.optim import clip_grad_norm_exact_
    from lightning_det.strategy.precision import ExactNormClipping

    trainer = Trainer(strategy="det_ddp", accelerator="cpu", devices=1, precision=precision, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, ExactNormClipping) and type(plugin).__name__ == "Exact" + type(plugin).__mro__[2].__name__
    # det_ddp_spawn pickles the Trainer, plugin included
    assert type(pickle.loads(pickle.dumps(trainer.strategy)).precision_plugin) is type(plugin)

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(97, 31, generator=g) * 10.0 ** torch.randint(-3, 3, (97, 1), generator=g) for _ in range(3)]

    def clipped(clip):
        params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
        for p, t in zip(params, grads):
            p.grad = t.clone()
        clip(torch.optim.SGD(params, lr=0.1), params)
        return torch.cat([p.grad.flatten() for p in params])

    got = clipped(lambda opt, ps: plugin.clip_grad_by_norm(opt, 0.5))
    assert torch.equal(got, clipped(lambda opt, ps: clip_grad_norm_exact_(ps, 0.5)))
    # control: torch's clipping (the stock plugin's) gives other bytes on these gradients
    assert not torch.equal(got, clipped(lambda opt, ps: torch.nn.utils.clip_grad_norm_(ps, 0.5)))
