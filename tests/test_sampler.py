"""DeterministicSampler: world-size invariance and mid-epoch resume."""
import pytest
import torch

from lightning_det.data import DeterministicSampler


def batches(s: DeterministicSampler) -> list[list[int]]:
    idx = list(s)
    return [idx[i: i + s.batch_size] for i in range(0, len(idx), s.batch_size)]


def global_steps(n: int, world: int, batch: int, epoch: int = 0, seed: int = 3) -> list[list[int]]:
    """The samples of each step over all ranks, rank 0 first."""
    per_rank = []
    for r in range(world):
        s = DeterministicSampler(n, batch, num_replicas=world, rank=r, seed=seed)
        s.set_epoch(epoch)
        per_rank.append(batches(s))
    return [sum((per_rank[r][k] for r in range(world)), []) for k in range(len(per_rank[0]))]


def test_world_size_invariant_and_drops_trailing_chunk():
    one = global_steps(103, 1, 12)
    assert len(one) == 103 // 12
    for world in (2, 3, 4, 6):
        assert global_steps(103, world, 12 // world) == one
    # Every sample at most once per epoch, trailing 103 % 12 samples dropped, never padded.
    flat = sum(one, [])
    assert len(flat) == len(set(flat)) == 96


def test_order_is_function_of_seed_and_epoch():
    assert global_steps(50, 1, 10, epoch=1) == global_steps(50, 2, 5, epoch=1)
    assert global_steps(50, 1, 5, epoch=0) != global_steps(50, 1, 5, epoch=1)
    s = DeterministicSampler(50, 5, seed=3)
    s.set_epoch(2)
    assert torch.equal(s.global_order(), torch.randperm(50, generator=torch.Generator().manual_seed(5)))
    assert list(DeterministicSampler(10, 2, shuffle=False)) == list(range(10))
    assert len(DeterministicSampler(103, 4, num_replicas=3)) == 8 * 4


def test_resume_mid_epoch_counts_consumed_not_yielded():
    s = DeterministicSampler(64, 4, seed=1)
    s.set_epoch(2)
    full = batches(s)
    it = iter(s)
    for _ in range(4 * 6):  # the DataLoader prefetched six batches ...
        next(it)
    s.mark_consumed(3, epoch=2)  # ... but the loop consumed three
    sd = s.state_dict()
    assert sd["epoch"] == 2 and sd["consumed_chunks"] == 3 and sd["consumed_samples"] == 12
    t = DeterministicSampler(64, 4, seed=1)
    t.load_state_dict(sd)
    t.set_epoch(2)  # Lightning calls this again on restart: the position must survive it
    assert batches(t) == full[3:]
    assert batches(t) == full  # the offset applies to one pass only
    t.set_epoch(3)
    assert batches(t) == global_steps(64, 1, 4, epoch=3, seed=1)


def test_resume_at_other_world_size_same_global_batch():
    s = DeterministicSampler(96, 4, num_replicas=2, rank=1, seed=9)
    s.mark_consumed(5, epoch=0)
    sd = s.state_dict()
    whole = global_steps(96, 1, 8, seed=9)
    one = DeterministicSampler(96, 8, num_replicas=1, rank=0, seed=9)
    one.load_state_dict(sd)
    assert batches(one) == whole[5:]
    # A different global batch only where the consumed samples are whole chunks of the new one.
    half = DeterministicSampler(96, 4, seed=9)
    half.load_state_dict(sd)  # 40 samples = 10 chunks of 4
    assert batches(half)[0] == whole[5][:4]
    odd = DeterministicSampler(96, 3, seed=9)
    with pytest.raises(ValueError, match="not a whole number of global batches"):
        odd.load_state_dict(sd)
    with pytest.raises(ValueError, match="seed"):
        DeterministicSampler(96, 8, seed=10).load_state_dict(sd)
