"""Deferred input checks (lightning_det.ops.deferred_checks): det_cross_entropy's target check
without a host synchronization in det_ddp's forward, resolved before the optimizer step."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cuda, env_with_mpi

from lightning_det.nn import StepState, StepStateMode, det_cross_entropy
from lightning_det.nn.loss import cross_entropy_rows
from lightning_det.ops.deferred_checks import DeferredChecks

HELPER = Path(__file__).with_name("helpers") / "bad_target_run.py"
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_target_check_same_rows_nan_for_bad_and_raises_on_resolve(device):
    torch.manual_seed(0)
    x = (torch.randn(64, 7) * 4).to(device)
    good = torch.randint(0, 7, (64,)).to(device)
    good[3] = -100  # ignore_index
    ref, valid_ref, n_ref = cross_entropy_rows(x, good)
    checks = DeferredChecks()
    rows, valid, n = cross_entropy_rows(x, good, need_count=False, checks=checks)
    assert n is None and n_ref == 63 and len(checks) == 1
    assert torch.equal(rows.view(torch.int32), ref.view(torch.int32)), "deferred rows differ from the checked ones"
    assert torch.equal(valid, valid_ref)
    checks.resolve()  # all targets valid: passes
    assert len(checks) == 0

    bad = good.clone()
    bad[10], bad[40] = 7, -3
    with pytest.raises(ValueError, match=r"target: 2 value\(s\) outside \[0, 7\)"):
        cross_entropy_rows(x, bad)  # no collector: at once, as before
    rows, _, _ = cross_entropy_rows(x, bad, need_count=False, checks=checks)  # no error yet
    ok = torch.ones(64, dtype=torch.bool, device=device)
    ok[[10, 40]] = False
    assert torch.isnan(rows[~ok]).all(), "rows with a bad target must not look like losses"
    assert torch.equal(rows[ok].view(torch.int32), ref[ok].view(torch.int32))
    with pytest.raises(ValueError, match=r"target: 2 value\(s\) outside \[0, 7\).*e\.g\. 7"):
        checks.resolve()
    checks.resolve()  # resolved once: nothing left


def test_det_cross_entropy_defers_to_the_step_state_of_the_mode_around_it():
    x = torch.randn(8, 5)
    bad = torch.tensor([0, 1, 2, 5, 4, 3, 2, 1])
    state = StepState()
    with StepStateMode(state):
        rows = det_cross_entropy(x, bad, reduction="none")  # no error yet: recorded in the state
    assert len(state.checks) == 1 and torch.isnan(rows[3]) and not torch.isnan(rows[:3]).any()
    with pytest.raises(ValueError, match=r"target: 1 value\(s\) outside \[0, 5\)"):
        state.checks.resolve()
    with pytest.raises(ValueError, match=r"target: 1 value\(s\) outside \[0, 5\)"):
        det_cross_entropy(x, bad, reduction="none")  # no state: decided at once


def _bad_target_run(accelerator, tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(HELPER), "--accelerator", accelerator, "--out", str(out)],
                          env=env_with_mpi(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=cuda)])
def test_det_ddp_bad_target_raises_before_its_optimizer_step(accelerator, tmp_path):
    r = _bad_target_run(accelerator, tmp_path)
    assert r["error"] is not None and "ValueError: target: 1 value(s) outside [0, 5)" in r["error"], r
    assert "e.g. 5" in r["error"] and "before its optimizer step" in r["error"], r  # the deferred route
    assert r["steps"] == 2, r  # steps 1 and 2 ran; step 3 raised
    assert r["step_2_changed_weights"], "control: an optimizer step changes the weights"
    assert r["weights_as_after_step_2"], "the bad batch's optimizer step changed the weights before raising"
