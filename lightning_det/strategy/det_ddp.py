"""DeterministicStrategy (``Trainer(strategy="det_ddp")``): world-size and accumulation
invariant data-parallel training.

How it differs from Lightning's DDPStrategy:
- no DistributedDataParallel wrapper and no bucketed float all-reduce: the model's det modules
  run in digit mode, so gradients stay unrounded long-accumulator digits through backward,
  through every micro-batch of ``accumulate_grad_batches`` and through one int64 SUM all-reduce
  (gloo or NCCL; the same code on CPU and GPU), and are rounded once, before
  ``on_before_optimizer_step`` hooks and clipping see them;
- the global mean is exact: ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` with reduction 'mean'
  or 'sum', and ``lightning_det.global_mean``, reduce over every rank's rows (any N); another
  per-rank mean loss is scaled by 1/N inside the one rounding (N a power of two);
- one global, world-size independent sample order (``DeterministicSampler``): rank r gets its
  slice of every global batch;
- ``F.scaled_dot_product_attention`` and ``F.cross_entropy`` in the model run through the exact,
  device-invariant det versions (``det_function_mode`` around training and validation steps);
- value checks of a training step's inputs (cross-entropy targets) are resolved after its
  backward is queued and before its gradients are reduced and applied, not with a host
  synchronization in the forward (``lightning_det.ops.deferred_checks``);
- gradient-norm clipping is exact (``clip_grad_norm_exact_``); ``self.log(..., sync_dist=True)``
  and ``reduce`` are exact reductions;
- strict environment (deterministic algorithms, TF32 off, cuBLAS workspace, NCCL pinned);
- the first optimizer step is audited op by op against the verified set: strict mode raises
  on anything else, non-strict mode labels the run unverified (``det_verified``).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from ..nn.attention import det_function_mode
from ..ops import slices_guess
from ..ops.args import as_index
from ..ops.deferred_checks import DeferredChecks, deferring_checks
from ..nn.grad_digits import eager_rounding, set_grad_digits
from ..optim.clip import clip_grad_norm_exact_
from ..parallel.audit import OpAudit
from ..parallel.env import apply_strict_environment
from ..parallel.grad_sync import grad_scale_exp, sync_gradients
from ..parallel.loss import consume_global_mean_flag, global_loss_reduce
from ..parallel.reduce import exact_reduce

log = logging.getLogger(__name__)

__all__ = ["DeterministicStrategy"]

_GEMM_PLANS = ("auto", "cached", "sync")


def gemm_plans_mode(gemm_plans: str, device_type: str) -> str:
    """The :func:`lightning_det.ops.slices_guess` mode of a strategy's ``gemm_plans`` on a device:
    "auto" is "cached" on CUDA (no host synchronization per GEMM in the step) and the
    device's default elsewhere (on the CPU a synchronization costs nothing)."""
    if gemm_plans == "auto":
        return "cached" if device_type == "cuda" else "default"
    return gemm_plans


