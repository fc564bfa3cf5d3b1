"""Checkpoint manifests and exact resume (RNG per rank, data position, profile).

Lightning restores weights, optimizer state and loop counters, but not the RNG streams, and it
restarts a mid-epoch dataloader from the epoch's beginning. :class:`ExactResumeCallback` fills
both gaps; :class:`ManifestCallback` makes corruption and profile changes loud.
"""
from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import TorchCheckpointIO
from typing_extensions import override

from ..data.sampler import DeterministicSampler
from .digest import run_label
from ..digest.container import check_container
from ..digest.manifest import MANIFEST_KEY, ManifestError, build_manifest, check_profile, verify_manifest
from ..strategy.checkpoint_io import AtomicCheckpointIO

__all__ = ["ManifestCallback", "ExactResumeCallback", "find_deterministic_samplers"]


class ManifestCallback(Callback):
    """Adds a manifest to every checkpoint and verifies it (and the profile) when loading.

    The manifest holds a SHA-256 of every leaf of the checkpoint under its path (tensors, RNG
    states, sampler positions, hyper-parameters, counters) plus the numerical profile
    (:mod:`lightning_det.digest.manifest`). Loading a checkpoint file whose bytes differ
    anywhere (content, or the zip container around it) raises
    :class:`lightning_det.digest.manifest.ManifestError` naming the first differing entry; a
    checkpoint from another profile raises
    :class:`~lightning_det.digest.manifest.ProfileMismatchError`.

    A strategy still on Lightning's plain ``TorchCheckpointIO`` is given
    :class:`lightning_det.strategy.checkpoint_io.AtomicCheckpointIO` at setup, so that a crash
    during a save leaves the previous checkpoint intact and a truncated file is named as such.

    Args:
        require_manifest: if True, loading a checkpoint without a manifest is an error;
            otherwise it only warns.
    """

    def __init__(self, require_manifest: bool = False) -> None:
        super().__init__()
        self.require_manifest = require_manifest

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        # Before Lightning restores a checkpoint (that comes after the setup hooks), so the
        # load goes through it too.
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        # Called after Lightning has filled in weights, optimizer, loops and callback states.
        checkpoint[MANIFEST_KEY] = build_manifest(
            checkpoint, {"world_size": trainer.world_size, "verified": run_label(trainer.strategy)})

    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        problems, has_manifest = [], True
        try:
            verify_manifest(checkpoint)
        except ManifestError as exc:
            problems = exc.problems
            has_manifest = bool(exc.problems)  # no problems listed: there is no manifest at all
        path = trainer.ckpt_path
        if path is not None and os.path.isfile(path):
            # The file as a whole, byte for byte: a flip that leaves the loaded content as it was
            # is still a corrupted file.
            problems = problems + check_container(path)
        if problems:
            raise ManifestError(f"lightning_det: checkpoint {path} is corrupted or edited: first at "
                                f"{problems[0]['entry']}: "
                                + "; ".join(f"{p['entry']}: {p['problem']}" for p in problems[:10]), problems)
        if not has_manifest:
            msg = ("lightning_det: this checkpoint has no manifest, so its bytes and numerical profile "
                   "cannot be verified")
            if self.require_manifest:
                raise RuntimeError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            return
        check_profile(checkpoint)


def _rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    st = {
        "torch": torch.get_rng_state(),
        # Plain Python values, so the checkpoint stays loadable with weights_only=True.
        "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "python": _to_lists(random.getstate()),
        "cuda": None,
    }
    # The current device only (Lightning sets it per rank); get_rng_state_all would create a
    # context on every visible GPU from every rank.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, (tuple, list)) else x


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    name, keys, pos, has_gauss, cached = st["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(_to_tuples(st["python"]))
    if st.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def _same_rng(a: dict, b: dict) -> bool:
    if not torch.equal(a["torch"], b["torch"]) or a["numpy"] != b["numpy"] or a["python"] != b["python"]:
        return False
    ca, cb = a.get("cuda"), b.get("cuda")
    if (ca is None) != (cb is None):
        return False
    return ca is None or torch.equal(ca, cb)


def find_deterministic_samplers(trainer) -> list[DeterministicSampler]:
    """The :class:`DeterministicSampler` objects behind the trainer's training dataloaders."""
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    dls = trainer.train_dataloader
    if isinstance(dls, CombinedLoader):
        dls = dls.flattened
    elif not isinstance(dls, (list, tuple)):
        dls = [dls] if dls is not None else []
    if isinstance(dls, dict):
        dls = list(dls.values())
    found = []
    for dl in dls:
        for s in (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None)):
            if isinstance(s, DeterministicSampler) and s not in found:
                found.append(s)
    return found


