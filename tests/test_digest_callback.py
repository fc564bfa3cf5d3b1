"""DigestCallback files, `lightning-det diff` / `report`, capture and localization (one process, CPU)."""
import json
import sys

import pytest
import torch

from lightning_det.cli import main as cli
from lightning_det.digest.compare import diff_runs, load_run
from tests.helpers.train_mlp import run

K = 4  # the step at which run "perturbed" nudges one layer by one ULP


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    out = {}
    out["a"] = root / "a"
    run(str(out["a"]), max_steps=6, capture=(K, K))
    out["b"] = root / "b"
    run(str(out["b"]), max_steps=6, capture=(K, K))
    out["plain"] = root / "plain"
    run(str(out["plain"]), max_steps=6)
    out["perturbed"] = root / "perturbed"
    run(str(out["perturbed"]), max_steps=6, capture=(K, K), perturb=("net.3", K))
    return out


def step_lines(d):
    return [line for line in (d / "digests-rank0.jsonl").read_text().splitlines() if '"kind": "step"' in line]


def test_identical_runs_write_identical_files(runs):
    a, b = step_lines(runs["a"]), step_lines(runs["b"])
    assert len(a) == 6 and a == b
    rec = json.loads(a[0])
    assert rec["step"] == 1 and set(rec) >= {"loss", "params", "grads", "optim", "rng", "chain"}
    assert list(rec["params"]) == ["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias", "net.5.weight",
                                   "net.5.bias"]
    assert "net.0.weight:exp_avg" in rec["optim"] and "net.0.weight:step" in rec["optim"]
    assert bytes.fromhex(rec["loss"]["hex"]) and rec["loss"]["dtype"] == "float32"
    header = json.loads((runs["a"] / "digests-rank0.jsonl").read_text().splitlines()[0])
    assert header["kind"] == "header" and header["verified"] == "unverified" and header["world_size"] == 1
    assert header["profile"] == "ldet-v1"
    # The chain really chains: every step's value differs.
    assert len({json.loads(x)["chain"] for x in a}) == 6


def test_capture_does_not_change_the_numbers(runs):
    assert step_lines(runs["a"]) == step_lines(runs["plain"])
    events = [json.loads(x) for x in (runs["a"] / "capture-rank0.jsonl").read_text().splitlines()]
    assert {e["step"] for e in events} == {K}
    fwd = [e["module"] for e in events if e["phase"] == "forward"]
    assert fwd[:4] == ["net.0", "net.1", "net.2", "net.3"] and fwd[-1] == "<root>"
    assert any(e["phase"] == "backward" for e in events)


def test_diff_identical_exits_0(runs, capsys):
    assert cli(["diff", str(runs["a"]), str(runs["b"])]) == 0
    assert "identical through step 6" in capsys.readouterr().out
    assert cli(["diff", "--json", str(runs["a"]), str(runs["plain"])]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["identical"] and res["through_step"] == 6


def test_diff_names_step_and_layer_of_planted_divergence(runs, capsys):
    assert cli(["diff", str(runs["a"]), str(runs["perturbed"])]) == 1
    out = capsys.readouterr().out
    print(out)
    assert f"diverged at step {K}" in out and f"identical through step {K - 1}" in out
    assert "first differing module: net.3 (PerturbableLinear) forward" in out
    assert "the op itself differs" in out
    res = diff_runs(load_run(runs["a"]), load_run(runs["perturbed"]))
    assert res["step"] == K
    grads = [d["tensor"] for d in res["differences"] if d["section"] == "grads"]
    # Model order, and only what the nudge can reach: net.5.bias's gradient does not depend on net.3.
    assert grads == sorted(grads, key=["net.0.weight", "net.0.bias", "net.3.weight", "net.3.bias", "net.5.weight",
                                       "net.5.bias"].index)
    loc = res["localization"]
    assert loc["module"] == "net.3" and loc["verdict"] == "op" and loc["inputs_equal"] and loc["params_equal"]


def test_diff_without_capture_still_finds_step(runs, tmp_path, capsys):
    assert cli(["diff", str(runs["plain"]), str(runs["perturbed"])]) == 1
    out = capsys.readouterr().out
    assert f"diverged at step {K}" in out and "capture" in out


def test_deferred_writing_gives_the_same_lines(runs, tmp_path):
    """The CUDA default (lines written one step late, digests copied asynchronously), on CPU."""
    run(str(tmp_path), max_steps=6, write_lag=2)
    assert step_lines(tmp_path) == step_lines(runs["plain"])


def test_gradient_accumulation_one_line_per_optimizer_step(tmp_path):
    run(str(tmp_path), max_steps=3, batch_size=4, accumulate=2)
    lines = [json.loads(x) for x in step_lines(tmp_path)]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert all(len(r["losses"]) == 2 for r in lines)


def test_every_subcommand_has_help(capsys):
    for sub in ("diff", "report", "verify"):
        with pytest.raises(SystemExit) as e:
            cli([sub, "--help"])
        assert e.value.code == 0
        assert "--json" in capsys.readouterr().out


def test_report_json_and_plot(runs, tmp_path, capsys):
    assert cli(["report", str(runs["a"]), str(runs["perturbed"]), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["runs"][1]["diverges_at"] == K and len(summary["runs"][0]["loss"]) == 6
    pytest.importorskip("matplotlib")
    png = tmp_path / "report.png"
    assert cli(["report", str(runs["a"]), str(runs["plain"]), str(runs["perturbed"]), "-o", str(png)]) == 0
    assert png.stat().st_size > 1000


def test_report_without_matplotlib_is_a_clear_error(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli(["report", str(runs["a"]), "-o", str(tmp_path / "r.png")]) == 2
    assert "pip install 'lightning-det[plot]'" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_write_identical_files_with_async_and_sync_writing(tmp_path):
    run(str(tmp_path / "a"), max_steps=5, accelerator="gpu")  # default: write_lag=1 on CUDA
    run(str(tmp_path / "b"), max_steps=5, accelerator="gpu", write_lag=0)
    a, b = step_lines(tmp_path / "a"), step_lines(tmp_path / "b")
    assert len(a) == 5 and a == b
    assert "torch_cuda" in json.loads(a[0])["rng"]


def test_localization_says_when_the_divergent_step_was_not_captured(runs, tmp_path, capsys):
    late = tmp_path / "late"
    run(str(late), max_steps=6, capture=(5, 5), perturb=("net.3", K))
    assert cli(["diff", str(runs["a"]), str(late)]) == 1
    out = capsys.readouterr().out
    assert f"capture step {K}" in out


def test_grads_are_recorded_after_clipping(runs, tmp_path):
    """The gradients digested are those the optimizer read: clipped, not as backward left them."""
    from lightning.pytorch.callbacks import Callback

    from lightning_det.digest import digest_many

    seen = {}

    class Before(Callback):  # Lightning calls this before it clips
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 0:
                seen["raw"] = digest_many([p.grad for p in pl_module.parameters()])

    run(str(tmp_path), max_steps=1, gradient_clip_val=1e-3, extra_callbacks=(Before(),))
    clipped = json.loads(step_lines(tmp_path)[0])["grads"]
    unclipped = json.loads(step_lines(runs["plain"])[0])["grads"]
    assert list(unclipped.values()) == seen["raw"]  # same grads before clipping ...
    assert all(clipped[n] != unclipped[n] for n in clipped)  # ... and every one was scaled down
