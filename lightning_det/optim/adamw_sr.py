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

from ..ops.optim import adamw_sr_step, sr_round_bf16

__all__ = ["AdamWSR", "stochastic_round_bf16"]

_SUPPORTED = (torch.float32, torch.bfloat16)
_U64 = 1 << 64


def _powi(b: float, n: int) -> float:
    # Fixed sequence of IEEE fp64 multiplies: the same bytes on every machine, unlike libm pow.
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
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _U64:
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
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, seed=seed)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                       group["seed"])
        base = group.get("base_index")
        if base is not None and (isinstance(base, bool) or not isinstance(base, int) or base < 0):
            raise ValueError(f"AdamWSR: param group 'base_index' must be an int >= 0, got {base!r}")
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
        """Loads a state dict, keeping ``exp_avg``/``exp_avg_sq`` fp32 and ``step`` int64 on CPU.

        torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's dtype,
        which would silently round fp32 moments of bf16 parameters to bf16; the moments are
        therefore taken out before the base class sees them and put back as fp32.
        """
        moments: dict = {}
        state_in = state_dict["state"]
        stripped = {}
        for pid, st in state_in.items():
            st = dict(st)
            moments[pid] = {k: st.pop(k) for k in ("exp_avg", "exp_avg_sq") if k in st}
            stripped[pid] = st
        super().load_state_dict({**state_dict, "state": stripped})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            if pid not in state_in:
                continue
            st = self.state[p]
            for k, v in moments[pid].items():
                if v.shape != p.shape:
                    raise ValueError(f"AdamWSR.load_state_dict: {k} of parameter {pid} has shape "
                                     f"{tuple(v.shape)}, the parameter {tuple(p.shape)}")
                st[k] = v.to(device=p.device, dtype=torch.float32,
                             memory_format=torch.contiguous_format, copy=True)
            if "step" in st:
                step = torch.as_tensor(st["step"]).detach()
                st["step"] = step.to(device="cpu", dtype=torch.int64).reshape(())


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
