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
- dropout (``DetDropout``, ``F.dropout``, attention ``dropout_p``) draws masks keyed by
  (``dropout_seed``, step, global sample, call site), from the micro-batch's ``BatchPosition``
  set in every training step: the same mask for a sample at every world size and split;
- value checks of a training step's inputs (cross-entropy targets) are resolved after its
  backward is queued and before its gradients are reduced and applied, not with a host
  synchronization in the forward (``lightning_det.ops.deferred_checks``);
- the step's state (gradient digits, eager rounding, deferred checks, the global-mean flag, the
  GEMM plan mode) is one :class:`~lightning_det.nn.step_state.StepState` that the strategy owns
  (``step_state``) and passes to the det modules and to its function modes;
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
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from typing_extensions import override

from ..nn.function_mode import det_function_mode
from ..nn.grad_digits import set_grad_digits
from ..nn.step_state import BatchPosition, StepState
from ..ops.distributed import det_all_reduce
from ..ops.args import as_index
from ..parallel.audit import OpAudit
from ..parallel.env import apply_strict_environment
from ..parallel.grad_sync import grad_scale_exp, sync_gradients
from ..parallel.loss import feeds_global_loss, global_loss_reduce
from ..parallel.reduce import exact_reduce
from .checkpoint_io import AtomicCheckpointIO
from .precision import exact_norm_clipping

log = logging.getLogger(__name__)

__all__ = ["DeterministicStrategy"]

_GEMM_PLANS = ("auto", "cached", "sync")


