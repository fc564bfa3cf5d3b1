"""Fault injection on checkpoints and digest files: flipped bytes, truncation, a kill inside a
save, edited state, malformed digest lines. Each case must be refused, naming what is wrong.

The rule for flipped bytes: every byte of a checkpoint file is checked by something, so every
flip is refused. Content (tensors, RNG states, counters, hyper-parameters) is named by its path
in the manifest; bytes that carry no content (zip headers, CRCs, torch's alignment padding) are
named by their zip record, checked against torch.save's layout.
"""
import json
import random
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_det.callbacks import ExactResumeCallback
from lightning_det.cli import main as cli
from lightning_det.data import DeterministicSampler
from lightning_det.digest.atomic import atomic_write
from lightning_det.digest.compare import diff_runs, load_run
from lightning_det.digest.container import CheckpointFileError
from lightning_det.digest.manifest import ManifestError, verify_file
from lightning_det.strategy.checkpoint_io import AtomicCheckpointIO
from tests.conftest import run_cmd
from tests.helpers.train_mlp import run

HELPER = "tests/helpers/train_mlp.py"
FLIPS = 50


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run with an in-loop checkpoint at step 3 (written through AtomicCheckpointIO)."""
    d = tmp_path_factory.mktemp("saved")
    run(str(d), max_steps=4, ckpt_every=3)
    return d


def load_like_lightning(path):
    """What a resume does with the file: the strategy's CheckpointIO reads it (ManifestCallback
    installs AtomicCheckpointIO), then ManifestCallback.on_load_checkpoint checks it."""
    ckpt = AtomicCheckpointIO().load_checkpoint(path)
    ExactResumeCallback().on_load_checkpoint(SimpleNamespace(ckpt_path=str(path)), None, ckpt)
    return ckpt


def test_every_flipped_byte_is_refused_by_verify_and_load(saved, tmp_path, capsys):
    src = saved / "ckpts" / "s3.ckpt"
    assert cli(["verify", str(src)]) == 0
    load_like_lightning(src)
    raw = src.read_bytes()
    rng = random.Random(35)
    bad = tmp_path / "bad.ckpt"
    named = {"content": 0, "container": 0, "unreadable": 0}
    for trial in range(FLIPS):
        pos, bit = rng.randrange(len(raw)), 1 << rng.randrange(8)
        flipped = bytearray(raw)
        flipped[pos] ^= bit
        bad.write_bytes(flipped)
        capsys.readouterr()
        assert cli(["verify", "--json", str(bad)]) == 1, f"trial {trial}: byte {pos} bit {bit} passed verify"
        res = json.loads(capsys.readouterr().out)
        first = res["problems"][0]["entry"]
        assert first, res
        with pytest.raises((ManifestError, CheckpointFileError)) as exc:
            load_like_lightning(bad)
        if isinstance(exc.value, CheckpointFileError):
            named["unreadable"] += 1
            assert str(bad) in str(exc.value)
        else:
            # the same first entry as verify: a leaf path, or the zip record when no content changed
            assert exc.value.problems[0]["entry"] == first, (exc.value.problems[:2], first)
            named["container" if first.startswith(("zip ", "ldet_manifest")) else "content"] += 1
    print(f"{FLIPS} flipped bytes, {FLIPS} refused: {named}")
    assert named["content"] > 0 and named["container"] > 0


def test_torch_load_alone_accepts_a_flipped_byte_in_data_pkl(saved, tmp_path):
    """Control: torch.load checks no CRC, so a flip in the pickle loads as another value."""
    src = saved / "ckpts" / "s3.ckpt"
    raw = bytearray(src.read_bytes())
    ref = torch.load(src, weights_only=False)
    pos = raw.index(b"global_step") + len("global_step") + 2  # inside the pickled counter that follows
    for delta in range(1, 40):
        raw[pos + delta] ^= 0x01
        (tmp_path / "c.ckpt").write_bytes(raw)
        try:
            got = torch.load(tmp_path / "c.ckpt", weights_only=False)
        except Exception:  # noqa: BLE001 - this byte broke the pickle; try the next one
            raw[pos + delta] ^= 0x01
            continue
        if got["global_step"] != ref["global_step"] or got.keys() != ref.keys():
            break
        raw[pos + delta] ^= 0x01
    else:
        pytest.fail("no silently accepted flip found near global_step")
    with pytest.raises(ManifestError):
        verify_file(str(tmp_path / "c.ckpt"))


@pytest.mark.parametrize("edit, path", [
    (lambda c: c["optimizer_states"][0]["param_groups"][0].__setitem__("lr", 0.02),
     "optimizer_states[0]/param_groups[0]/lr"),
    (lambda c: c["callbacks"]["ExactResumeCallback"]["samplers"][0].__setitem__("consumed_chunks", 1),
     "callbacks/ExactResumeCallback/samplers[0]/consumed_chunks"),
    (lambda c: c.__setitem__("global_step", 2), "global_step"),
    (lambda c: c["callbacks"]["ExactResumeCallback"]["rng"][0]["python"][1].__setitem__(5, 7),
     "callbacks/ExactResumeCallback/rng[0]/python"),
], ids=["lr", "sampler", "global_step", "python_rng"])
def test_edited_state_is_named_by_its_path(saved, tmp_path, capsys, edit, path):
    # A clean re-save: the zip container is valid, only the manifest can tell.
    ckpt = torch.load(saved / "ckpts" / "s3.ckpt", weights_only=False)
    edit(ckpt)
    torch.save(ckpt, tmp_path / "e.ckpt")
    assert cli(["verify", str(tmp_path / "e.ckpt")]) == 1
    out = capsys.readouterr().out
    assert f"{path}: SHA-256 of the" in out.splitlines()[1], out
    with pytest.raises(ManifestError, match=f"first at {path.replace('[', '.').replace(']', '.')}"):
        load_like_lightning(tmp_path / "e.ckpt")


def test_a_truncated_checkpoint_is_a_clear_error(saved, tmp_path, capsys):
    raw = (saved / "ckpts" / "s3.ckpt").read_bytes()
    rng = random.Random(10)
    for cut in [0, 1, len(raw) - 1] + [rng.randrange(len(raw)) for _ in range(5)]:
        (tmp_path / "t.ckpt").write_bytes(raw[:cut])
        assert cli(["verify", str(tmp_path / "t.ckpt")]) == 1
        assert "truncated" in capsys.readouterr().out
        with pytest.raises(CheckpointFileError, match=f"t.ckpt: not a complete checkpoint file \\({cut} bytes"):
            AtomicCheckpointIO().load_checkpoint(tmp_path / "t.ckpt")
    # A whole resume goes through the same reader (ManifestCallback installs it at setup).
    with pytest.raises(CheckpointFileError, match="truncated"):
        run(str(tmp_path / "resumed"), max_steps=5, ckpt_in=str(tmp_path / "t.ckpt"), digest=False)
    (tmp_path / "n.ckpt").write_text("not a checkpoint")
    assert cli(["verify", str(tmp_path / "n.ckpt")]) == 1
    assert "is not a torch.save checkpoint" in capsys.readouterr().out


def test_atomic_write_keeps_the_previous_file_when_interrupted(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"previous")

    def crash(temp):
        assert temp.read_bytes() == b"new bytes" and temp.parent == target.parent
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, lambda f: f.write(b"new bytes"), crash)
    assert target.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]
    atomic_write(target, lambda f: f.write(b"new bytes"))
    assert target.read_bytes() == b"new bytes"


@pytest.mark.slow
def test_kill_9_inside_a_save_at_world_size_2_then_resume_bitwise(tmp_path):
    """Rank 0 SIGKILLs itself inside the save of s4.ckpt (temp written, not yet renamed); the run
    resumes from s2.ckpt and ends with the uninterrupted run's weights and digests."""
    common = ["--max-steps", "6", "--batch-size", "4", "--devices", "2", "--no-dropout", "--det",
              "--strategy", "det_ddp", "--ckpt-every", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", HELPER]
    run_cmd([*torchrun, tmp_path / "full", *common, "--ckpt-out", tmp_path / "full.ckpt"], timeout=300)
    killed = run_cmd([*torchrun, tmp_path / "part", *common, "--kill-in-save", "s4.ckpt"], timeout=300, check=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-2000:]
    ckpts = tmp_path / "part" / "ckpts"
    assert not (ckpts / "s4.ckpt").exists()
    assert [p.name.split("-")[0] for p in ckpts.glob(".s4.ckpt.tmp-*")] == [".s4.ckpt.tmp"]  # died in the save
    verify_file(str(ckpts / "s2.ckpt"))  # the previous checkpoint is intact
    run_cmd([*torchrun, tmp_path / "part", *common, "--ckpt-in", ckpts / "s2.ckpt", "--ckpt-out",
             tmp_path / "part.ckpt"], timeout=300)
    full, part = (torch.load(tmp_path / f"{n}.ckpt", weights_only=False)["state_dict"] for n in ("full", "part"))
    assert full.keys() == part.keys()
    for name in full:
        assert torch.equal(full[name], part[name]), name
    for rank in (0, 1):
        res = diff_runs(load_run(tmp_path / "full"), load_run(tmp_path / "part"), [rank])
        assert res["identical"] and res["through_step"] == 6, res
    # The digest header claimed nothing before the first step's audit; the label record did.
    lines = (tmp_path / "full" / "digests-rank0.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["verified"] == "pending"
    labels = [json.loads(line) for line in lines if '"kind": "label"' in line]
    assert labels == [{"kind": "label", "step": 1, "verified": "verified"}]
    assert load_run(tmp_path / "full").label == "verified"


# ---- digest files --------------------------------------------------------------------------

@pytest.fixture
def run_dir(saved, tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(saved / "digests-rank0.jsonl", d)
    return d


def edit_line(d, n, fn):
    path = d / "digests-rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    rec = json.loads(lines[n])
    fn(rec)
    lines[n] = json.dumps(rec) + "\n"
    path.write_text("".join(lines))


@pytest.mark.parametrize("field, value", [("params", None), ("step", "two"), ("chain", 5), ("optim", {"x": 1})])
def test_a_malformed_step_line_is_an_error_naming_file_line_and_field(saved, run_dir, capsys, field, value):
    edit_line(run_dir, 2, lambda r: r.__setitem__(field, value))
    assert cli(["diff", str(saved), str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"digests-rank0.jsonl:3: field {field!r}: must be" in err, err
    assert cli(["diff", "--json", str(saved), str(run_dir)]) == 2
    out = json.loads(capsys.readouterr().out)["error"]
    assert out["line"] == 3 and out["field"] == field and out["file"].endswith("digests-rank0.jsonl")
    assert cli(["report", "--json", str(saved), str(run_dir)]) == 2


def test_a_torn_last_line_is_reported_and_a_torn_middle_line_is_an_error(saved, run_dir, capsys):
    path = run_dir / "digests-rank0.jsonl"
    text = path.read_text()
    path.write_text(text + text.splitlines()[-1][:50])
    assert cli(["diff", str(saved), str(run_dir)]) == 0
    assert "torn last line ignored" in capsys.readouterr().out
    lines = text.splitlines(keepends=True)
    lines[2] = lines[2][:40] + "\n"
    path.write_text("".join(lines))
    assert cli(["diff", str(saved), str(run_dir)]) == 2
    assert "digests-rank0.jsonl:3: not a JSON line" in capsys.readouterr().err


def test_a_non_utf8_file_is_an_error_naming_it(saved, run_dir, capsys):
    path = run_dir / "digests-rank0.jsonl"
    path.write_bytes(path.read_bytes() + b"\xff\xfe\n")
    assert cli(["diff", "--json", str(saved), str(run_dir)]) == 2
    out = json.loads(capsys.readouterr().out)["error"]
    assert out["file"] == str(path) and "not UTF-8" in out["problem"]


def test_two_runs_in_one_file_are_an_error_unless_one_is_selected(saved, run_dir, capsys):
    path = run_dir / "digests-rank0.jsonl"
    text = path.read_text()
    path.write_text(text + text)  # a second fresh run appended to the same folder
    assert cli(["diff", str(saved), str(run_dir)]) == 2
    assert "two runs in one file" in capsys.readouterr().err
    for n in (1, 2):
        assert cli(["diff", "--run-b", str(n), str(saved), str(run_dir)]) == 0
        assert "run labels: a unverified, b unverified" in capsys.readouterr().out


# ---- state validated at load ---------------------------------------------------------------

def test_sampler_state_is_validated_naming_the_entry():
    s = DeterministicSampler(64, 8)
    good = s.state_dict()
    with pytest.raises(KeyError, match="no 'epoch' entry"):
        s.load_state_dict({k: v for k, v in good.items() if k != "epoch"})
    with pytest.raises(ValueError, match="entry 'consumed_chunks' must be an integer >= 0, got '3'"):
        s.load_state_dict({**good, "consumed_chunks": "3"})
    with pytest.raises(ValueError, match="entry 'shuffle' must be a bool"):
        s.load_state_dict({**good, "shuffle": 1})
    with pytest.raises(TypeError, match="expected a dict"):
        s.load_state_dict([good])
    s.load_state_dict({**good, "consumed_chunks": 3, "consumed_samples": 24})
    assert s.consumed_chunks == 3


def test_callback_states_are_validated_naming_the_entry(saved):
    from lightning_det.callbacks import DigestCallback

    state = torch.load(saved / "ckpts" / "s3.ckpt", weights_only=False)["callbacks"]
    cb = ExactResumeCallback()
    good = state["ExactResumeCallback"]
    for bad, match in [({**good, "rng": None}, "entry 'rng' must be a list"),
                       ({**good, "rng": [{**good["rng"][0], "python": 3}]}, "entry 'rng.0./python'"),
                       ({**good, "rng": [{**good["rng"][0], "torch": good["rng"][0]["torch"].long()}]},
                        "entry 'rng.0./torch' must be a 1-D uint8 tensor"),
                       ({k: v for k, v in good.items() if k != "samplers"}, "entry 'samplers' must be a list")]:
        with pytest.raises(ValueError, match=match):
            cb.load_state_dict(bad)
    digest_state = next(v for k, v in state.items() if k.startswith("DigestCallback"))
    with pytest.raises(ValueError, match="entry 'last_step' must be an integer >= 0, got 'x'"):
        DigestCallback("unused").load_state_dict({**digest_state, "last_step": "x"})
