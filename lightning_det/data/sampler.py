"""A world-size invariant, resumable sampler.

The global order of epoch ``e`` is a function of ``(seed, e)`` alone, so one rank with batch B
and N ranks with batch B/N see the same samples in every optimizer step. The position is kept
in *global* chunks (one chunk = one global batch of ``batch_size * num_replicas`` samples), so a
checkpoint written at one world size can be resumed at another with the same global batch.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

from ..ops.args import as_index

__all__ = ["DeterministicSampler"]


class DeterministicSampler(Sampler[int]):
    """Yields this rank's sample indices: rank ``r`` gets ``[r*B, (r+1)*B)`` of each global chunk.

    Args:
        dataset_len: number of samples in the dataset.
        batch_size: per-rank batch size ``B`` (the DataLoader's ``batch_size`` must equal it).
        num_replicas: world size ``N``; a global chunk holds ``B * N`` samples.
        rank: this process's rank.
        shuffle: ``torch.randperm`` under ``seed + epoch`` if True, else ``arange``.
        seed: base seed of the permutation.

    The incomplete trailing chunk is dropped (never padded: padding would make the last batch
    depend on the world size). ``len(sampler)`` is the per-epoch number of indices this rank
    yields, ``chunks_per_epoch * B``.

    Progress: the training loop reports what it actually consumed with
    :meth:`mark_consumed` (``lightning_det.callbacks.ExactResumeCallback`` does this from the
    batch index), because a DataLoader prefetches ahead of the loop and the number of
    yielded indices overstates progress. :meth:`state_dict` / :meth:`load_state_dict` carry the
    position; after loading, the next iteration of the saved epoch starts at the first
    unconsumed chunk.
    """

    def __init__(self, dataset_len: int, batch_size: int, *, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0) -> None:
        if dataset_len < 0:
            raise ValueError(f"dataset_len must be >= 0, got {dataset_len}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.dataset_len = int(dataset_len)
        self.batch_size = int(batch_size)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        seed_int = as_index(seed)  # a Python or NumPy integer; a float is refused, not truncated
        if seed_int is None:
            raise TypeError(f"seed: expected an integer, got {type(seed).__name__} {seed!r}")
        self.seed = seed_int
        self.epoch = 0
        self.consumed_chunks = 0  # consumed by the training loop in self.epoch
        self._resume_chunk = 0  # where the next __iter__ of self.epoch starts

    # -- geometry -------------------------------------------------------------------------
    @property
    def global_batch(self) -> int:
        """Samples per global chunk (one optimizer micro-step over all ranks)."""
        return self.batch_size * self.num_replicas

    @property
    def chunks_per_epoch(self) -> int:
        return self.dataset_len // self.global_batch

    def __len__(self) -> int:
        return self.chunks_per_epoch * self.batch_size

    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's global sample order: a function of ``(seed, epoch)`` only."""
        e = self.epoch if epoch is None else int(epoch)
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        return torch.randperm(self.dataset_len, generator=torch.Generator().manual_seed(self.seed + e))

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        start = self._resume_chunk
        # The resume offset applies to one pass only; a later pass over the same epoch (rare)
        # starts from the beginning, as an ordinary sampler would.
        self._resume_chunk = 0
        gb, b, r = self.global_batch, self.batch_size, self.rank
        for c in range(start, self.chunks_per_epoch):
            base = c * gb + r * b
            yield from order[base : base + b].tolist()

    # -- progress and resume --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (Lightning calls this at every epoch start)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed_chunks = 0
            self._resume_chunk = 0

    def mark_consumed(self, chunks_in_epoch: int, epoch: int | None = None) -> None:
        """Record that the training loop has consumed ``chunks_in_epoch`` chunks of ``epoch``.

        Call it with the loop's own count (e.g. ``batch_idx + 1`` after a training batch),
        not with what the DataLoader iterator has fetched.
        """
        if epoch is not None and int(epoch) != self.epoch:
            self.epoch = int(epoch)
        self.consumed_chunks = int(chunks_in_epoch)

    def state_dict(self) -> dict:
        """The position, in global chunks and samples, plus what fixes the order."""
        return {
            "epoch": self.epoch,
            "consumed_chunks": self.consumed_chunks,
            "consumed_samples": self.consumed_chunks * self.global_batch,
            "global_batch": self.global_batch,
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the next unconsumed chunk; refuses a state whose order would differ.

        The world size may differ from the saved one when the global batch is unchanged; a
        different global batch is accepted only where the consumed samples fill whole chunks.
        """
        _check_state(sd)
        for key in ("dataset_len", "shuffle", "seed"):
            if key in sd and sd[key] != getattr(self, key):
                raise ValueError(
                    f"DeterministicSampler.load_state_dict: saved {key}={sd[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; the sample order would differ, so the resume cannot be exact."
                )
        consumed_samples = int(sd.get("consumed_samples", int(sd["consumed_chunks"]) * sd.get("global_batch", self.global_batch)))
        if consumed_samples % self.global_batch:
            raise ValueError(
                f"DeterministicSampler.load_state_dict: {consumed_samples} samples were consumed in epoch "
                f"{sd['epoch']}, which is not a whole number of global batches of {self.global_batch} "
                f"(batch_size={self.batch_size} x num_replicas={self.num_replicas}); resume with the saved "
                f"global batch of {sd.get('global_batch')}."
            )
        self.epoch = int(sd["epoch"])
        self.consumed_chunks = consumed_samples // self.global_batch
        self._resume_chunk = self.consumed_chunks


_STATE_FIELDS = {  # field -> (required, bool-typed)
    "epoch": (True, False), "consumed_chunks": (True, False), "consumed_samples": (False, False),
    "global_batch": (False, False), "dataset_len": (False, False), "shuffle": (False, True), "seed": (False, False),
}


def _check_state(sd) -> None:
    """Refuse a malformed saved state, naming the entry, before anything is changed."""
    if not isinstance(sd, dict):
        raise TypeError(f"DeterministicSampler.load_state_dict: expected a dict, got {type(sd).__name__}")
    for key, (required, is_bool) in _STATE_FIELDS.items():
        if key not in sd:
            if required:
                raise KeyError(f"DeterministicSampler.load_state_dict: the saved state has no {key!r} entry "
                               f"(entries: {sorted(sd)})")
            continue
        v = sd[key]
        ok = isinstance(v, bool) if is_bool else isinstance(v, int) and not isinstance(v, bool) and v >= 0
        if key == "global_batch" and ok and not is_bool:
            ok = v >= 1
        if not ok:
            want = "a bool" if is_bool else "an integer >= 1" if key == "global_batch" else "an integer >= 0"
            raise ValueError(f"DeterministicSampler.load_state_dict: entry {key!r} must be {want}, got {v!r}")
