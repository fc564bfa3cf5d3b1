"""The schema of digest files: every record a reader accepts, checked field by field.

A record that breaks it raises :class:`DigestFileError` naming the file, the line and the field,
so that a damaged or hand-edited file can never compare as "identical". No Lightning import.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DigestFileError", "LABELS", "check_record"]

LABELS = ("verified", "unverified", "pending")


class DigestFileError(ValueError):
    """A digest file that cannot be trusted: bad encoding, malformed line, or mixed runs."""

    def __init__(self, path: Path | str, line: int | None, field: str | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {f'field {field!r}: ' if field else ''}{problem}")
        self.path, self.line, self.field, self.problem = str(path), line, field, problem

    def to_json(self) -> dict:
        return {"file": self.path, "line": self.line, "field": self.field, "problem": self.problem}


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _loss(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and isinstance(v.get("hex"), str) and isinstance(v.get("dtype"), str)
                         and (v.get("value") is None or isinstance(v.get("value"), (int, float))))


# field -> (required, check, what it must be)
_STEP = {"step": (True, lambda v: _int(v) and v >= 1, "an integer >= 1"),
         "chain": (True, lambda v: isinstance(v, str) and len(v) == 64, "a 64-character hex digest"),
         "verified": (False, lambda v: v in LABELS, f"one of {LABELS}"),
         "loss": (False, _loss, "null or {hex, dtype, value}"),
         "losses": (False, lambda v: isinstance(v, list) and all(_loss(x) for x in v), "a list of losses"),
         **{sec: (False, _str_map, "an object of name -> digest strings")
            for sec in ("params", "buffers", "grads", "optim", "rng")}}
_SCHEMAS = {
    "header": {"format": (True, lambda v: isinstance(v, str), "a string"),
               "profile": (True, lambda v: isinstance(v, str), "a string"),
               "world_size": (True, lambda v: _int(v) and v >= 1, "an integer >= 1"),
               "verified": (True, lambda v: v in LABELS, f"one of {LABELS}"),
               "resumed_from_step": (False, lambda v: v is None or (_int(v) and v >= 0), "null or an integer >= 0")},
    "step": _STEP,
    "label": {"step": (True, lambda v: _int(v) and v >= 0, "an integer >= 0"),
              "verified": (True, lambda v: v in LABELS, f"one of {LABELS}")},
    "replica_mismatch": {"step": (True, lambda v: _int(v) and v >= 1, "an integer >= 1"),
                         "mismatches": (True, lambda v: isinstance(v, list), "a list")},
    "capture": {"step": (True, _int, "an integer"), "micro": (True, _int, "an integer"),
                "seq": (True, _int, "an integer"), "phase": (True, lambda v: v in ("forward", "backward"),
                                                             "'forward' or 'backward'"),
                "module": (True, lambda v: isinstance(v, str), "a string"),
                "type": (True, lambda v: isinstance(v, str), "a string"),
                "inputs": (True, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                           "a list of digests"),
                "outputs": (True, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                            "a list of digests"),
                "params": (False, _str_map, "an object of name -> digest strings")},
}


def check_record(rec: Any, path: Path | str, line: int, kinds: tuple[str, ...]) -> dict:
    """Return ``rec`` if it is a valid record of one of ``kinds``; raise naming the field if not."""
    if not isinstance(rec, dict):
        raise DigestFileError(path, line, None, f"expected a JSON object, got {type(rec).__name__}")
    kind = rec.get("kind")
    if kind not in kinds:
        raise DigestFileError(path, line, "kind", f"expected one of {kinds}, got {kind!r}")
    for field, (required, ok, what) in _SCHEMAS[kind].items():
        if field not in rec:
            if required:
                raise DigestFileError(path, line, field, f"missing from a {kind} record")
            continue
        if not ok(rec[field]):
            raise DigestFileError(path, line, field, f"must be {what}, got {rec[field]!r:.80}")
    return rec
