"""det_all_reduce and its windowed form over 3 gloo processes equal the exact sum computed alone."""
import sys

from conftest import run_cmd


def test_digit_all_reduce_full_and_windowed_are_exact():
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                    "tests/helpers/all_reduce_check.py"], timeout=300)
    assert "special=False: windowed all-reduce exact" in proc.stdout, proc.stdout
    assert "special=True: windowed all-reduce exact" in proc.stdout, proc.stdout
