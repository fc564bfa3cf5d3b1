"""Collectives check that every rank brings the same shapes, dtypes and profile (2 gloo ranks).

Before the check, different shapes made gloo abort rank 0 with SIGABRT ("Received data size
doesn't match expected size"). The helper (tests/helpers/rank_agreement_check.py) runs each
mismatch on both ranks and prints what each raised; it also sums top digits that wrap int64.
"""
from __future__ import annotations

import re
import sys

from conftest import run_cmd


def test_mismatched_ranks_raise_on_every_rank_and_name_the_shapes():
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "tests/helpers/rank_agreement_check.py"], timeout=300, OMP_NUM_THREADS="1")
    out = proc.stdout
    lines = {(int(m[1]), m[2]): m[3] for m in re.finditer(r"rank (\d) case (\w+): (.*)", out)}
    expected = {
        "all_reduce_shape": "det_all_reduce: .* acc shape is (4, 19) on rank 0 but (5, 19) on rank 1",
        "windowed_shape": "det_all_reduce_windowed: .* acc shape is (4, 19) on rank 0 but (5, 19) on rank 1",
        "windowed_block": "det_all_reduce_windowed: .* block is 16 on rank 0 but 17 on rank 1",
        "sync_shape": "sync_gradients: .* params[2] (shape, dtype) is ((2, 2), 'torch.float32') on rank 0 "
                      "but ((2, 3), 'torch.float32') on rank 1",
        "sync_count": "sync_gradients: .* number of parameters with requires_grad is 2 on rank 0 but 3 on rank 1",
        "sync_dtype": "sync_gradients: .* params[0] (shape, dtype) is ((3,), 'torch.float32') on rank 0 "
                      "but ((3,), 'torch.bfloat16') on rank 1",
    }
    for rank in (0, 1):
        for case, pattern in expected.items():
            got = lines.get((rank, case), "missing")
            head, tail = pattern.split(" .* ")
            assert got.startswith("raised: " + head) and tail in got, (rank, case, got, out)
        assert lines[(rank, "sync_agree")] == "ok exact=2", out
        assert lines[(rank, "top62_pos")] == "full=inf windowed=inf", out
        assert lines[(rank, "top62_neg")] == "full=-inf windowed=-inf", out
        m = re.fullmatch(r"edge=(-?\d+) expected=(\d+) past=(\S+)", lines[(rank, "top_edge")])
        assert m and m[1] == m[2] and m[3] == "inf", out
        assert f"rank {rank} done" in out, out
