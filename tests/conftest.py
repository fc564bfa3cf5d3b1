import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def clean_env(**extra) -> dict:
    """A minimal environment for child processes: no inherited torch/Lightning/pytest state."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "LIGHTNING_DET_BUILD_DIR",
                                      "LIGHTNING_DET_NO_CUDA") if k in os.environ}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update(extra)
    return env


def run_cmd(args: list, timeout: float = 180, check: bool = True, **env) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=REPO, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session", autouse=True)
def _build_core():
    # Build once up front, so a first-time JIT build is not charged to whichever test runs first
    # (and child processes find the cache).
    from lightning_det import _build

    _build.load()
