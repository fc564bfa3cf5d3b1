"""A tiny ResNet (Conv2d, BatchNorm2d, ReLU(inplace=True), 3 x 3 stride-2 max pool, residual +=,
strided conv, global average pooling) under strict det_ddp on CPU/gloo: world size 1 == 2 for
every weight, the running statistics and the losses; with ghost BatchNorm groups also
accumulation 2 at world size 2 == world size 1. The plain-DDP control of a ResNet (per-rank
BatchNorm statistics, float all-reduce), which differs between world sizes 1 and 2, is in
tests/test_zoo.py. Each run is a subprocess of tests/ddp_harness.py (model
"resnet", 3 steps, global batch 24)."""
import pytest
from test_det_ddp import run_rows

pytestmark = pytest.mark.slow  # each harness run starts Lightning (and gloo ranks) in a subprocess


def _fields(rows, key):
    return [r[key] for r in rows]


def _assert_same(a, b, what, keys=("weights_sha256", "buffers_sha256", "loss_hex")):
    for key in keys:
        assert _fields(a, key) == _fields(b, key), f"{what}: {key} differ"


def test_resnet_world_size_invariance_with_global_batch_norm():
    _assert_same(run_rows(2, model="resnet", steps=3), run_rows(1, model="resnet", steps=3), "world size 2 vs 1")


def test_resnet_ghost_groups_are_invariant_to_world_size_and_accumulation():
    # groups of 12: two per forward at world size 1; at world size 2 with accumulation 2 each
    # forward's global micro-batch (6 + 6 samples) is one group that crosses the ranks
    one = run_rows(1, model="resnet", steps=3, bn_group=12)
    # (the logged loss is the last micro-batch's under accumulation: weights and running stats compared)
    _assert_same(run_rows(2, 2, model="resnet", steps=3, bn_group=12), one, "ws 2 x accumulation 2 vs ws 1",
                 keys=("weights_sha256", "buffers_sha256"))
    # ghost groups are a different normalization from the whole global micro-batch
    assert _fields(one, "weights_sha256") != _fields(run_rows(1, model="resnet", steps=3), "weights_sha256")
