"""Cross-replica check: two gloo processes, one rank's weight silently changed."""
import json
import sys

from lightning_det.digest.compare import load_run
from tests.conftest import run_cmd


def test_corrupted_rank_is_named(tmp_path):
    d = tmp_path / "ddp"
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "tests/helpers/train_mlp.py", d, "--max-steps", "4", "--batch-size", "4", "--devices", "2",
                    "--strategy", "ddp", "--replica-check", "1", "--corrupt", "1:net.3.weight:3"], timeout=240)
    run = load_run(d)
    assert run.ranks == [0, 1]
    for rank in (0, 1):
        found = run.mismatches[rank]
        # Steps 1 and 2 are the control: the replicas agree until the corruption at step 3.
        assert [m["step"] for m in found] == [3, 4], found
        first = found[0]["mismatches"]
        assert [(m["rank"], m["tensor"]) for m in first] == [(1, "net.3.weight")], first
    assert "rank 1 has a different 'net.3.weight'" in proc.stderr
    # Each rank wrote its own file with its own header.
    header = json.loads((d / "digests-rank1.jsonl").read_text().splitlines()[0])
    assert header["rank"] == 1 and header["world_size"] == 2


def test_raise_option_stops_every_rank(tmp_path):
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "tests/helpers/train_mlp.py", tmp_path, "--max-steps", "4", "--batch-size", "4", "--devices", "2",
                    "--strategy", "ddp", "--replica-check", "2", "--replica-action", "raise",
                    "--corrupt", "0:net.0.bias:1"], timeout=240, check=False)
    assert proc.returncode != 0
    # Both ranks raise (none is left waiting in a collective); with two ranks rank 1 is the one
    # compared against rank 0, so the message names rank 1 and the corrupted tensor.
    assert proc.stderr.count("ReplicaMismatchError") >= 2, proc.stderr[-3000:]
    assert "replicas differ after step 2: rank 1 has a different 'net.0.bias'" in proc.stderr
    assert [json.loads(x)["step"] for x in (tmp_path / "digests-rank0.jsonl").read_text().splitlines()
            if '"replica_mismatch"' in x] == [2]


def test_majority_names_the_odd_rank_out():
    from lightning_det.callbacks.digest import find_replica_mismatches

    ok, bad = {"w": "a", "b": "x"}, {"w": "z", "b": "x"}
    assert [(m["rank"], m["tensor"], m["ambiguous"]) for m in find_replica_mismatches([ok, bad, ok, ok])] == \
        [(1, "w", False)]
    assert [(m["rank"], m["ambiguous"]) for m in find_replica_mismatches([bad, ok, ok])] == [(0, False)]
    assert [(m["rank"], m["ambiguous"]) for m in find_replica_mismatches([bad, ok])] == [(1, True)]
    assert find_replica_mismatches([ok, ok]) == []
