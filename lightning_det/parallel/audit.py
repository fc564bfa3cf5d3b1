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

Integer arithmetic is exact: any op whose tensor inputs (one at least) and outputs are all
integer or bool (HF's position ids from ``cumsum`` of an attention mask, index arithmetic) is
verified, recorded as ``aten.<op>[integer]``, except random draws and sorts, whose ties (and
draws) are not a function of the values.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..nn.transform import supported_summary
from ..nn.verified import VERIFIED_FUNCTIONS
from ..ops.trust import in_trusted, trusted

__all__ = ["VERIFIED_OPS", "PROJECT_OPS", "INTEGER_OPS", "ONE_DEVICE", "CPU_EQ_CUDA", "VERIFIED_FUNCTIONS", "OpAudit",
           "UnverifiedOpError", "trusted"]

_ELEMENTWISE = """add sub mul div neg abs sign where relu threshold_backward clamp clamp_min clamp_max
maximum minimum eq ne lt le gt ge logical_not logical_and logical_or bitwise_and bitwise_or
bitwise_xor masked_fill fill zero ones_like zeros_like full_like rsub reciprocal sqrt
square pow_scalar lerp addcmul addcdiv copysign""".split()
# In-place forms of the ops above: the same kernels writing into their input.
_IN_PLACE = "add_ sub_ mul_ div_ neg_ relu_ clamp_ masked_fill_ fill_ zero_".split()
# Not correctly rounded, so CPU and CUDA may differ; on one device each element's bits depend on
# that element alone (tested at odd widths, row counts, offsets and thread counts)
_TESTED_ELEMENTWISE = "cos sin pow rsqrt exp log tanh erf".split()
_DATA_MOVEMENT = """view _unsafe_view reshape t transpose permute expand squeeze unsqueeze select slice
clone contiguous copy_ copy _to_copy to detach alias cat stack split split_with_sizes chunk
narrow index index_select gather embedding embedding_dense_backward_exact unbind flatten
empty empty_like empty_strided zeros ones full arange new_empty new_zeros new_ones new_full
new_empty_strided scalar_tensor lift_fresh _local_scalar_dense as_strided view_as repeat
one_hot scatter_ index_put_ masked_select triu tril lift_fresh_copy _reshape_alias set_ resize_
_unsafe_index sort slice_backward select_backward constant_pad_nd""".split()
_SELECTION = "aminmax amax amin max min argmax argmin hardtanh hardtanh_ hardtanh_backward".split()

#: The two levels of the contract an op is verified at (DESIGN.md section 1).
ONE_DEVICE = "world size and batch invariant on one device"
CPU_EQ_CUDA = "world size and batch invariant, and the same bytes on CPU and CUDA"


class VerifiedOp(NamedTuple):
    why: str
    level: str


#: aten op name -> why it is verified, and at which level. ldet::* ops: PROJECT_OPS.
VERIFIED_OPS: Dict[str, VerifiedOp] = {
    **{f"aten.{n}": VerifiedOp("elementwise, correctly rounded IEEE (position- and batch-invariant)", ONE_DEVICE)
       for n in _ELEMENTWISE + _IN_PLACE},
    **{f"aten.{n}": VerifiedOp("elementwise; position, row-count and thread-count invariance tested on CPU "
                               "at odd widths (tests/test_verified_ops.py)", ONE_DEVICE)
       for n in _TESTED_ELEMENTWISE},
    **{f"aten.{n}": VerifiedOp("data movement or creation, no arithmetic", ONE_DEVICE) for n in _DATA_MOVEMENT},
    **{f"aten.{n}": VerifiedOp("selection (max/min, a clamp): exact and order-free", ONE_DEVICE) for n in _SELECTION},
}

#: Ops whose integer form is still not a function of the inputs' values: random draws, and sorts
#: and selections whose order among equal keys is the kernel's (an unstable sort).
_INTEGER_RANDOM = ("rand", "random", "normal", "uniform", "bernoulli", "multinomial", "exponential", "geometric",
                   "cauchy", "log_normal", "poisson")
_INTEGER_ORDERED = {"sort", "argsort", "topk", "kthvalue", "mode", "median", "nanmedian", "unique_consecutive",
                    "_unique", "_unique2", "unique_dim", "msort"}
INTEGER_OPS = VerifiedOp("integer or bool tensors only: exact integer arithmetic", CPU_EQ_CUDA)


def _integral(t) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())


def _integer_only(func, args, kwargs, out) -> bool:
    """Whether an op call computed on integer/bool tensors alone (module docstring)."""
    base = func.__name__.split(".")[0]
    if base.startswith(_INTEGER_RANDOM) or base.lstrip("_").startswith(_INTEGER_RANDOM) or base in _INTEGER_ORDERED:
        return False
    ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(ins) and all(_integral(t) for t in ins + outs)


#: The project's own kernels (``torch.ops.ldet``): exact sums and fp64 math written once for both builds.
PROJECT_OPS: Dict[str, VerifiedOp] = {
    "ldet.*": VerifiedOp("long-accumulator sums and csrc/detmath.h, one source for CPU and CUDA", CPU_EQ_CUDA),
}