class ExactResumeCallback(ManifestCallback):
    """Makes ``fit(ckpt_path=...)`` continue exactly where the saved run stood.

    On save it stores, besides the manifest: the RNG states of every rank (torch CPU and CUDA,
    numpy, python; gathered to rank 0, which writes the file) and the data position of each
    :class:`~lightning_det.data.DeterministicSampler` in the training dataloaders, counted from
    the batches the training loop actually consumed. On load it verifies the manifest and the
    profile, restores the sampler positions before the first batch is drawn, and restores the RNG
    states at the point the saved run would have continued from: at the next epoch start when
    just before the next training batch (when that batch opens an epoch, it then replays the base-seed
    draw a generator-less DataLoader made from the global RNG in the uninterrupted run). A
    checkpoint saved with ``trainer.save_checkpoint`` after ``fit`` stopped mid-epoch at
    ``max_steps`` resumes mid-epoch too (Lightning alone would skip the rest of that epoch).

    Resuming at a different world size is accepted when every saved rank had the same RNG state
    (no per-rank randomness) and the global batch is unchanged; otherwise it is rejected with
    the reason. Optimizer state and counters are restored by Lightning; this callback checks
    that their dtypes survived ``Optimizer.load_state_dict``, which casts floating state to the
    parameter dtype.

    Args:
        require_manifest: see :class:`ManifestCallback`.
    """

    def __init__(self, require_manifest: bool = False) -> None:
        super().__init__(require_manifest=require_manifest)
        self._pending_rng: dict | None = None
        self._pending_samplers: list | None = None
        self._saved_optim_dtypes: list | None = None
        self._trainer_ref = None

    # -- progress --------------------------------------------------------------------------
    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # The loop's own count: a prefetching DataLoader has already fetched further.
        for s in find_deterministic_samplers(trainer):
            s.mark_consumed(batch_idx + 1, epoch=trainer.current_epoch)

    # -- save ------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict:
        import torch.distributed as dist

        trainer = self._trainer_ref
        mine = _rng_state()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rngs: list = [None] * dist.get_world_size()
            dist.all_gather_object(rngs, mine)
        else:
            rngs = [mine]
        return {
            "rng": rngs,
            "world_size": len(rngs),
            "samplers": [s.state_dict() for s in find_deterministic_samplers(trainer)] if trainer else [],
        }

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._trainer_ref = trainer

    # -- load ------------------------------------------------------------------------------
    @override
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        _resume_mid_epoch_fixup(checkpoint)
        self._saved_optim_dtypes = [
            {k: [str(v.dtype) for v in st.values() if isinstance(v, torch.Tensor)] for k, st in o.get("state", {}).items()}
            for o in checkpoint.get("optimizer_states", [])
        ]

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        _check_saved_state(state_dict)
        trainer = self._trainer_ref
        rank, world = trainer.global_rank, trainer.world_size
        rngs = state_dict["rng"]
        if len(rngs) == world:
            self._pending_rng = rngs[rank]
        elif all(_same_rng(rngs[0], r) for r in rngs[1:]):
            self._pending_rng = rngs[0]
        else:
            raise RuntimeError(
                f"lightning_det: cannot resume exactly at world size {world}: the checkpoint was written at "
                f"world size {len(rngs)} and its ranks had different RNG states (per-rank randomness such "
                "as rank-seeded dropout or augmentation). There is no way to split or merge those streams "
                f"bitwise; resume at world size {len(rngs)}."
            )
        self._pending_samplers = state_dict.get("samplers", [])

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        if self._pending_samplers is not None:
            samplers = find_deterministic_samplers(trainer)
            saved = self._pending_samplers
            self._pending_samplers = None
            if len(saved) != len(samplers):
                raise RuntimeError(
                    f"lightning_det: the checkpoint holds the position of {len(saved)} DeterministicSampler(s) "
                    f"but the training dataloaders now use {len(samplers)}; the data position cannot be "
                    "restored, so the resume would not be exact."
                )
            for s, sd in zip(samplers, saved):
                s.load_state_dict(sd)
        if self._saved_optim_dtypes:
            for i, (opt, saved) in enumerate(zip(trainer.optimizers, self._saved_optim_dtypes)):
                sd = opt.state_dict()["state"]
                for k, dtypes in saved.items():
                    now = [str(v.dtype) for v in sd.get(k, {}).values() if isinstance(v, torch.Tensor)]
                    if now != dtypes:
                        raise RuntimeError(
                            f"lightning_det: optimizer {i} state {k} was saved with dtypes {dtypes} but restored as "
                            f"{now} (torch's Optimizer.load_state_dict casts floating state to the parameter dtype); "
                            "the resumed run would not continue bitwise."
                        )
            self._saved_optim_dtypes = None
        if self._pending_rng is not None:
            for dl in _train_loaders(trainer):
                if getattr(dl, "generator", "absent") is None and not isinstance(getattr(dl, "sampler", None), DeterministicSampler):
                    warnings.warn("lightning_det: a training DataLoader without a DeterministicSampler draws its order "
                                  "from the global RNG; the data position is not restored for it.", RuntimeWarning,
                                  stacklevel=2)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending_rng is None:
            return
        # Restore just before the first resumed batch, after whatever Lightning did on restart.
        _set_rng_state(self._pending_rng)
        self._pending_rng = None
        samplers = find_deterministic_samplers(trainer)
        opens_epoch = samplers[0].consumed_chunks == 0 if samplers else batch_idx == 0
        if opens_epoch:
            # The uninterrupted run created a fresh DataLoader iterator between the checkpoint
            # and this batch, and a DataLoader without its own generator draws one int64 base seed
            # from the global torch RNG when it does (torch.utils.data._BaseDataLoaderIter).
            # The resumed run's iterator drew before the restore, so replay that draw here.
            for dl in _train_loaders(trainer):
                if getattr(dl, "generator", "absent") is None:
                    torch.empty((), dtype=torch.int64).random_()


