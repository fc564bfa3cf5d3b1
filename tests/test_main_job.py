"""The README's main job runs end to end in a short configuration and reaches its verdict."""
import sys

from conftest import run_cmd


def test_main_job_short(tmp_path):
    proc = run_cmd([sys.executable, "examples/main_job.py", "--steps", "2", "--batch-size", "8", "--out", tmp_path],
                   timeout=900)
    out = proc.stdout
    assert "det_ddp world size 1 vs 2: IDENTICAL" in out, out[-3000:]
    assert "plain ddp control:         differs" in out, out[-3000:]
    assert "identical through step 2" in out and "main job PASSED" in out
