"""Coverage audit: which aten ops ran in a training step, and are they in the verified set?

The verified set is data (VERIFIED_OPS below, and the README's table). An op belongs there when
its result for an element depends only on that element's own inputs and is computed with
correctly rounded IEEE arithmetic (elementwise +, -, *, /, comparisons, selects), or moves data
without arithmetic (views, copies, indexing, concatenation, dtype casts). Ops that reduce
across elements (sum, mean, matmul, norms, softmax across a batch) are not: inside our own det
modules and ops they are replaced by exact long-accumulator kernels, and the audit skips what
runs inside those (the ``trusted()`` regions). The PyTorch functions det_ddp sends to det versions
(``F.cross_entropy``, ``F.scaled_dot_product_attention``) are listed, with what was verified
where, in VERIFIED_FUNCTIONS (lightning_det.nn.verified).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..nn.verified import VERIFIED_FUNCTIONS
from ..ops.trust import in_trusted, trusted

__all__ = ["VERIFIED_OPS", "VERIFIED_FUNCTIONS", "OpAudit", "UnverifiedOpError", "trusted"]



_ELEMENTWISE = """add sub mul div neg abs sign where relu threshold_backward clamp clamp_min clamp_max
maximum minimum eq ne lt le gt ge logical_not logical_and logical_or bitwise_and bitwise_or
bitwise_xor masked_fill fill zero ones_like zeros_like full_like rsub reciprocal sqrt
square pow_scalar lerp addcmul addcdiv copysign""".split()
_DATA_MOVEMENT = """view _unsafe_view reshape t transpose permute expand squeeze unsqueeze select slice
clone contiguous copy_ copy _to_copy to detach alias cat stack split split_with_sizes chunk
narrow index index_select gather embedding embedding_dense_backward_exact unbind flatten
empty empty_like empty_strided zeros ones full arange new_empty new_zeros new_ones new_full
new_empty_strided scalar_tensor lift_fresh _local_scalar_dense as_strided view_as repeat
one_hot scatter_ index_put_ masked_select triu tril lift_fresh_copy _reshape_alias set_ resize_
_unsafe_index sort""".split()
_SELECTION = "aminmax amax amin max min argmax argmin".split()

#: aten op name -> why it is verified. ldet::* ops are verified by construction.
VERIFIED_OPS: Dict[str, str] = {
    **{f"aten.{n}": "elementwise, correctly rounded IEEE (position- and batch-invariant)" for n in _ELEMENTWISE},
    **{f"aten.{n}": "data movement or creation, no arithmetic" for n in _DATA_MOVEMENT},
    **{f"aten.{n}": "selection (max/min): exact and order-free" for n in _SELECTION},
}

#: Row-wise ops verified on the sizes the tests cover: each output row depends only on its own
#: input row (checked for row-count invariance on CPU and CUDA in tests/test_audit_ops.py). Not
#: device invariant (CPU and CUDA exp/log differ): under det_ddp, F.cross_entropy does not reach
#: them (it runs det_cross_entropy); they remain for a hand-written log_softmax + nll_loss.
ROWWISE_OPS: Dict[str, str] = {
    "aten._log_softmax": "row-wise over the last dim",
    "aten._log_softmax_backward_data": "row-wise over the last dim",
    "aten.nll_loss_forward": "per-sample pick with reduction='none' only",
    "aten.nll_loss_backward": "per-sample scatter with reduction='none' only",
}


class UnverifiedOpError(RuntimeError):
    """An op outside the verified set ran under det_ddp in strict mode."""


def _op_name(func) -> str:
    name = str(func.overloadpacket)  # e.g. "aten.add"
    return name


class OpAudit(TorchDispatchMode):
    """Records (op, module) pairs of the ops that run while active, outside trusted regions.

    Use it around the first training step. ``violations()`` lists ops outside the verified set,
    each with the qualified name of the module whose forward was running (or "backward").
    """

    def __init__(self, model: Optional[nn.Module] = None):
        super().__init__()
        self.records: List[Tuple[str, str]] = []
        self._stack: List[str] = []
        self._handles = []
        if model is not None:
            for fqn, m in model.named_modules():
                self._handles.append(m.register_forward_pre_hook(self._enter(fqn or type(m).__name__)))
                self._handles.append(m.register_forward_hook(self._leave()))

    def _enter(self, fqn):
        def hook(_m, _args):
            self._stack.append(fqn)

        return hook

    def _leave(self):
        def hook(_m, _args, _out):
            if self._stack:
                self._stack.pop()

        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not in_trusted() and not str(func.namespace).startswith("profiler"):
            name = _op_name(func)
            if name.startswith("aten.nll_loss") and len(args) > 3 and args[3] != 0 and name.endswith("forward"):
                name = f"{name}(reduction={args[3]})"
            self.records.append((name, self._stack[-1] if self._stack else "backward"))
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    def violations(self) -> List[Tuple[str, str]]:
        seen, out = set(), []
        for name, where in self.records:
            base = name.split("(")[0]
            ok = (base.startswith("ldet.") or name in VERIFIED_OPS or name in ROWWISE_OPS) and "(" not in name
            if not ok and (name, where) not in seen:
                seen.add((name, where))
                out.append((name, where))
        return out

    def check(self, strict: bool) -> bool:
        """Raises (strict) or warns (non-strict) on violations. Returns True when verified."""
        bad = self.violations()
        if not bad:
            return True
        lines = "\n".join(f"  {op}  (in module '{where}')" for op, where in bad[:20])
        msg = (
            f"{len(bad)} op(s) outside lightning_det's verified set ran in the training step:\n{lines}\n"
            "Fix: replace the module with a covered one (det_transform covers nn.Linear, nn.Embedding, "
            "nn.LayerNorm, nn.RMSNorm, GELU/SiLU/ReLU/Tanh), compute losses with F.cross_entropy (exact "
            "under det_ddp) or lightning_det.global_mean, or run with DeterministicStrategy(strict=False) "
            "to train with the run labelled unverified."
        )
        if strict:
            raise UnverifiedOpError(msg)
        warnings.warn(msg, stacklevel=2)
        return False
