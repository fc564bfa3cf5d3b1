"""Fabric(strategy="det_ddp"): the same world-size and accumulation invariance as the Trainer."""
import sys

from conftest import run_cmd


def steps(devices, accum, clip=0.0):
    out = run_cmd([sys.executable, "tests/helpers/fabric_run.py", devices, accum, clip], timeout=600).stdout
    lines = [l for l in out.splitlines() if l.startswith("step ")]
    assert len(lines) == 4, out[-2000:]
    return lines


def test_fabric_world_size_and_accumulation_invariance():
    base = steps(1, 1)
    assert steps(2, 1) == base, "world size 2 differs"
    assert steps(1, 2) == base, "accumulation 2 differs"


def test_fabric_exact_clipping_is_invariant():
    clipped = steps(1, 1, 0.05)
    assert clipped != steps(1, 1), "the clip value must actually clip"
    assert steps(2, 1, 0.05) == clipped


def test_fabric_saves_through_the_atomic_checkpoint_io(tmp_path):
    import torch

    from lightning_det.strategy.checkpoint_io import AtomicCheckpointIO
    from lightning_det.strategy.fabric import FabricDeterministicStrategy

    io = FabricDeterministicStrategy().checkpoint_io  # what fabric.save writes through
    assert isinstance(io, AtomicCheckpointIO)
    path = tmp_path / "state.ckpt"
    io.save_checkpoint({"w": torch.arange(4.0)}, path)
    assert torch.equal(io.load_checkpoint(path)["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.ckpt"]  # no temp file left behind
