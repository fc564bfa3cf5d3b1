"""Exact resume in a new process, checkpoint manifests and the profile check (CPU, plain Lightning)."""
import struct
import sys
import zipfile

import pytest
import torch

from lightning_det.cli import main as cli
from lightning_det.digest.compare import diff_runs, load_run
from lightning_det.digest.manifest import ManifestError, ProfileMismatchError
from tests.conftest import run_cmd
from tests.helpers.train_mlp import run

HELPER = "tests/helpers/train_mlp.py"
TOTAL = 12  # 8 steps per epoch: 12 steps cross one epoch boundary


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    run(str(d), max_steps=TOTAL, ckpt_every=5)  # writes ckpts/s5.ckpt and ckpts/s10.ckpt on the way
    return d


def assert_identical(a, b, through=TOTAL):
    res = diff_runs(load_run(a), load_run(b))
    assert res["identical"], res
    assert res["through_step"] == through and res["common_steps"] >= through - 5


@pytest.mark.parametrize("n", [5, 8], ids=["mid-epoch", "end-of-epoch"])
def test_resume_in_new_process_continues_bitwise(full, tmp_path, n):
    d = tmp_path / "run"
    run(str(d), max_steps=n, ckpt_out=str(tmp_path / "n.ckpt"))
    run_cmd([sys.executable, HELPER, d, "--max-steps", TOTAL, "--ckpt-in", tmp_path / "n.ckpt"])
    assert_identical(full, d)
    # And the resumed half really ran in the other process, continuing the chain.
    steps = load_run(d).steps[0]
    assert sorted(steps) == list(range(1, TOTAL + 1))


def test_resume_from_in_loop_checkpoint(full, tmp_path):
    d = tmp_path / "run"
    run_cmd([sys.executable, HELPER, d, "--max-steps", TOTAL, "--ckpt-in", full / "ckpts" / "s5.ckpt"])
    res = diff_runs(load_run(full), load_run(d))
    assert res["identical"] and res["through_step"] == TOTAL and res["common_steps"] == TOTAL - 5


def test_without_exact_resume_lightning_alone_diverges(full, tmp_path):
    """Control: the same resume through plain Lightning (no RNG / data position) is not exact."""
    d = tmp_path / "run"
    code = (
        "import sys; sys.argv[1:] = []\n"
        "import tests.helpers.train_mlp as T\n"
        "from lightning_det.callbacks import ExactResumeCallback as E\n"
        "E.load_state_dict = lambda self, sd: None\n"
        "E.on_load_checkpoint = lambda self, *a: None\n"
        f"T.run({str(d)!r}, max_steps={TOTAL}, ckpt_in={str(full / 'ckpts' / 's5.ckpt')!r})\n"
    )
    run_cmd([sys.executable, "-c", code])
    res = diff_runs(load_run(full), load_run(d))
    assert not res["identical"] and res["step"] == 6


def flip_byte(path, record_suffix: str, offset: int) -> None:
    """Flip one bit of the stored bytes of zip record ``record_suffix`` in a torch.save file."""
    z = zipfile.ZipFile(path)
    info = next(i for i in z.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        head = f.read(30)
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        pos = info.header_offset + 30 + name_len + extra_len + offset
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def storage_record_of(path, name: str) -> str:
    """The zip record holding the storage of state_dict tensor ``name`` (matched by its bytes)."""
    want = torch.load(path, weights_only=False)["state_dict"][name].numpy().tobytes()
    z = zipfile.ZipFile(path)
    return next(i.filename for i in z.infolist() if "/data/" in i.filename and z.read(i.filename) == want)


def test_flipped_byte_fails_verify_and_load_naming_the_tensor(full, tmp_path, capsys):
    ck = tmp_path / "bad.ckpt"
    ck.write_bytes((full / "ckpts" / "s5.ckpt").read_bytes())
    assert cli(["verify", str(ck)]) == 0
    assert "OK:" in capsys.readouterr().out
    flip_byte(ck, storage_record_of(ck, "net.3.weight"), 100)
    assert cli(["verify", str(ck)]) == 1
    out = capsys.readouterr().out
    assert "state_dict/net.3.weight" in out and "SHA-256" in out
    with pytest.raises(ManifestError, match="state_dict/net.3.weight"):
        run(str(tmp_path / "resumed"), max_steps=TOTAL, ckpt_in=str(ck), digest=False)


def test_incompatible_profile_is_rejected(full, tmp_path, capsys):
    ck = torch.load(full / "ckpts" / "s5.ckpt", weights_only=False)
    ck["ldet_manifest"]["profile"] = "ldet-v0"
    path = tmp_path / "old.ckpt"
    torch.save(ck, path)
    with pytest.raises(ProfileMismatchError, match="'ldet-v0'.*would not continue the saved one bitwise"):
        run(str(tmp_path / "resumed"), max_steps=TOTAL, ckpt_in=str(path), digest=False)
    assert cli(["verify", str(path)]) == 1
    assert "ldet-v0" in capsys.readouterr().out
