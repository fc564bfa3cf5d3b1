"""DigestCallback: one flushed JSON line of digests per optimizer step, per rank.

File layout (``dirpath/digests-rank{R}.jsonl``), one JSON object per line:
  * ``{"kind": "header", ...}`` at every (re)start: profile, world size, versions, devices,
    ``verified`` (the run label: "pending" until det_ddp's first-step op audit has run, then
    "verified" / "unverified"; always "unverified" under other strategies), digest format;
  * ``{"kind": "label", "step": N, "verified": ...}`` when the label changes (after the audit):
    a reader takes the last label record (or step record) as the run's label;
  * ``{"kind": "step", "step": N, "loss": {...}, "params": {...}, "buffers": {...},
    "grads": {...}, "optim": {...}, "rng": {...}, "chain": "...", "verified": ...}`` after
    optimizer step N;
  * ``{"kind": "replica_mismatch", ...}`` when the cross-replica check finds a difference.

With ``capture_steps=(first, last)`` it also writes ``dirpath/capture-rank{R}.jsonl``: one line
per module forward and backward in execution order during those steps (see :class:`_Capture`).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ..digest import FORMAT, digest_many, digest_many_async, hash_object, tensor_digest
from ..profile import PROFILE

__all__ = ["DigestCallback", "ReplicaMismatchError", "rng_digests", "run_label", "CHAIN_SEED"]

CHAIN_SEED = "ldet-chain-v1"
_INCLUDE = ("params", "grads", "optim", "rng")


class ReplicaMismatchError(RuntimeError):
    """Raised (on every rank) when replicas that must be equal hold different parameters."""


def rng_digests() -> dict[str, Any]:
    """Digests of the RNG states the next step can depend on (this process)."""
    out = {"torch_cpu": tensor_digest(torch.get_rng_state())}
    # Only look at CUDA if this process already uses it: querying would initialize a context.
    # Only this process's device: touching every GPU would create a context on each, per rank.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = tensor_digest(torch.cuda.get_rng_state())
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = hashlib.sha256(
        f"{name}|{pos}|{has_gauss}|{float(cached).hex()}|".encode() + np.asarray(keys).tobytes()
    ).hexdigest()
    out["python"] = hash_object(random.getstate())
    return out


def run_label(strategy) -> str:
    """``"verified"``, ``"unverified"`` or ``"pending"`` (det_ddp before its first-step audit).

    Only det_ddp audits a run's ops, so a run under any other strategy is unverified.
    """
    return getattr(strategy, "det_label", None) or "unverified"


class _PendingLoss:
    """A loss value on its way to the host without stalling the device (pinned, non-blocking)."""

    def __init__(self, loss) -> None:
        if isinstance(loss, dict):
            loss = loss.get("loss")
        self.host = self.event = None
        if not isinstance(loss, torch.Tensor):
            return
        value = loss.detach().reshape(-1)
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = value.clone()

    def record(self) -> dict | None:
        if self.host is None:
            return None
        if self.event is not None:
            self.event.synchronize()
        v = self.host
        return {"hex": v.contiguous().view(torch.uint8).numpy().tobytes().hex(),
                "value": float(v.float().item()) if v.numel() == 1 else None,
                "dtype": str(v.dtype).replace("torch.", "")}


def _flatten_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _flatten_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flatten_tensors(o)]
    return []


class _Capture:
    """Module-level capture: digests of every module's forward inputs/outputs and backward
    gradients, in execution order.

    Forward events record inputs, outputs and the module's own parameters, so a reader can tell
    "same inputs and parameters, different output" (the op itself differs) from "different
    inputs" (the difference came from upstream). Backward events (full backward hooks) record
    ``grad_output`` as inputs and ``grad_input`` as outputs of the module's backward.

    Hooks only read tensors (the digest op does not write), and the identity autograd nodes that
    full backward hooks insert do not change values, so capture does not change the numbers.
    One caveat from PyTorch itself: full backward hooks reject modules whose outputs are later
    modified in place (e.g. a following ``ReLU(inplace=True)``); pass ``capture_backward=False``.
    """

    def __init__(self, path: Path, backward: bool) -> None:
        self.path = path
        self.backward = backward
        self.handles: list = []
        self.events: list[dict] = []
        self.seq = 0
        self.step = 0
        self.micro = 0

    def attach(self, module: torch.nn.Module) -> None:
        for name, mod in module.named_modules():
            label = name or "<root>"
            self.handles.append(mod.register_forward_hook(self._fwd(label)))
            if self.backward:
                self.handles.append(mod.register_full_backward_hook(self._bwd(label)))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    def _event(self, phase: str, label: str, mod, ins, outs, params: dict | None) -> None:
        tin, tout = _flatten_tensors(ins), _flatten_tensors(outs)
        pnames = list(params) if params else []
        ds = digest_many(tin + tout + [params[n] for n in pnames])
        ev = {"kind": "capture", "step": self.step, "micro": self.micro, "seq": self.seq, "phase": phase,
              "module": label, "type": type(mod).__name__,
              "inputs": ds[: len(tin)], "outputs": ds[len(tin): len(tin) + len(tout)]}
        if params is not None:
            ev["params"] = dict(zip(pnames, ds[len(tin) + len(tout):]))
        self.seq += 1
        self.events.append(ev)

    def _fwd(self, label):
        def hook(mod, args, output):
            self._event("forward", label, mod, args, output, dict(mod.named_parameters(recurse=False)))
        return hook

    def _bwd(self, label):
        def hook(mod, grad_input, grad_output):
            self._event("backward", label, mod, grad_output, grad_input, None)
        return hook

    def flush(self) -> None:
        if not self.events:
            return
        with open(self.path, "a") as f:
            for ev in self.events:
                f.write(json.dumps(ev) + "\n")
            f.flush()
        self.events = []


class DigestCallback(Callback):
    """Writes the digests of a run, one JSON line per optimizer step and rank.

    Args:
        dirpath: folder for ``digests-rank{R}.jsonl`` (and ``capture-rank{R}.jsonl``).
        every_n_steps: record steps whose number is a multiple of this.
        include: any of ``"params"`` (parameters and buffers), ``"grads"`` (the gradients the
            optimizer consumed: after unscaling and clipping), ``"optim"`` (every optimizer state
            tensor and counter, plus hyper-parameters such as the current lr), ``"rng"``.
        check_replicas_every_n_steps: every this many steps (0: never) the ranks all-gather
            their parameter digests, which must be equal under data parallelism; a mismatch is
            written to the file and reported naming the rank and the tensor.
        on_replica_mismatch: ``"warn"`` or ``"raise"`` (:class:`ReplicaMismatchError`, on all
            ranks alike, so none is left waiting in a collective).
        capture_steps: ``(first, last)`` optimizer steps (inclusive) during which every module's
            forward and backward is captured for op-level localization (``lightning-det diff``).
        capture_backward: also capture backward (full backward hooks).
        write_lag: how many steps a line may wait before it is written. Default: 0 on CPU, 1 on
            CUDA, where the digests travel to the host asynchronously and step N's line is
            written when step N+1 ends, so the GPU never waits for the host. Pending lines are
            always written before a checkpoint is saved, at the end of training and on errors.

    Gradients are digested in a post-step hook of the optimizer: at that point ``.grad`` holds
    exactly what the optimizer read (Lightning unscales and clips before ``step``, and zeroes
    only inside the next closure). An optimizer that rewrites ``.grad`` in place would be seen
    after its rewrite. The loss recorded is the training step's loss as Lightning returns it
    (divided by ``accumulate_grad_batches``) for the last micro-batch; all micro-batch losses
    are listed under ``losses`` when there are several. On this rank only, unless the strategy
    provides ``det_global_loss(loss)`` (det_ddp does), which is then used.
    """

    def __init__(self, dirpath: str | os.PathLike, every_n_steps: int = 1, include: Iterable[str] = _INCLUDE, *,
                 check_replicas_every_n_steps: int = 0, on_replica_mismatch: str = "warn",
                 capture_steps: tuple[int, int] | None = None, capture_backward: bool = True,
                 write_lag: int | None = None) -> None:
        super().__init__()
        include = tuple(include)
        bad = [i for i in include if i not in _INCLUDE]
        if bad:
            raise ValueError(f"DigestCallback: unknown include {bad}; choose from {_INCLUDE}")
        if every_n_steps < 1:
            raise ValueError(f"DigestCallback: every_n_steps must be >= 1, got {every_n_steps}")
        if on_replica_mismatch not in ("warn", "raise"):
            raise ValueError(f"DigestCallback: on_replica_mismatch must be 'warn' or 'raise', got {on_replica_mismatch!r}")
        if capture_steps is not None:
            first, last = (int(capture_steps[0]), int(capture_steps[1]))
            if not 1 <= first <= last:
                raise ValueError(f"DigestCallback: capture_steps must be (first, last) with 1 <= first <= last, got {capture_steps}")
            capture_steps = (first, last)
        self.dirpath = Path(dirpath)
        self.every_n_steps = int(every_n_steps)
        self.include = include
        self.check_replicas_every_n_steps = int(check_replicas_every_n_steps)
        self.on_replica_mismatch = on_replica_mismatch
        self.capture_steps = capture_steps
        self.capture_backward = capture_backward
        if write_lag is not None and write_lag < 0:
            raise ValueError(f"DigestCallback: write_lag must be >= 0, got {write_lag}")
        self.write_lag = write_lag
        self._queue: list[dict] = []
        self._lag = 0
        self._chain = hashlib.sha256(f"{CHAIN_SEED}|{PROFILE}".encode()).hexdigest()
        self._last_step = 0
        self._pending: list[dict] = []
        self._losses: list = []
        self._hooks: list = []
        self._names: dict[int, str] = {}
        self._capture: _Capture | None = None
        self._rank = 0
        self._resumed_from: int | None = None
        self._label = "pending"

    # -- Lightning state: the chain continues across a resume -----------------------------
    @override
    def state_dict(self) -> dict:
        self._drain(0)  # the chain saved must cover every step taken so far
        self._sync()  # and be on disk before the checkpoint that continues it
        return {"chain": self._chain, "last_step": self._last_step}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        chain, last = (state_dict.get(k) if isinstance(state_dict, dict) else None for k in ("chain", "last_step"))
        if not (isinstance(chain, str) and len(chain) == 64):
            raise ValueError(f"DigestCallback.load_state_dict: entry 'chain' must be a 64-character hex digest, "
                             f"got {chain!r:.80}")
        if not (isinstance(last, int) and not isinstance(last, bool) and last >= 0):
            raise ValueError(f"DigestCallback.load_state_dict: entry 'last_step' must be an integer >= 0, got {last!r}")
        self._chain = chain
        self._last_step = last
        self._resumed_from = self._last_step

    @property
    def path(self) -> Path:
        return self.dirpath / f"digests-rank{self._rank}.jsonl"

    def _write(self, rec: dict) -> None:
        # One append per record: a crash leaves whole lines and at most a torn last one, which
        # the reader reports as such.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)

    def _sync(self) -> None:
        if self.path.exists():
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- hooks -----------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._rank = trainer.global_rank
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self._names = {id(p): n for n, p in pl_module.named_parameters()}
        self._module = pl_module
        self._trainer = trainer
        if self._resumed_from is None and self.path.exists() and self.path.stat().st_size:
            warnings.warn(f"DigestCallback: {self.path} already holds a run; this fresh run appends to it, and "
                          "`lightning-det diff`/`report` will then refuse the file unless --run-a/--run-b/--run "
                          "selects one of its runs. Use a new dirpath per run.",
                          RuntimeWarning, stacklevel=2)
        header = self._header(trainer, pl_module)
        self._label = header["verified"]
        self._write(header)
        self._lag = self.write_lag if self.write_lag is not None else int(pl_module.device.type == "cuda")
        for opt in trainer.optimizers:
            self._hooks.append(opt.register_step_post_hook(self._after_optimizer_step))
        if self.capture_steps is not None:
            self._capture = _Capture(self.dirpath / f"capture-rank{self._rank}.jsonl", self.capture_backward)

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._drain(0)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._capture is not None:
            self._capture.detach()
            self._capture.flush()

    @override
    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        cap = self._capture
        if cap is None:
            return
        step = trainer.global_step + 1  # the optimizer step this micro-batch contributes to
        first, last = self.capture_steps
        if first <= step <= last:
            if not cap.attached:
                cap.attach(pl_module)
            if step != cap.step:
                cap.seq = 0  # numbered per step, so a re-captured step (resume) is recognisable
            cap.step, cap.micro = step, batch_idx
        elif cap.attached:
            cap.detach()

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._capture is not None:
            self._capture.flush()
        loss = outputs
        global_loss = getattr(trainer.strategy, "det_global_loss", None)
        if global_loss is not None and isinstance(outputs, (dict, torch.Tensor)) and not (
                isinstance(outputs, dict) and "loss" not in outputs):
            loss = global_loss(outputs["loss"] if isinstance(outputs, dict) else outputs)
        self._losses.append(_PendingLoss(loss))
        if not self._pending:
            return
        # Usually one entry; several when manual optimization steps more than one optimizer.
        entries, self._pending = self._pending, []
        losses, self._losses = self._losses, []
        for entry in entries:
            entry["losses"] = losses
            if entry["record"]:
                if "rng" in self.include:
                    entry["rng"] = rng_digests()  # host-side state, taken now
                entry["verified"] = self._verified(trainer)
                self._queue.append(entry)
            if entry["check"]:
                # A collective: every rank reaches it at the same step, so waiting here is safe.
                self._check_replicas(trainer, entry["step"], self._sections(entry)["_check"])
        self._drain(self._lag)
        label = self._verified(trainer)
        if label != self._label:  # the first step's audit has run: the header said "pending"
            self._label = label
            self._write({"kind": "label", "step": trainer.global_step, "verified": label})

    def _drain(self, keep: int) -> None:
        """Write queued step lines, oldest first, leaving at most ``keep`` pending."""
        while len(self._queue) > keep:
            self._finish(self._queue.pop(0))

    def _sections(self, entry: dict) -> dict:
        if "sections" not in entry:
            sections: dict[str, dict] = {}
            for (sec, name), d in zip(entry["named"], entry["digests"].result()):
                sections.setdefault(sec, {})[name] = d
            sections["_check"] = {**sections.get("params", {}), **sections.get("buffers", {})}
            entry["sections"] = sections
        return entry["sections"]

    def _finish(self, entry: dict) -> None:
        sections = self._sections(entry)
        rec: dict[str, Any] = {"step": entry["step"]}
        if "params" in self.include:
            rec["params"] = sections.get("params", {})
            rec["buffers"] = sections.get("buffers", {})
        if "grads" in self.include:
            rec["grads"] = sections.get("grads", {})
        if "optim" in self.include:
            rec["optim"] = {**sections.get("optim", {}), **entry["optim_values"]}
        losses = [p.record() for p in entry["losses"]]
        rec["loss"] = losses[-1] if losses else None
        if len(losses) > 1:
            rec["losses"] = losses
        if "rng" in entry:
            rec["rng"] = entry["rng"]
        self._chain = hashlib.sha256((self._chain + "\n" + json.dumps(rec, sort_keys=True)).encode()).hexdigest()
        rec["chain"] = self._chain
        rec["verified"] = entry["verified"]
        self._last_step = rec["step"]
        self._write({"kind": "step", **rec})

    # -- the step record -------------------------------------------------------------------
    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        trainer = self._trainer
        # Lightning counts the step as completed only after optimizer.step returns.
        step = trainer.global_step + 1
        record = step % self.every_n_steps == 0
        check = self.check_replicas_every_n_steps > 0 and step % self.check_replicas_every_n_steps == 0
        if not (record or check):
            self._pending.append({"step": step, "record": False, "check": False})
            return
        module = self._module
        named: list[tuple[str, str, torch.Tensor]] = []  # (section, name, tensor), in model order
        if "params" in self.include or check:
            named += [("params", n, p) for n, p in module.named_parameters()]
            named += [("buffers", n, b) for n, b in module.named_buffers()]
        if record and "grads" in self.include:
            named += [("grads", n, p.grad) for n, p in module.named_parameters() if p.grad is not None]
        optim_values: dict[str, Any] = {}
        if record and "optim" in self.include:
            multi = len(trainer.optimizers) > 1
            for oi, opt in enumerate(trainer.optimizers):
                pre = f"opt{oi}/" if multi else ""
                for gi, group in enumerate(opt.param_groups):
                    hyper = {k: v for k, v in group.items() if k != "params"}
                    optim_values[f"{pre}group{gi}"] = hash_object(hyper)
                for p in (p for g in opt.param_groups for p in g["params"]):
                    for key, val in opt.state.get(p, {}).items():
                        name = f"{pre}{self._names.get(id(p), f'param@{id(p)}')}:{key}"
                        if isinstance(val, torch.Tensor):
                            named.append(("optim", name, val))
                        else:
                            optim_values[name] = f"={val!r}"
        # Queued on the device in stream order, before the next step can touch these tensors.
        self._pending.append({"step": step, "record": record, "check": check,
                              "named": [(a, b) for a, b, _ in named],
                              "digests": digest_many_async([t for _, _, t in named]), "optim_values": optim_values})

    def _verified(self, trainer) -> str:
        return run_label(trainer.strategy)

    def _header(self, trainer, pl_module) -> dict:
        import lightning

        from .. import __version__

        dev = pl_module.device
        devices = {"device": str(dev)}
        if dev.type == "cuda":
            devices["name"] = torch.cuda.get_device_name(dev)
        return {
            "kind": "header",
            "format": FORMAT,
            "profile": PROFILE,
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "verified": self._verified(trainer),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "include": list(self.include),
            "every_n_steps": self.every_n_steps,
            "resumed_from_step": self._resumed_from,
            "versions": {"lightning_det": __version__, "torch": torch.__version__, "lightning": lightning.__version__,
                         "cuda": torch.version.cuda, "python": platform.python_version(), "numpy": np.__version__},
            "devices": devices,
            "host": platform.node(),
        }

    # -- cross-replica check ---------------------------------------------------------------
    def _check_replicas(self, trainer, step: int, mine: dict[str, str]) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        mismatches = find_replica_mismatches(gathered)
        if not mismatches:
            return
        self._write({"kind": "replica_mismatch", "step": step, "mismatches": mismatches})
        first = mismatches[0]
        msg = (f"lightning_det: replicas differ after step {step}: rank {first['rank']} has a different "
               f"{first['tensor']!r} than rank(s) {first['agreeing_ranks']} ({len(mismatches)} mismatch(es) "
               f"in all; see {self.path}). Under data parallelism parameters must be equal on every rank: "
               "this is silent data corruption or a non-replicated update.")
        if first["ambiguous"]:
            msg += (f" There is no majority among {len(gathered)} replicas, so either side may be the corrupted one;"
                    " a third replica (or a rerun) decides.")
        if self.on_replica_mismatch == "raise":
            raise ReplicaMismatchError(msg)
        if trainer.global_rank == 0:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)


def find_replica_mismatches(per_rank: list[dict[str, str]]) -> list[dict]:
    """Given each rank's ``{tensor: digest}``, the (rank, tensor) pairs that disagree.

    The reference value of a tensor is the digest most ranks hold (ties go to the one the lowest
    rank holds), so with 3+ ranks the odd one out is named; without a strict majority (2 ranks)
    the entries are marked ``ambiguous`` and the ranks that differ from the lowest rank are named.
    """
    out = []
    names = list(per_rank[0])
    for name in names:
        vals = [d.get(name) for d in per_rank]
        counts: dict = {}
        for r, v in enumerate(vals):
            counts.setdefault(v, []).append(r)
        if len(counts) == 1:
            continue
        ref = max(counts, key=lambda v: (len(counts[v]), -counts[v][0]))
        # No strict majority (e.g. two replicas): the digests cannot tell which side is corrupt.
        ambiguous = 2 * len(counts[ref]) <= len(vals)
        for r, v in enumerate(vals):
            if v != ref:
                out.append({"rank": r, "tensor": name, "digest": v, "expected": ref, "agreeing_ranks": counts[ref],
                            "ambiguous": ambiguous})
    return out