def gemm_plans_mode(gemm_plans: str, device_type: str) -> str:
    """The GEMM ``plans`` mode (:func:`lightning_det.ops.det_gemm`) of a strategy's ``gemm_plans``
    on a device: "auto" is "cached" on CUDA (no host synchronization per GEMM in the step) and the
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
        dropout_seed: seed of the keyed dropout masks (:mod:`lightning_det.nn.dropout`); None
            (default) takes ``seed`` (mod 2^63). A separate value changes the masks and keeps the data order.
        audit: audit the ops of the first optimizer step (default True).
        eager_rounding: at world size 1, let each parameter whose gradient provably has one
            contribution in the step's last backward (no earlier micro-batch, one counted use)
            be rounded right there instead of holding 152 bytes per element of digits until
            the step (default True; the same bytes either way, see
            :mod:`lightning_det.nn.step_state`). Turn it off for a second backward through a
            retained graph, which would otherwise raise.
        gemm_plans: how the exact GEMMs plan their integer slices inside training steps (forward
            and backward): ``"auto"`` (default) takes cached plans on CUDA and plans from each
            call's summaries on the CPU; ``"cached"`` a GEMM repeating an earlier call's shapes
            takes the largest of that key's recent plans and reads its own summary later, so the
            step has no host synchronization and the host queues it ahead of the GPU (a step bound
            by its host time runs faster); ``"sync"`` every GEMM waits for its own summaries. The
            bytes are the same under all three (the ``plans`` argument of
            :func:`lightning_det.ops.det_gemm`, which the step state passes to the det modules and
            det attention).
        batch_norm_group_size: None (default): BatchNorm statistics over the whole global
            micro-batch (every rank's current micro-batch: SyncBatchNorm semantics, exact), which
            ``accumulate_grad_batches`` changes; or G: groups of G consecutive global samples
            (ghost batch norm), invariant across world size and accumulation wherever G divides the
            global micro-batch (:mod:`lightning_det.nn.batch_norm`).
    """

    strategy_name = "det_ddp"

    def __init__(
        self, *args: Any, strict: bool = True, seed: int = 0, audit: bool = True, eager_rounding: bool = True,
        gemm_plans: str = "auto", batch_norm_group_size: Optional[int] = None,
        dropout_seed: Optional[int] = None, **kwargs: Any,
    ) -> None:
        if gemm_plans not in _GEMM_PLANS:
            raise ValueError(f"gemm_plans: expected one of {sorted(_GEMM_PLANS)}, got {gemm_plans!r}")
        bn_group = None if batch_norm_group_size is None else as_index(batch_norm_group_size)
        if batch_norm_group_size is not None and (bn_group is None or bn_group < 1):
            raise ValueError(f"batch_norm_group_size: expected None or an integer >= 1, got {batch_norm_group_size!r}")
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
        # the step's state, passed to the det modules (set_grad_digits) and to the function modes
        self.step_state = StepState()
        self.step_state.reduce_digits = self._reduce_digits
        self.step_state.batch_norm_group_size = bn_group
        self.step_state.dropout_seed = self._dropout_seed(dropout_seed)
        self._micro_batch_size: Optional[int] = None  # per rank, set with the training sampler

    def _dropout_seed(self, dropout_seed: Optional[int]) -> int:
        if dropout_seed is None:
            dropout_seed = self.seed % 2**63  # a negative sampler seed maps into the key's range
        value = as_index(dropout_seed)
        if value is None or not 0 <= value < 2**63:
            raise ValueError(f"dropout_seed: expected an integer in [0, 2^63) or None, got {dropout_seed!r}")
        return value

    # ---- set-up --------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Precision:
        plugin = Strategy.precision_plugin.fget(self)  # Lightning's, or a plain one until it installs it
        return exact_norm_clipping(plugin)

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Whichever plugin Lightning hands over (it follows ``precision=``) clips by the exact norm.
        # None stays None: the Trainer takes a plugin already on the strategy as the user's choice
        # and would ignore ``precision=``.
        wrapped = None if precision_plugin is None else exact_norm_clipping(precision_plugin)
        Strategy.precision_plugin.fset(self, wrapped)

    @property
    @override
    def checkpoint_io(self):
        if self._checkpoint_io is None:
            # A crash during a save must leave the previous checkpoint valid (temp + fsync +
            # rename). Made here, not in __init__, so a CheckpointIO in ``plugins=`` still wins.
            self._checkpoint_io = AtomicCheckpointIO()
        return Strategy.checkpoint_io.fget(self)

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        Strategy.checkpoint_io.fset(self, io)

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        module = self.lightning_module
        self.step_state.plans = gemm_plans_mode(self.gemm_plans, self.root_device.type)
        set_grad_digits(module, self.step_state)
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

    @override
    def _setup_model(self, model):
        # Private, but the one place DDPStrategy wraps the model in DistributedDataParallel; no
        # wrapper here: gradients are reduced as digits in optimizer_step.
        return model

    @override
    def _register_ddp_hooks(self) -> None:
        # Private, but DDPStrategy calls it on a model it never wrapped here: there is no DDP to hook.
        return None

    def _sync_initial_states(self) -> None:
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.lightning_module.parameters()) + list(self.lightning_module.buffers()):
                dist.broadcast(t.data, src=0)

    # ---- data ----------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Replaces the training sampler with the world-size independent DeterministicSampler."""
        if not isinstance(dataloader, DataLoader) or self.lightning_module is None:
            return dataloader
        # ``_trainer``: the public ``trainer`` property raises where no Trainer is attached
        trainer = self.lightning_module._trainer
        if trainer is None or not trainer.training:
            return dataloader
        if dataloader.batch_size is None:
            raise ValueError("dataloader: det_ddp needs a DataLoader with a batch_size (per-rank micro-batch)")
        from ..data.sampler import DeterministicSampler

        self._micro_batch_size = dataloader.batch_size
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
    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        # The closure runs the step's last (or only) micro-batch; with one process nothing is
        # reduced after it, so single-contribution gradients may be rounded in the backward.
        eager = self.eager_rounding and self.world_size == 1

        def closure_then_sync():
            with self.step_state.eager_rounding(enabled=eager):
                if self.audit and not self._audited:
                    with OpAudit(self.lightning_module, outside="training_step") as audit:
                        result = closure()
                    self._audited = True
                    if audit.violations():  # before check: strict mode raises there
                        self.det_unverified_reasons.append("ops outside the verified set (see the audit)")
                        self.det_verified = False
                    audit.check(self.strict)
                else:
                    result = closure()
            # the forward's deferred input checks (det_cross_entropy's targets), before anything
            # reduces or applies the gradients they fed: raises on bad input, nothing changed yet
            self.step_state.checks.resolve()
            self.sync_gradients(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    def sync_gradients(self, optimizer) -> dict:
        """Reduces all gradients of ``optimizer``'s params exactly and rounds them once."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        scale = grad_scale_exp(self.world_size, self.step_state.consume_global_mean())
        stats = sync_gradients(params, self.step_state, scale_exp=scale)
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

    def _function_mode(self, state: Optional[StepState]):
        # F.scaled_dot_product_attention / F.cross_entropy in the user's code go to the det
        # versions; cross-entropy means and sums are taken over every rank's rows; code in a
        # training step finds the step state through it (a validation step has none: its checks
        # are decided at once)
        return det_function_mode(strict=self.strict, loss_reduce=global_loss_reduce, state=state)

    def _reduce_digits(self, acc):
        return det_all_reduce(acc) if self.world_size > 1 else acc

    def _batch_position(self, batch_idx: Optional[int]) -> Optional[BatchPosition]:
        """Where this rank's micro-batch ``batch_idx`` sits in its step's global batch (the
        DeterministicSampler's order), or None where the sampler is not det_ddp's."""
        size = self._micro_batch_size
        trainer = self.lightning_module._trainer
        if size is None or trainer is None or not isinstance(batch_idx, int):
            return None
        global_size = size * self.world_size
        micro = batch_idx % max(1, int(trainer.accumulate_grad_batches))
        return BatchPosition(step=int(trainer.global_step), offset=micro * global_size + self.global_rank * size,
                             size=size, global_size=global_size)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # value checks of the step's inputs wait for optimizer_step instead of synchronizing the
        # host in the forward (the step state's checks, lightning_det.ops.deferred_checks)
        batch_idx = kwargs.get("batch_idx", args[1] if len(args) > 1 else None)
        self.step_state.position = self._batch_position(batch_idx)
        try:
            with self._function_mode(self.step_state):
                out = super().training_step(*args, **kwargs)
        except BaseException:
            self.step_state.checks.discard()
            raise
        if not self.lightning_module.automatic_optimization:
            self.step_state.checks.resolve()  # manual optimization: the step's own optimizer_step calls resolved theirs
        return out

    @override
    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        # every micro-batch's backward, manual_backward too: a global loss back-propagated here
        # decides the step's gradient scale
        if isinstance(closure_loss, torch.Tensor) and feeds_global_loss(closure_loss):
            self.step_state.global_mean_used = True
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._function_mode(None):
            return super().validation_step(*args, **kwargs)

    # ---- logging -------------------------------------------------------------------------
    @override
    def reduce(self, tensor, group=None, reduce_op="mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return exact_reduce(tensor, group=group, reduce_op=str(reduce_op) if reduce_op is not None else "mean")

    @property
    def det_label(self) -> str:
        """The run's label for digests and checkpoints: ``"pending"`` while the first step's op
        audit has yet to run, then ``"verified"`` or ``"unverified"``."""
        if self.audit and not self._audited and self.det_verified is not False:
            return "pending"
        return "verified" if self.det_verified else "unverified"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("det_ddp", "popen"), ("det_ddp_spawn", "spawn")):
            strategy_registry.register(
                name, cls, description=f"world-size invariant exact DDP, start_method '{start_method}'",
                start_method=start_method,
            )
