"""Reading digest files and finding where two runs part. No Lightning import.

Used by ``lightning-det diff`` / ``report`` and by tests.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .schema import DigestFileError, check_record

__all__ = ["Run", "DigestFileError", "load_run", "diff_runs", "diff_step", "localize", "SECTIONS"]

# The order in which a step's differences are listed: what the step computed first comes first.
SECTIONS = ("loss", "grads", "params", "buffers", "optim", "rng")
_RANK_FILE = re.compile(r"digests-rank(\d+)\.jsonl$")


@dataclass
class Run:
    """The digest records of one run: per rank, its headers, steps, captured events and label.

    ``labels[rank]`` is the run's final label ("verified", "unverified", or "pending" when the
    run stopped before its first-step audit): the last label the file records. ``notes`` lists
    what the reader tolerated, such as a torn last line of a killed run.
    """

    path: Path
    headers: dict[int, list[dict]] = field(default_factory=dict)
    steps: dict[int, dict[int, dict]] = field(default_factory=dict)
    mismatches: dict[int, list[dict]] = field(default_factory=dict)
    captures: dict[int, list[dict]] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.steps)

    @property
    def label(self) -> str:
        """One label for the whole run: the weakest of its ranks' labels."""
        labels = set(self.labels.values())
        for weakest in ("unverified", "pending", "verified"):
            if weakest in labels:
                return weakest
        return "unknown"

    def step_numbers(self, rank: int = 0) -> list[int]:
        return sorted(self.steps.get(rank, {}))


