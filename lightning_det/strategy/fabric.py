"""``Fabric(strategy="det_ddp")``: the same exact reduction as the Trainer strategy.

Usage is ordinary Fabric; the reduction happens inside ``optimizer.step()``:

    fabric = Fabric(accelerator="cpu", devices=2, strategy="det_ddp"); fabric.launch()
    model, opt = fabric.setup(det_transform(model), opt)
    for micro_batch in ...:
        fabric.backward(global_mean(per_sample_loss(model(x), y)))  # digits accumulate
    opt.step()   # one exact all-reduce, one rounding, then the optimizer
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from typing_extensions import override

from ..nn.grad_digits import set_grad_digits
from ..nn.step_state import StepState
from ..optim.clip import clip_grad_norm_exact_
from ..parallel.env import apply_strict_environment
from ..parallel.grad_sync import grad_scale_exp, sync_gradients
from ..parallel.loss import feeds_global_loss
from ..parallel.reduce import exact_reduce
from .checkpoint_io import AtomicCheckpointIO

__all__ = ["FabricDeterministicStrategy"]


class _NothingToBlock(_BackwardSyncControl):
    """Nothing is communicated during backward (gradients are reduced in ``optimizer.step()``),
    so ``fabric.no_backward_sync(model)`` has nothing to skip."""

    @override
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class FabricDeterministicStrategy(FabricDDPStrategy):
    """Fabric's DDPStrategy without the DDP wrapper; gradients reduced as digits.

    The step's state (gradient digits, the global-mean flag) is one StepState the strategy owns
    (``step_state``) and binds to the det modules of every module it sets up.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.det_environment = apply_strict_environment()
        super().__init__(*args, **kwargs)
        self.det_last_sync: dict = {}
        self.step_state = StepState()
        self._synced = False  # clip_gradients may sync before optimizer.step does
        # Private, but the one object fabric.no_backward_sync asks; DDPStrategy's would demand a
        # DistributedDataParallel wrapper, which this strategy never makes.
        self._backward_sync_control = _NothingToBlock()

    @property
    @override
    def checkpoint_io(self):
        if self._checkpoint_io is None:
            # fabric.save must leave the previous checkpoint valid when a crash cuts it short;
            # made here, not in __init__, so a CheckpointIO in ``plugins=`` still wins
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io) -> None:
        self._checkpoint_io = io

    def _sync(self, optimizer) -> None:
        if not self._synced:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            scale = grad_scale_exp(self.world_size, self.step_state.consume_global_mean())
            self.det_last_sync = sync_gradients(params, self.step_state, scale_exp=scale)
            self._synced = True

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        set_grad_digits(module, self.step_state)
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    dist.broadcast(t.data, src=0)
        return module

    @override
    def backward(self, tensor: torch.Tensor, module, *args: Any, **kwargs: Any) -> None:
        # a global loss back-propagated here decides the step's gradient scale
        if feeds_global_loss(tensor):
            self.step_state.global_mean_used = True
        return super().backward(tensor, module, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        self._sync(optimizer)
        self._synced = False
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type: det_ddp clips exactly with the 2-norm only, got {norm_type}")
        self._sync(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return torch.tensor(clip_grad_norm_exact_(params, float(max_norm)))

    @override
    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        if isinstance(tensor, torch.Tensor):
            return exact_reduce(tensor, group=group, reduce_op=str(reduce_op) if reduce_op is not None else "mean")
        return tensor

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        for name, start_method in (("det_ddp", "popen"), ("det_ddp_spawn", "spawn")):
            strategy_registry.register(name, cls, description=f"exact world-size invariant DDP ({start_method})",
                                       start_method=start_method)