def _check_saved_state(sd) -> None:
    """Refuse a malformed ExactResumeCallback state, naming the entry, before restoring anything."""
    where = "ExactResumeCallback.load_state_dict"
    if not isinstance(sd, dict):
        raise TypeError(f"{where}: expected a dict, got {type(sd).__name__}")
    for key in ("rng", "samplers"):
        if not isinstance(sd.get(key), list):
            raise ValueError(f"{where}: entry {key!r} must be a list, got "
                             f"{type(sd[key]).__name__ if key in sd else 'nothing (missing)'}")
    if not sd["rng"]:
        raise ValueError(f"{where}: entry 'rng' is empty: the RNG state of at least one rank is needed")
    for i, st in enumerate(sd["rng"]):
        name = f"rng[{i}]"
        if not isinstance(st, dict):
            raise ValueError(f"{where}: entry {name!r} must be a dict, got {type(st).__name__}")
        t = st.get("torch")
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
            raise ValueError(f"{where}: entry '{name}/torch' must be a 1-D uint8 tensor (torch.get_rng_state()), "
                             f"got {t if not isinstance(t, torch.Tensor) else f'{t.dtype} {tuple(t.shape)}'!r:.80}")
        n = st.get("numpy")
        if not (isinstance(n, (list, tuple)) and len(n) == 5 and isinstance(n[1], (list, tuple))):
            raise ValueError(f"{where}: entry '{name}/numpy' must be [name, keys, pos, has_gauss, cached], got "
                             f"{n!r:.80}")
        p = st.get("python")
        if not (isinstance(p, (list, tuple)) and len(p) == 3 and isinstance(p[1], (list, tuple))):
            raise ValueError(f"{where}: entry '{name}/python' must be [version, state, gauss] "
                             f"(random.getstate()), got {p!r:.80}")
        c = st.get("cuda")
        if c is not None and not (isinstance(c, torch.Tensor) and c.dtype == torch.uint8):
            raise ValueError(f"{where}: entry '{name}/cuda' must be None or a uint8 tensor, got {c!r:.80}")
    for i, smp in enumerate(sd["samplers"]):
        if not isinstance(smp, dict):
            raise ValueError(f"{where}: entry 'samplers[{i}]' must be a dict, got {type(smp).__name__}")


def _train_loaders(trainer) -> list:
    dls = trainer.train_dataloader
    if dls is None:
        return []
    flat = getattr(dls, "flattened", None)
    if flat is not None:
        return list(flat)
    if isinstance(dls, dict):
        return list(dls.values())
    return list(dls) if isinstance(dls, (list, tuple)) else [dls]


def _resume_mid_epoch_fixup(checkpoint: dict) -> bool:
    """Make Lightning restart mid-epoch from a checkpoint written after ``fit`` stopped mid-epoch.

    When ``max_steps`` (or ``max_time``) ends ``fit`` in the middle of an epoch, Lightning marks
    the epoch completed; a checkpoint saved afterwards (``trainer.save_checkpoint``) makes the
    resumed run start the next epoch and skip the rest of this one. The batch progress still
    says the epoch was not finished, so we roll the epoch counters back one step, which is the
    state an in-loop checkpoint at the same batch would carry. Returns True if it did.
    """
    fl = (checkpoint.get("loops") or {}).get("fit_loop")
    if not fl:
        return False
    ep, bp = fl.get("epoch_progress"), fl.get("epoch_loop.batch_progress")
    if not ep or not bp or bp["current"]["completed"] == 0:
        return False
    t = ep["total"]
    if not (t["ready"] == t["started"] == t["processed"] == t["completed"]) or t["completed"] == 0:
        return False
    if bp.get("is_last_batch"):
        # The epoch really ended, but Lightning would carry its batch count into the next epoch
        # (batch_idx would restart at the old epoch's length). Start the next epoch clean.
        for key in bp["current"]:
            bp["current"][key] = 0
        bp["is_last_batch"] = False
        return True
    for part in ("total", "current"):
        ep[part]["processed"] -= 1
        ep[part]["completed"] -= 1
    if "epoch" in checkpoint:
        checkpoint["epoch"] = ep["total"]["completed"]
    return True