def _read_jsonl(path: Path, kinds: tuple[str, ...], notes: list[str]) -> list[tuple[int, dict]]:
    """``(line number, record)`` of every line, schema-checked; a torn last line is noted and skipped."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DigestFileError(path, _line_of(path, exc.start), None,
                              f"not UTF-8 text (byte {exc.start}): not a digest file, or a corrupted one") from None
    lines = text.split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines):  # no newline after it: the write was cut short (a killed run)
                notes.append(f"{path}:{n}: torn last line ignored (the run was killed while writing it)")
                continue
            raise DigestFileError(path, n, None, f"not a JSON line ({exc.msg} at column {exc.colno})") from None
        out.append((n, check_record(rec, path, n, kinds)))
    return out


def _line_of(path: Path, offset: int) -> int:
    return path.read_bytes()[:offset].count(b"\n") + 1


def _select_run(path: Path, records: list[tuple[int, dict]], run: int | None) -> list[tuple[int, dict]]:
    """The records of one run of a file: a fresh header starts a run, a resume header continues it."""
    starts = [i for i, (_, rec) in enumerate(records)
              if rec["kind"] == "header" and rec.get("resumed_from_step") is None]
    if not starts or starts[0] != 0:
        starts = [0] + [i for i in starts if i != 0]
    if run is None:
        if len(starts) > 1:
            lines = [records[i][0] for i in starts]
            raise DigestFileError(path, lines[1], None,
                                  f"two runs in one file: fresh run headers at lines {lines}; a reader would "
                                  "mix their steps. Write each run to its own DigestCallback dirpath, or pick one "
                                  f"with --run N (1..{len(starts)})")
        return records
    if not 1 <= run <= len(starts):
        raise DigestFileError(path, None, None, f"--run {run}: the file holds {len(starts)} run(s)")
    bounds = starts + [len(records)]
    return records[bounds[run - 1]: bounds[run]]


def load_run(path: str | Path, run: int | None = None) -> Run:
    """Load a run folder (``digests-rank*.jsonl``, ``capture-rank*.jsonl``) or one digests file.

    Every line is schema-checked (:mod:`.schema`). A file holding two runs (two fresh headers) is
    an error unless ``run`` (1-based) selects one.
    """
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("digests-rank*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{path}: no digests-rank*.jsonl files (is this a DigestCallback dirpath?)")
    res = Run(path=path)
    for f in files:
        m = _RANK_FILE.search(f.name)
        rank = int(m.group(1)) if m else 0
        res.headers[rank], res.steps[rank], res.mismatches[rank] = [], {}, []
        records = _select_run(f, _read_jsonl(f, ("header", "step", "label", "replica_mismatch"), res.notes), run)
        if not records or records[0][1]["kind"] != "header":
            raise DigestFileError(f, records[0][0] if records else None, "kind",
                                  "a digests file starts with a header record")
        for _, rec in records:
            kind = rec["kind"]
            if kind == "header":
                res.headers[rank].append(rec)
            elif kind == "step":
                # A resume from an earlier checkpoint re-writes steps: the latest record wins.
                res.steps[rank][rec["step"]] = rec
            elif kind == "replica_mismatch":
                res.mismatches[rank].append(rec)
            if "verified" in rec:
                res.labels[rank] = rec["verified"]
        cap = f.with_name(f"capture-rank{rank}.jsonl")
        if cap.exists():
            events = [e for _, e in _read_jsonl(cap, ("capture",), res.notes)]
            # A step captured twice (a resume from an earlier checkpoint): keep the last pass.
            # seq restarts at 0 with every captured step.
            last_pass: dict = {}
            for e in events:
                if e["seq"] == 0:
                    last_pass[e["step"]] = []
                last_pass.setdefault(e["step"], []).append(e)
            res.captures[rank] = [e for s in sorted(last_pass) for e in last_pass[s]]
    return res


def diff_step(a: dict, b: dict) -> list[dict]:
    """The differences between two step records, in SECTIONS order, tensors in model order."""
    out = []
    la, lb = a.get("loss"), b.get("loss")
    if (la or {}).get("hex") != (lb or {}).get("hex") or [x and x.get("hex") for x in a.get("losses", [])] != [
            x and x.get("hex") for x in b.get("losses", [])]:
        out.append({"section": "loss", "tensor": "loss", "a": la and la.get("value"), "b": lb and lb.get("value"),
                    "a_hex": la and la.get("hex"), "b_hex": lb and lb.get("hex")})
    for sec in SECTIONS[1:]:
        da, db = a.get(sec), b.get(sec)
        if da is None or db is None:
            continue  # not recorded in one of the runs: nothing to compare
        for name in list(da) + [n for n in db if n not in da]:
            va, vb = da.get(name), db.get(name)
            if va != vb:
                out.append({"section": sec, "tensor": name, "a": va, "b": vb})
    return out


def localize(a_events: list[dict], b_events: list[dict], step: int | None = None) -> dict | None:
    """The earliest captured module event whose outputs differ, with a verdict.

    Returns None when neither run has capture events. ``verdict`` is ``"op"`` when that
    module's inputs (and, for forward, its parameters) were equal, so the module's own
    computation differs; ``"inputs"`` when its inputs already differed (the cause lies before
    the capture window or outside the captured modules).
    """
    if not a_events or not b_events:
        return None
    if step is not None:
        # The step record of step k reflects step k's forward/backward: that is what to compare.
        ca, cb = sorted({e["step"] for e in a_events}), sorted({e["step"] for e in b_events})
        if step not in ca or step not in cb:
            return {"status": "not_captured", "captured_steps": {"a": ca, "b": cb},
                    "message": f"the runs first differ at step {step}, which is not captured in both runs "
                               f"(captured steps: {ca} and {cb}); capture step {step} in both with "
                               f"DigestCallback(capture_steps=({step}, {step}))"}
        a_events = [e for e in a_events if e["step"] == step]
        b_events = [e for e in b_events if e["step"] == step]
    for ea, eb in zip(a_events, b_events):
        key_a = (ea["step"], ea["micro"], ea["phase"], ea["module"])
        key_b = (eb["step"], eb["micro"], eb["phase"], eb["module"])
        if key_a != key_b:
            return {"status": "misaligned", "a": key_a, "b": key_b, "seq": ea["seq"],
                    "message": "the two runs executed different module sequences from here on; "
                               "the capture cannot be compared event by event"}
        if ea["outputs"] != eb["outputs"]:
            inputs_equal = ea["inputs"] == eb["inputs"]
            params_equal = ea.get("params") == eb.get("params")
            diff_out = [i for i, (x, y) in enumerate(zip(ea["outputs"], eb["outputs"])) if x != y]
            return {"status": "found", "step": ea["step"], "micro": ea["micro"], "seq": ea["seq"],
                    "phase": ea["phase"], "module": ea["module"], "type": ea["type"],
                    "inputs_equal": inputs_equal, "params_equal": params_equal, "outputs_differing": diff_out,
                    "verdict": "op" if inputs_equal and params_equal else "inputs"}
    if len(a_events) != len(b_events):
        return {"status": "misaligned", "message": f"captures have {len(a_events)} vs {len(b_events)} events"}
    return {"status": "no_difference", "events": len(a_events)}


def diff_runs(a: Run, b: Run, ranks: list[int] | None = None) -> dict:
    """Compare two runs step by step on the given ranks (default: all ranks both have).

    Returns a JSON-able dict: ``identical``, ``through_step`` (last step equal on all compared
    ranks), or ``step``/``rank``/``differences`` at the first divergence, plus ``localization``
    from capture files when both runs have them.
    """
    ranks = ranks if ranks is not None else [r for r in a.ranks if r in b.ranks]
    if not ranks:
        raise ValueError(f"no rank in common: {a.path} has {a.ranks}, {b.path} has {b.ranks}")
    first = None
    through = None
    common_all = []
    for r in ranks:
        sa, sb = a.steps.get(r, {}), b.steps.get(r, {})
        common = sorted(set(sa) & set(sb))
        common_all.append(len(common))
        for s in common:
            d = diff_step(sa[s], sb[s])
            if d:
                if first is None or s < first["step"]:
                    first = {"step": s, "rank": r, "differences": d}
                break
        if common:
            through = common[-1] if through is None else min(through, common[-1])
    res: dict = {"a": str(a.path), "b": str(b.path), "ranks": ranks, "common_steps": min(common_all),
                 "labels": {"a": a.label, "b": b.label}}
    if a.notes or b.notes:
        res["notes"] = a.notes + b.notes
    for r in ranks:
        only_a = sorted(set(a.steps.get(r, {})) - set(b.steps.get(r, {})))
        only_b = sorted(set(b.steps.get(r, {})) - set(a.steps.get(r, {})))
        if only_a or only_b:
            res.setdefault("unmatched_steps", {})[r] = {"only_a": only_a[:20], "only_b": only_b[:20]}
    if first is None:
        res.update(identical=True, through_step=through)
        if res["common_steps"] == 0:
            res["identical"] = False
            res["error"] = "the runs have no step in common"
    else:
        res.update(identical=False, **first)
        res["through_step"] = max([s for s in a.steps[first["rank"]] if s < first["step"]] or [0])
        r = first["rank"]
        loc = localize(a.captures.get(r, []), b.captures.get(r, []), first["step"])
        if loc is None and (a.captures or b.captures):
            loc = {"status": "missing", "message": "only one run has capture files"}
        res["localization"] = loc
    return res
