"""Input checks whose verdict is computed on the device and read later, without a host sync.

Some argument checks depend on tensor values (cross-entropy targets inside [0, C)). Reading the
verdict at once synchronizes the host with the GPU: everything queued before it must finish, and
the GPU then idles while the host queues what follows. In a training step whose forward is
host-bound that costs more than the check. Inside :func:`deferring_checks`
such a check records its device-side values instead (an asynchronous copy into pinned host
memory behind a CUDA event), and the owner resolves them at a point where the host would wait
anyway or before anything irreversible happens: det_ddp does it after the step's backward is
queued and before gradients are synchronized and the optimizer step runs, so a bad target still
raises the same error before any weight changes, and the forward's values computed from bad rows
are NaN, never plausible numbers.

The CPU takes the same route (its values are ready at once), so a bad input raises at the same
point of the step on either device.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, List, Optional

import torch

__all__ = ["DeferredChecks", "deferring_checks", "check_now_or_later", "deferring"]

# verdict(values) -> the exception to raise, or None when the values pass
Verdict = Callable[[List[int]], Optional[Exception]]

_local = threading.local()  # the collector of the thread that queues the forward


class DeferredChecks:
    """Checks recorded during a step, resolved by :meth:`resolve` (which raises the first failure)."""

    def __init__(self) -> None:
        self._pending: list = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, values: torch.Tensor, verdict: Verdict) -> None:
        """values: 1-D int64 tensor (the check's statistics, any device); verdict: as above."""
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(values.device))
        else:  # computed already: kept, so CPU and CUDA raise at the same point
            host, event = values.clone(), None
        self._pending.append((host, event, verdict))

    def resolve(self) -> None:
        """Waits for each check's values (only up to the point in the stream where it was made,
        not for everything queued since), then raises the first failing check's error."""
        pending, self._pending = self._pending, []
        for host, event, verdict in pending:
            if event is not None:
                event.synchronize()
            err = verdict(host.tolist())
            if err is not None:
                raise err

    def discard(self) -> None:
        self._pending = []


def deferring() -> Optional[DeferredChecks]:
    """The active collector of this thread, or None (checks are then decided at once)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def deferring_checks(checks: DeferredChecks) -> Iterator[DeferredChecks]:
    """Value checks made inside the block (on this thread) go to ``checks``; the caller must call
    ``checks.resolve()`` before it relies on the checked inputs having been valid."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(checks)
    try:
        yield checks
    finally:
        stack.pop()


def check_now_or_later(values: torch.Tensor, verdict: Verdict) -> bool:
    """Decides the check now (no collector active: raises on failure) or records it with the
    active collector. Returns True when it was deferred."""
    checks = deferring()
    if checks is not None:
        checks.add(values, verdict)
        return True
    err = verdict(values.tolist())
    if err is not None:
        raise err
    return False
