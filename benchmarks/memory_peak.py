"""What is alive at a CUDA memory peak, by the line of our code that allocated it.

Used by ddp_step.py --breakdown: torch.cuda.memory._record_memory_history() records every
allocation with its Python stack; this replays the trace, finds the moment of the largest
allocated total and groups what was alive then by the innermost frame in lightning_det/ (else
benchmarks/, else the innermost Python frame). Only the CUDA caching allocator has such traces.
"""
from __future__ import annotations

from collections import defaultdict


# Frames that only pass an op through (the op audit's dispatch mode, function modes): the line
# that asked for the memory is further out.
_PASS_THROUGH = ("__torch_dispatch__", "__torch_function__")


def _site(frames) -> str:
    for want in ("lightning_det/", "benchmarks/"):
        for f in frames or []:
            name = f.get("filename", "")
            if want in name and f.get("name") not in _PASS_THROUGH:
                return f"{name[name.index(want):]}:{f.get('line')} {f.get('name')}"
    f = (frames or [{}])[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"


def peak_breakdown(snapshot: dict, top: int = 12) -> dict:
    """{"peak_bytes", "events", "sites": [[bytes, count, site], ...]} from a memory snapshot.

    Allocations made before the trace began are invisible: the caller starts recording before
    the model is built so that the replayed total matches max_memory_allocated.
    """
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]
    free_action = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    live, cur, peak, peak_at = {}, 0, -1, 0
    for i, e in enumerate(events):
        a = e.get("action")
        if a == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif a == free_action and e["addr"] in live:
            cur -= live.pop(e["addr"])
    live_frames: dict = {}
    for e in events[: peak_at + 1]:
        a = e.get("action")
        if a == "alloc":
            live_frames[e["addr"]] = (e["size"], e.get("frames"))
        elif a == free_action:
            live_frames.pop(e["addr"], None)
    sites: dict = defaultdict(lambda: [0, 0])
    for size, frames in live_frames.values():
        s = sites[_site(frames)]
        s[0] += size
        s[1] += 1
    rows = sorted(([b, n, site] for site, (b, n) in sites.items()), reverse=True)
    return {"peak_bytes": peak, "events": len(events), "sites": rows[:top]}