# Inputs for which a verified op is not invariant on the CPU (its vector body and scalar tail
# round differently): add/sub with alpha != 1 in bf16/fp16, rsqrt below fp32, and pow unless the
# exponent is the number 1, 2 or 3 (which PyTorch computes as a copy or products; x.square()'s
# backward takes pow(x, 1)); or not a data movement: index_put_ with accumulate=True on floats
# (repeated positions summed in an unfixed order). The audit names such a call with a
# qualifier, e.g. "aten.add(alpha, torch.bfloat16)", which is not verified.
_HALF = (torch.bfloat16, torch.float16)
_POW_EXPONENTS = (1, 2, 3)


def _qualifier(name: str, args, kwargs) -> str:
    if name == "aten.index_put_":  # accumulate=True sums repeated positions in an unfixed order
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        return "(accumulate)" if accumulate and args[0].is_floating_point() else ""
    if name in ("aten.pow", "aten.pow_"):
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        ok = isinstance(args[0], torch.Tensor) and not isinstance(exponent, torch.Tensor) and exponent in _POW_EXPONENTS
        return "" if ok else "(exponent)"
    t = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if t is None or t.dtype not in _HALF:
        return ""
    if name in ("aten.add", "aten.add_", "aten.sub", "aten.sub_") and kwargs.get("alpha", 1) != 1:
        return f"(alpha, {t.dtype})"
    if name in ("aten.rsqrt", "aten.rsqrt_"):
        return f"({t.dtype})"
    return ""


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
    """An op outside the verified set ran under det_ddp in strict mode.

    ``violations`` lists every ``(op, where, count)`` found, the same as the message.
    """

    def __init__(self, msg: str, violations: List[Tuple[str, str, int]] = ()):
        super().__init__(msg)
        self.violations = list(violations)


def _op_name(func) -> str:
    return str(func.overloadpacket)  # e.g. "aten.add"


def _where_label(fqn: str, module: nn.Module) -> str:
    return f"'{fqn or '<root>'}' ({type(module).__name__})"


class OpAudit(TorchDispatchMode):
    """Records the ops that run while active, outside trusted regions, with where each ran.

    Use it around the first training step. ``violations()`` lists ops outside the verified set
    with a count, each attributed to the module whose forward was running (``'net.2'
    (Dropout)``), to the autograd node whose backward ran (``backward of MeanBackward0``), or,
    for forward code outside every module, to ``outside`` (det_ddp passes "training_step").

    Args:
        model: the module whose submodules' forwards are tracked (None: nothing is).
        outside: the label of forward ops outside every tracked module.
    """

    def __init__(self, model: Optional[nn.Module] = None, outside: str = "code outside any module"):
        super().__init__()
        if not isinstance(outside, str) or not outside:
            raise TypeError(f"outside: expected a non-empty str, got {outside!r}")
        self.records: List[Tuple[str, str]] = []
        self.outside = outside
        self._stack: List[str] = []
        self._handles = []
        if model is not None:
            for fqn, m in model.named_modules():
                self._handles.append(m.register_forward_pre_hook(self._enter(_where_label(fqn, m))))
                self._handles.append(m.register_forward_hook(self._leave()))

    def _enter(self, where):
        def hook(_m, _args):
            self._stack.append(where)

        return hook

    def _leave(self):
        def hook(_m, _args, _out):
            if self._stack:
                self._stack.pop()

        return hook

    def _where(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:  # the autograd engine is running this node's backward formula
            return f"backward of {node.name()}"
        return self._stack[-1] if self._stack else self.outside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not in_trusted() and not str(func.namespace).startswith("profiler"):
            name = _op_name(func)
            if name.startswith("aten.nll_loss") and len(args) > 3 and args[3] != 0 and name.endswith("forward"):
                name = f"{name}(reduction={args[3]})"
            name += _qualifier(name, args, kwargs)
            if name not in VERIFIED_OPS and _integer_only(func, args, kwargs, out):
                name += "[integer]"
            self.records.append((name, self._where()))
        return out

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return super().__exit__(*exc)

    def violations(self) -> List[Tuple[str, str, int]]:
        """Every (op, where, count) outside the verified set, in order of first appearance."""
        counts: Dict[Tuple[str, str], int] = {}
        for name, where in self.records:
            base = name.split("(")[0]
            ok = (base.startswith("ldet.") or name in VERIFIED_OPS or name in ROWWISE_OPS
                  or name.endswith("[integer]")) and "(" not in name
            if not ok:
                counts[(name, where)] = counts.get((name, where), 0) + 1
        return [(name, where, n) for (name, where), n in counts.items()]

    def check(self, strict: bool) -> bool:
        """Raises (strict) or warns (non-strict) on violations. Returns True when verified."""
        bad = self.violations()
        if not bad:
            return True
        calls = sum(n for _, _, n in bad)
        lines = "\n".join(f"  {op} x{n} in {where}" for op, where, n in bad)
        msg = (
            f"{len(bad)} op(s) outside lightning_det's verified set ran in the training step "
            f"({calls} call(s)):\n{lines}\n"
            f"Fix: replace the module with a covered one (det_transform swaps {supported_summary()}), "
            "compute losses with F.cross_entropy (exact under det_ddp) or lightning_det.global_mean, or "
            "run with DeterministicStrategy(strict=False) to train with the run labelled unverified."
        )
        if strict:
            raise UnverifiedOpError(msg, bad)
        warnings.warn(msg, stacklevel=2)
        return False
