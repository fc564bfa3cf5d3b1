"""AdamWSR: fused AdamW with deterministic, shard-invariant stochastic rounding to bf16.

A drop-in for ``torch.optim.AdamW``. Parameters may be fp32 or bf16, gradients fp32 or bf16;
``exp_avg`` and ``exp_avg_sq`` are always fp32 (also after ``load_state_dict``). With bf16
parameters there is no fp32 master copy: the fp32 result of the update is rounded to bf16
stochastically and without bias, so updates far below one bf16 ULP still accumulate.

Exact arithmetic (numerical profile ``ldet-v1``; identical bytes on CPU and CUDA)
-------------------------------------------------------------------------------
Host, in fp64 (Python floats), for a parameter whose step counter has just become ``t``::

    pow(b, t)        = binary exponentiation by repeated fp64 squaring (not libm pow, which
                       is not correctly rounded and could differ between machines)
    decay            = 1 - lr * weight_decay
    step_size        = lr / (1 - pow(beta1, t))
    bc2_sqrt         = sqrt(1 - pow(beta2, t))
    one_minus_beta1  = 1 - beta1,   one_minus_beta2 = 1 - beta2

Each is rounded once to fp32 (nearest even), as are beta1, beta2 and eps. Device, per element,
one correctly rounded fp32 operation per line, in this order, no FMA contraction::

    m     = (beta1 * m) + (one_minus_beta1 * g)
    v     = (beta2 * v) + (one_minus_beta2 * (g * g))
    p     = p * decay
    denom = (sqrt(v) / bc2_sqrt) + eps
    p     = p - (step_size * (m / denom))

This is torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments), so fp32
parameters track it to rounding error. For a bf16 parameter, ``p`` and ``g`` are widened
exactly to fp32 and the final ``p`` is written back with stochastic rounding: with ``u`` its
fp32 bits and ``r`` a 16-bit random draw, the bf16 bits are ``(u + r) >> 16``; inf passes
through, NaN stays NaN (quiet, high payload and sign kept). ``E[bf16] = p`` exactly.

Randomness
----------
``r`` is a pure function of (seed, step, global index), drawn from counter-based Philox4x32-10
(csrc/philox.h): key = the 64-bit seed, counter = (global index // 8, step), one 16-bit slice
of the 128-bit output per index. The global index of element ``i`` (row-major offset) of a
parameter is ``base_index + i``:

* if the parameter's group has a ``base_index`` key, the group's first parameter starts there
  and the group's later parameters follow on contiguously, in order;
* otherwise ``base_index`` is the number of elements of all parameters before it, counted in
  param-group order across all groups.

So a parameter split into shards, each in a group with ``base_index`` = the shard's offset in
the whole (flattened) parameter, updates bitwise identically to the whole parameter, on any
number of ranks, threads or devices.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional

import torch

from ..ops.args import as_index
from ..ops.optim import adamw_sr_step, sr_round_bf16

__all__ = ["AdamWSR", "stochastic_round_bf16"]

_SUPPORTED = (torch.float32, torch.bfloat16)
_U64 = 1 << 64


def _powi(b: float, n: int) -> float:
    # Fixed sequence of IEEE fp64 multiplies: the same bytes on every machine, unlike libm pow.
    # A negative n would shift towards -1 forever, so it is refused.
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"AdamWSR: the step count must be an int >= 0, got {n!r}")
    result, base = 1.0, float(b)
    while n:
        if n & 1:
            result *= base
        base *= base
        n >>= 1
    return result


def _host_scalars(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  step: int) -> dict:
    lr, beta1, beta2 = float(lr), float(beta1), float(beta2)
    return {
        "decay": 1.0 - lr * float(weight_decay),
        "beta1": beta1,
        "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "step_size": lr / (1.0 - _powi(beta1, step)),
        "bias_correction2_sqrt": math.sqrt(1.0 - _powi(beta2, step)),
        "eps": float(eps),
    }


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"AdamWSR: {name} must be a number or a one-element tensor, "
                             f"got shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"AdamWSR: {name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"AdamWSR: {name} must be finite, got {value}")
    return value


def _check_hparams(lr, betas, eps, weight_decay, seed) -> None:
    if _as_float("lr", lr) < 0.0:
        raise ValueError(f"AdamWSR: lr must be >= 0, got {lr}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"AdamWSR: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= _as_float(f"betas[{i}]", b) < 1.0:
            raise ValueError(f"AdamWSR: betas[{i}] must be in [0, 1), got {b}")
    if _as_float("eps", eps) < 0.0:
        raise ValueError(f"AdamWSR: eps must be >= 0, got {eps}")
    if _as_float("weight_decay", weight_decay) < 0.0:
        raise ValueError(f"AdamWSR: weight_decay must be >= 0, got {weight_decay}")
    seed_int = as_index(seed)
    if seed_int is None or not 0 <= seed_int < _U64:
        raise ValueError(f"AdamWSR: seed must be an int in [0, 2**64), got {seed!r}")


def _signed64(x: int) -> int:
    # The op schema's int is int64; the kernels reinterpret the bits as uint64.
    return x - _U64 if x >= 1 << 63 else x


class AdamWSR(torch.optim.Optimizer):
    """AdamW with a fused per-parameter kernel and deterministic stochastic rounding for bf16.

    Args:
        params: parameters or param groups (dicts). Each parameter is a dense, contiguous fp32
            or bf16 tensor of any shape on the CPU or a CUDA GPU. A group may carry
            ``base_index`` (int >= 0), the global index of its first element (module docstring).
        lr: learning rate, >= 0.
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the bias-corrected sqrt(v), >= 0.
        weight_decay: decoupled weight decay, >= 0 (``p *= 1 - lr * weight_decay``).
        seed: int in [0, 2**64), keys the rounding randomness; saved in the param groups.

    State per parameter: ``step`` (0-dim int64 CPU tensor, the number of updates applied),
    ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape and device).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, seed: int = 0) -> None:
        _check_hparams(lr, betas, eps, weight_decay, seed)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        seed=as_index(seed))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                       group["seed"])
        group["seed"] = as_index(group["seed"])  # a NumPy integer would not survive weights_only load
        if group.get("base_index") is not None:
            base = as_index(group["base_index"])
            if base is None or base < 0:
                raise ValueError("AdamWSR: param group 'base_index' must be an int >= 0, "
                                 f"got {group['base_index']!r}")
            group["base_index"] = base
        for p in group["params"]:
            if p.is_complex():
                raise TypeError(f"AdamWSR: complex parameters are not supported (got {p.dtype}); "
                                "optimize torch.view_as_real(p) instead")
            if not p.is_floating_point():
                raise TypeError(f"AdamWSR: parameters must be floating point, got {p.dtype}")
            if p.dtype not in _SUPPORTED:
                raise TypeError(f"AdamWSR: parameters must be float32 or bfloat16, got {p.dtype}")
            if p.layout != torch.strided:
                raise TypeError("AdamWSR: parameters must be dense (strided) tensors, "
                                f"got {p.layout}")
            if p.device.type not in ("cpu", "cuda"):
                raise TypeError("AdamWSR: parameters must be on the CPU or a CUDA GPU, "
                                f"got {p.device}")

    def _default_base_indices(self) -> dict:
        offsets, total = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                offsets[p] = total
                total += p.numel()
        return offsets

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter that has a gradient; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        defaults = None
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, wd, seed = group["eps"], group["weight_decay"], group["seed"]
            _check_hparams(lr, (beta1, beta2), eps, wd, seed)  # schedulers may have changed them
            lr = _as_float("lr", lr)
            running = group.get("base_index")
            for p in group["params"]:
                if running is None:
                    if defaults is None:
                        defaults = self._default_base_indices()
                    base = defaults[p]
                else:
                    base = running
                    running += p.numel()
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("AdamWSR does not support sparse gradients; use a dense "
                                       "embedding (sparse=False) or torch.optim.SparseAdam")
                if grad.dtype not in _SUPPORTED:
                    raise TypeError("AdamWSR: gradients must be float32 or bfloat16, "
                                    f"got {grad.dtype}")
                if not p.is_contiguous():
                    raise RuntimeError("AdamWSR: parameters must be contiguous (the random draw "
                                       "of an element is keyed by its offset); got strides "
                                       f"{p.stride()}")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.zeros((), dtype=torch.int64)
                    fmt = torch.contiguous_format
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=fmt)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=fmt)
                state["step"] += 1
                t = int(state["step"])
                s = _host_scalars(lr, beta1, beta2, eps, wd, t)
                adamw_sr_step(p, grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], s["decay"],
                   s["beta1"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"],
                   s["step_size"], s["bias_correction2_sqrt"], s["eps"], _signed64(seed), t, base)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads an AdamWSR state dict after checking every entry; nothing changes if one is bad.

        Checked: each saved param group has a ``seed`` and valid hyper-parameters, and carries
        ``base_index`` exactly when this optimizer's group does (the random draws depend on
        it); each parameter's state holds exactly ``step`` (an integer >= 0), ``exp_avg`` and
        ``exp_avg_sq`` (fp32 tensors of the parameter's shape on the CPU or a CUDA GPU). The
        moments are moved to the parameter's device, as torch does.

        A ``torch.optim.AdamW`` state dict (groups without ``seed``) is refused with a pointer
        to :meth:`convert_adamw_state_dict`, which states the conversion rule.

        torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype,
        which would silently round fp32 moments of bf16 parameters to bf16; the moments are
        therefore taken out before the base class sees them and put back as fp32.
        """
        where = "AdamWSR.load_state_dict"
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups', got "
                             f"{sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__}")
        groups_in, state_in = state_dict["param_groups"], state_dict["state"]
        if len(groups_in) != len(self.param_groups):
            raise ValueError(f"{where}: the state dict has {len(groups_in)} param groups, "
                             f"this optimizer {len(self.param_groups)}")
        pairs = []
        for i, (saved, group) in enumerate(zip(groups_in, self.param_groups)):
            if "seed" not in saved:
                raise ValueError(
                    f"{where}: param_groups[{i}] has no 'seed', so this is not an AdamWSR state "
                    "dict (a torch.optim.AdamW one has none). Convert it explicitly with "
                    "AdamWSR.convert_adamw_state_dict(state_dict, seed=...) and load the result")
            _check_hparams(saved.get("lr"), saved.get("betas"), saved.get("eps"),
                           saved.get("weight_decay"), saved["seed"])
            if (saved.get("base_index") is None) != (group.get("base_index") is None):
                raise ValueError(
                    f"{where}: param_groups[{i}] 'base_index' is {saved.get('base_index')!r} in "
                    f"the state dict but {group.get('base_index')!r} in this optimizer; the random "
                    "draws depend on it, so both must set it or neither")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"{where}: param_groups[{i}] has {len(saved['params'])} "
                                 f"parameters in the state dict, {len(group['params'])} here")
            pairs += zip(saved["params"], group["params"])
        known = {pid for pid, _ in pairs}
        for pid in state_in:
            if pid not in known:
                raise ValueError(f"{where}: state for parameter {pid!r}, which no param group lists")
        moments: dict = {}
        stripped = {}
        for pid, p in pairs:
            if pid in state_in:
                step, moments[pid] = _checked_state(where, pid, state_in[pid], p)
                stripped[pid] = {"step": step}
        super().load_state_dict({**state_dict, "state": stripped})
        for pid, p in pairs:
            if pid in moments:
                st = self.state[p]
                st["step"] = st["step"].to(device="cpu", dtype=torch.int64).reshape(())
                for k, v in moments[pid].items():
                    st[k] = v.to(device=p.device, dtype=torch.float32,
                                 memory_format=torch.contiguous_format, copy=True)

    @staticmethod
    def convert_adamw_state_dict(state_dict: dict, *, seed: int) -> dict:
        """An AdamWSR state dict that continues a ``torch.optim.AdamW`` one.

        The rule: ``lr``, ``betas``, ``eps`` and ``weight_decay`` are kept, ``seed`` is added;
        torch's kernel-choice flags (``foreach``, ``fused``, ``capturable``,
        ``differentiable``) are dropped; ``amsgrad=True`` and ``maximize=True`` are refused
        (AdamWSR has neither), as is ``decoupled_weight_decay=False`` (that is Adam's L2
        decay). ``step`` becomes an int64 (it must be a whole number >= 0) and the moments are
        widened exactly to fp32. No ``base_index`` is added. The result goes to
        :meth:`load_state_dict`, which checks it like any other.
        """
        where = "AdamWSR.convert_adamw_state_dict"
        groups = []
        for i, g in enumerate(state_dict["param_groups"]):
            for flag, bad in (("amsgrad", True), ("maximize", True), ("decoupled_weight_decay", False)):
                if g.get(flag, not bad) == bad:
                    raise ValueError(f"{where}: param_groups[{i}] has {flag}={bad}, which "
                                     "AdamWSR does not implement")
            groups.append({"params": list(g["params"]), "lr": g["lr"], "betas": tuple(g["betas"]),
                           "eps": g["eps"], "weight_decay": g["weight_decay"], "seed": seed})
        state = {}
        for pid, st in state_dict["state"].items():
            st = dict(st)
            if "step" in st:
                st["step"] = torch.tensor(_checked_step(where, pid, st["step"]), dtype=torch.int64)
            for k in ("exp_avg", "exp_avg_sq"):
                if isinstance(st.get(k), torch.Tensor) and st[k].is_floating_point():
                    st[k] = st[k].to(torch.float32)
            state[pid] = st
        return {"state": state, "param_groups": groups}


_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _checked_step(where: str, pid: Any, step: Any) -> int:
    """A saved step counter as an int in [0, 2**63): an integer, or a whole-valued float
    (torch.optim.AdamW saves ``step`` as a float tensor)."""
    value = step
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{where}: 'step' of parameter {pid!r} must be one real number, "
                             f"got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    n = as_index(value)
    if n is None or not 0 <= n < 1 << 63:
        raise ValueError(f"{where}: 'step' of parameter {pid!r} must be an integer in "
                         f"[0, 2**63), got {step!r}")
    return n


def _checked_state(where: str, pid: Any, st: Any, p: torch.Tensor) -> tuple:
    """(step as an int64 tensor, {moment name: tensor}) after checking one parameter's state."""
    if not isinstance(st, dict):
        raise ValueError(f"{where}: the state of parameter {pid!r} must be a dict, "
                         f"got {type(st).__name__}")
    missing = [k for k in _STATE_KEYS if k not in st]
    if missing:
        raise ValueError(f"{where}: the state of parameter {pid!r} has no {missing[0]!r} "
                         f"(expected {list(_STATE_KEYS)})")
    extra = sorted(str(k) for k in st if k not in _STATE_KEYS)
    if extra:
        raise ValueError(f"{where}: the state of parameter {pid!r} has unexpected entries "
                         f"{extra} (AdamWSR keeps only {list(_STATE_KEYS)})")
    step = torch.tensor(_checked_step(where, pid, st["step"]), dtype=torch.int64)
    moments = {}
    for k in ("exp_avg", "exp_avg_sq"):
        v = st[k]
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: {k} of parameter {pid!r} must be a tensor, "
                             f"got {type(v).__name__}")
        if v.dtype != torch.float32:
            raise ValueError(f"{where}: {k} of parameter {pid!r} must be float32, got {v.dtype}")
        if v.layout != torch.strided or v.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{where}: {k} of parameter {pid!r} must be a dense tensor on the "
                             f"CPU or a CUDA GPU, got {v.layout} on {v.device}")
        if v.shape != p.shape:
            raise ValueError(f"{where}: {k} of parameter {pid!r} has shape {tuple(v.shape)}, "
                             f"the parameter {tuple(p.shape)}")
        moments[k] = v
    return step, moments


def stochastic_round_bf16(x: torch.Tensor, seed: int, step: int = 0,
                          base_index: int = 0) -> torch.Tensor:
    """fp32 -> bf16 with the AdamWSR stochastic rounding and Philox draws.

    Args:
        x: fp32 tensor, any shape, CPU or CUDA; element i (row-major) has global index
           ``base_index + i``.
        seed: int in [0, 2**64); step: int >= 0; base_index: int >= 0.
    Returns:
        bf16 tensor of x's shape and device. ``E[result] == x`` for finite x.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16: x must be float32, got {x.dtype}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _U64:
        raise ValueError(f"stochastic_round_bf16: seed must be an int in [0, 2**64), got {seed!r}")
    if not 0 <= step < 1 << 63 or not 0 <= base_index < 1 << 63:
        raise ValueError("stochastic_round_bf16: step and base_index must be in [0, 2**63), "
                         f"got {step}, {base_index}")
    return sr_round_bf16(x, _signed64(seed), step, base_index)