class DeterministicStrategy(DDPStrategy):
    """Data-parallel strategy whose results are bitwise independent of world size and
    micro-batching. Accepts DDPStrategy's arguments plus:

    Args:
        strict: raise on modules/ops outside the verified set (default); False trains anyway
            and labels the run unverified (``self.det_verified = False``).
        seed: seed of the global sample order (DeterministicSampler), default 0.
        audit: audit the ops of the first optimizer step (default True).
        eager_rounding: at world size 1, let each parameter whose gradient provably has one
            contribution in the step's last backward (no earlier micro-batch, one counted use)
            be rounded right there instead of holding 152 bytes per element of digits until
            the step (default True; the same bytes either way, see
            :mod:`lightning_det.nn.grad_digits`). Turn it off for a second backward through a
            retained graph, which would otherwise raise.
        gemm_plans: how the exact GEMMs plan their integer slices inside training steps (forward
            and backward): ``"auto"`` (default) takes cached plans on CUDA and plans from each
            call's summaries on the CPU; ``"cached"`` a GEMM repeating an earlier call's shapes
            takes the largest of that key's recent plans and reads its own summary later, so the
            step has no host synchronization and the host queues it ahead of the GPU (on the
            H200 the steady-state det_ddp step took 15.0 instead of 21.8 ms: benchmarks/NOTES.md,
            session 18); ``"sync"`` every GEMM waits for its own summaries. The bytes are the same
            under all three (:func:`lightning_det.ops.slices_guess`).
    """

    strategy_name = "det_ddp"

    def __init__(
        self, *args: Any, strict: bool = True, seed: int = 0, audit: bool = True, eager_rounding: bool = True,
        gemm_plans: str = "auto", **kwargs: Any,
    ) -> None:
        if gemm_plans not in _GEMM_PLANS:
            raise ValueError(f"gemm_plans: expected one of {sorted(_GEMM_PLANS)}, got {gemm_plans!r}")
        # Before anything touches CUDA or NCCL (the Trainer builds strategies first).
        self.det_environment = apply_strict_environment()
        super().__init__(*args, **kwargs)
        self.strict = strict
        seed_int = as_index(seed)  # a Python or NumPy integer; a float is refused, not truncated
        if seed_int is None:
            raise TypeError(f"seed: expected an integer, got {type(seed).__name__} {seed!r}")
        self.seed = seed_int
        self.audit = audit
        self.eager_rounding = bool(eager_rounding)
        self.gemm_plans = gemm_plans
        self.det_verified: Optional[bool] = None
        self.det_unverified_reasons: list = []
        self.det_last_sync: dict = {}
        self._audited = False
        self._checks = DeferredChecks()  # the current step's deferred input checks

    # ---- set-up --------------------------------------------------------------------------
    def setup(self, trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        set_grad_digits(module, True)
        unverified = list(getattr(module, "ldet_unverified", []) or [])
        for name, m in module.named_modules():
            if getattr(m, "ldet_unverified", None) and m is not module:
                unverified += list(m.ldet_unverified)
        if unverified:
            self.det_unverified_reasons += [f"module {u}" for u in unverified]
        # Known before the first step (run headers are written then); the op audit of the first
        # step can still downgrade it (non-strict) or stop the run (strict).
        self.det_verified = not self.det_unverified_reasons
        self._sync_initial_states()
        self._patch_clipping()

    def _setup_model(self, model):
        # No DistributedDataParallel: gradients are reduced as digits in optimizer_step.
        return model

    def _register_ddp_hooks(self) -> None:
        return None

    def _sync_initial_states(self) -> None:
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.lightning_module.parameters()) + list(self.lightning_module.buffers()):
                dist.broadcast(t.data, src=0)

    def _patch_clipping(self) -> None:
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer, clip_val):
            params = [p for g in optimizer.param_groups for p in g["params"]]
            clip_grad_norm_exact_(params, float(clip_val))

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # ---- data ----------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        """Replaces the training sampler with the world-size independent DeterministicSampler."""
        if not isinstance(dataloader, DataLoader) or self.lightning_module is None:
            return dataloader
        trainer = self.lightning_module._trainer
        if trainer is None or not trainer.training:
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError("dataloader: det_ddp needs a DataLoader with a batch_size (per-rank micro-batch)")
        from ..data.sampler import DeterministicSampler

        if isinstance(dataloader.sampler, DeterministicSampler):
            return dataloader
        shuffle = isinstance(dataloader.sampler, RandomSampler) or (
            isinstance(dataloader.sampler, DistributedSampler) and dataloader.sampler.shuffle
        )
        sampler = DeterministicSampler(
            len(dataloader.dataset), dataloader.batch_size, num_replicas=self.world_size,
            rank=self.global_rank, shuffle=shuffle, seed=self.seed,
        )
        return DataLoader(
            dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
            num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
            pin_memory=dataloader.pin_memory, drop_last=False, persistent_workers=dataloader.persistent_workers,
        )

    # ---- the step ------------------------------------------------------------------------
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        # The closure runs the step's last (or only) micro-batch; with one process nothing is
        # reduced after it, so single-contribution gradients may be rounded in the backward.
        eager = self.eager_rounding and self.world_size == 1

        def closure_then_sync():
            with eager_rounding(self.lightning_module, enabled=eager):
                if self.audit and not self._audited:
                    with OpAudit(self.lightning_module) as audit:
                        result = closure()
                    self._audited = True
                    ok = audit.check(self.strict)
                    if not ok:
                        self.det_unverified_reasons.append("ops outside the verified set (see warning)")
                else:
                    result = closure()
            # the forward's deferred input checks (det_cross_entropy's targets), before anything
            # reduces or applies the gradients they fed: raises on bad input, nothing changed yet
            self._checks.resolve()
            self.sync_gradients(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    def sync_gradients(self, optimizer) -> dict:
        """Reduces all gradients of ``optimizer``'s params exactly and rounds them once."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        scale = grad_scale_exp(self.world_size, consume_global_mean_flag())
        stats = sync_gradients(params, scale_exp=scale)
        if stats["rounded_only"] and "params with rounded-only gradients" not in self.det_unverified_reasons:
            self.det_unverified_reasons.append("params with rounded-only gradients")
            msg = (f"{stats['rounded_only']} parameter(s) received ordinary rounded gradients (not from det "
                   "modules): their sums are exact across ranks but not world-size invariant")
            if self.strict:
                raise RuntimeError(msg + ". Run det_transform(model) or pass strict=False.")
            warnings.warn(msg)
        self.det_verified = not self.det_unverified_reasons
        self.det_last_sync = stats
        return stats

    def _function_mode(self):
        # F.scaled_dot_product_attention / F.cross_entropy in the user's code go to the det
        # versions; cross-entropy means and sums are taken over every rank's rows
        return det_function_mode(strict=self.strict, loss_reduce=global_loss_reduce)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # value checks of the step's inputs wait for optimizer_step instead of synchronizing the
        # host in the forward (lightning_det.ops.deferred_checks)
        try:
            with self._function_mode(), deferring_checks(self._checks), self._gemm_plans():
                out = super().training_step(*args, **kwargs)
        except BaseException:
            self._checks.discard()
            raise
        if not self.lightning_module.automatic_optimization:
            self._checks.resolve()  # manual optimization: the step's own optimizer_step calls resolved theirs
        return out

    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        with self._gemm_plans():  # every micro-batch's backward, manual_backward too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _gemm_plans(self):
        return slices_guess(gemm_plans_mode(self.gemm_plans, self.root_device.type))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._function_mode():
            return super().validation_step(*args, **kwargs)

    # ---- logging -------------------------------------------------------------------------
    def reduce(self, tensor, group=None, reduce_op="mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return exact_reduce(tensor, group=group, reduce_op=str(reduce_op) if reduce_op is not None else "mean")

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("det_ddp", "popen"), ("det_ddp_spawn", "spawn")):
            strategy_registry.register(
                name, cls, description=f"world-size invariant exact DDP, start_method '{start_method}'",
                start_method=start_method,
            )
