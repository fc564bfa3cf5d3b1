"""Checkpoint manifests: a SHA-256 for every leaf of a checkpoint, plus the profile.

Every leaf is listed under its path (``state_dict/net.0.weight``, ``optimizer_states[0]/state/3/
step``, ``callbacks/ExactResumeCallback/rng[0]/python``): tensors with dtype, shape, byte count
and the SHA-256 of their bytes; every other value (RNG states, sampler cursors,
hyper-parameters, loop counters, version strings) with the SHA-256 of a canonical, type-tagged
encoding. Dicts are walked key by key, lists and tuples element by element where they hold a
dict or a tensor; a list of plain values (a Python RNG state) is one leaf. The manifest hashes
itself too (all but the profile, which :func:`check_profile` names), so an edit to the
manifest is named like any other.

Plain SHA-256 (not the chunked digest) so that anyone can check a manifest with standard tools.
No Lightning import: usable on any ``torch.save``-d dict.
"""
from __future__ import annotations

import hashlib
import math
import pickle
from typing import Any, Iterable

import torch

from ..profile import PROFILE
from .container import CheckpointFileError, check_container, read_checkpoint
from .core import dtype_name

__all__ = ["MANIFEST_KEY", "FORMAT", "ManifestError", "ProfileMismatchError", "CheckpointFileError",
           "build_manifest", "verify_manifest", "verify_file", "check_profile", "load_checkpoint", "iter_leaves"]

MANIFEST_KEY = "ldet_manifest"
FORMAT = "ldet-manifest-v2"
_V1 = "ldet-manifest-v1"  # tensors only, paths "a/b/0"; still verified, for checkpoints written before v2


class ManifestError(RuntimeError):
    """A checkpoint does not match its manifest (corrupted, truncated or edited).

    ``problems`` lists ``{"entry": path, "problem": text}`` in checkpoint order: the first names
    the first differing entry.
    """

    def __init__(self, msg: str, problems: list[dict] | None = None) -> None:
        super().__init__(msg)
        self.problems = problems or []


class ProfileMismatchError(RuntimeError):
    """A checkpoint was written under a different numerical profile than this library's."""


def _tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def _encode(v: Any) -> str:
    """A canonical, type-tagged text of a plain value: equal texts mean equal values and types."""
    if v is None:
        return "N"
    if isinstance(v, bool):
        return "T" if v else "F"
    if type(v) is int:
        return f"i{v}"
    if type(v) is float:
        return f"f{v!r}" if math.isnan(v) or math.isinf(v) else f"f{v.hex()}"
    if type(v) is str:
        return "s" + repr(v)
    if type(v) is bytes:
        return "b" + v.hex()
    if type(v) in (list, tuple):
        open_, close = ("[", "]") if type(v) is list else ("(", ")")
        return open_ + ",".join(_encode(x) for x in v) + close
    if type(v) is dict:  # only empty dicts and dicts inside a plain list reach here
        return "{" + ",".join(f"{_encode(k)}:{_encode(x)}" for k, x in v.items()) + "}"
    # Anything else (numpy scalars, enums, hparams objects) by its pickle, as torch.save stored it.
    return f"o{type(v).__module__}.{type(v).__qualname__}:{pickle.dumps(v, protocol=4).hex()}"


def _holds_structure(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, dict)):
        return True
    return isinstance(v, (list, tuple)) and any(_holds_structure(x) for x in v)


def iter_leaves(obj: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """The ``(path, leaf)`` pairs of a checkpoint in order: tensors and plain values."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            key = k if isinstance(k, str) else repr(k) if not isinstance(k, int) else str(k)
            yield from iter_leaves(v, f"{prefix}/{key}" if prefix else key)
    elif isinstance(obj, (list, tuple)) and obj and _holds_structure(obj):
        for i, v in enumerate(obj):
            yield from iter_leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _entry(path: str, leaf: Any) -> dict:
    if isinstance(leaf, torch.Tensor):
        return {"path": path, "kind": "tensor", "dtype": dtype_name(leaf.dtype), "shape": list(leaf.shape),
                "nbytes": leaf.numel() * leaf.element_size(), "sha256": _tensor_sha256(leaf)}
    return {"path": path, "kind": "value", "type": type(leaf).__name__,
            "sha256": hashlib.sha256(_encode(leaf).encode()).hexdigest()}


def _content(checkpoint: dict) -> dict:
    return {k: v for k, v in checkpoint.items() if k != MANIFEST_KEY}


def _self_hash(man: dict) -> str:
    # The profile is left out: check_profile names a changed profile more usefully.
    return hashlib.sha256(_encode([[k, v] for k, v in sorted((k, repr(v)) for k, v in man.items()
                                                               if k not in ("sha256", "profile"))]).encode()).hexdigest()


def build_manifest(checkpoint: dict, extra: dict | None = None) -> dict:
    """The manifest of every leaf of ``checkpoint`` (all keys but the manifest's own)."""
    entries = [_entry(p, leaf) for p, leaf in iter_leaves(_content(checkpoint))]
    man = {"format": FORMAT, "profile": PROFILE, "entries": entries, **(extra or {})}
    man["sha256"] = _self_hash(man)
    return man


def _find_manifest(checkpoint: dict) -> dict:
    man = checkpoint.get(MANIFEST_KEY)
    if man is not None:
        return man
    for key, v in checkpoint.items():
        if isinstance(v, dict) and v.get("format") in (FORMAT, _V1):
            raise ManifestError(f"the checkpoint's manifest is stored under {key!r} instead of {MANIFEST_KEY!r}: "
                                "the key was corrupted or edited", [{"entry": str(key), "problem": "corrupted key"}])
    raise ManifestError("the checkpoint has no lightning_det manifest (it was not saved with "
                        "ManifestCallback / ExactResumeCallback), so it cannot be verified")


def _compare(expected: list[dict], present: dict[str, dict]) -> list[dict]:
    problems = []
    for ent in expected:
        path = ent["path"]
        got = present.pop(path, None)
        if got is None:
            problems.append({"entry": path, "problem": "missing"})
            continue
        for key in ("kind", "type", "dtype", "shape", "nbytes"):
            if ent.get(key) != got.get(key):
                problems.append({"entry": path, "problem": f"{key} is {got.get(key)}, manifest says {ent.get(key)}"})
                break
        else:
            if got["sha256"] != ent["sha256"]:
                what = "of the bytes" if ent.get("kind", "tensor") == "tensor" else "of the value"
                problems.append({"entry": path, "problem": f"SHA-256 {what} differs from the manifest"})
    problems += [{"entry": path, "problem": "not listed in the manifest"} for path in present]
    return problems


def _check_v1(checkpoint: dict, man: dict) -> list[dict]:
    def walk(obj, prefix=""):
        if isinstance(obj, torch.Tensor):
            yield prefix, obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(v, f"{prefix}/{k}" if prefix else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                yield from walk(v, f"{prefix}/{i}" if prefix else str(i))

    present = {p: _entry(p, t) for p, t in walk(_content(checkpoint))}
    return _compare([{**e, "path": e["name"], "kind": "tensor"} for e in man["tensors"]], present)


def _raise(problems: list[dict]) -> None:
    lines = "; ".join(f"{p['entry']}: {p['problem']}" for p in problems[:10])
    more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
    raise ManifestError(f"checkpoint does not match its manifest: first at {problems[0]['entry']}: {lines}{more}",
                        problems)


def verify_manifest(checkpoint: dict) -> dict:
    """Check every leaf against the manifest; raise :class:`ManifestError` naming each bad one.

    Returns a summary ``{"ok": True, "entries": n, "tensors": t, "format": ..., "profile": ...}``.
    """
    man = _find_manifest(checkpoint)
    fmt = man.get("format") if isinstance(man, dict) else None
    if fmt == _V1:
        problems = _check_v1(checkpoint, man)
        n = len(man["tensors"])
        summary = {"entries": n, "tensors": n}
    elif fmt == FORMAT:
        if man.get("sha256") != _self_hash(man):
            problems = [{"entry": MANIFEST_KEY, "problem": "the manifest's own SHA-256 differs: it was edited or corrupted"}]
        else:
            present = {p: _entry(p, leaf) for p, leaf in iter_leaves(_content(checkpoint))}
            problems = _compare(man["entries"], present)
        summary = {"entries": len(man["entries"]), "tensors": sum(e["kind"] == "tensor" for e in man["entries"])}
    else:
        raise ManifestError(f"the checkpoint's manifest has format {fmt!r}; this lightning_det reads {FORMAT!r} "
                            f"and {_V1!r}", [{"entry": f"{MANIFEST_KEY}/format", "problem": f"unknown format {fmt!r}"}])
    if problems:
        _raise(problems)
    return {"ok": True, **summary, "format": fmt, "profile": man.get("profile")}


def verify_file(path: str, map_location: Any = "cpu") -> tuple[dict, dict]:
    """Check a checkpoint file: its zip container byte for byte, then every leaf of its content.

    Returns ``(checkpoint, summary)``. Raises :class:`CheckpointFileError` when the file is
    truncated or not a checkpoint, :class:`ManifestError` naming the entries (leaf paths first,
    then zip records) that differ.
    """
    container = check_container(path)
    try:
        ckpt = read_checkpoint(path, map_location)
    except CheckpointFileError as exc:
        if container:
            _raise(container + [{"entry": "checkpoint", "problem": str(exc)}])
        raise
    try:
        summary = verify_manifest(ckpt)
    except ManifestError as exc:
        _raise(exc.problems + container if exc.problems else container or [{"entry": "checkpoint", "problem": str(exc)}])
    if container:
        _raise(container)
    return ckpt, summary


def check_profile(checkpoint: dict) -> None:
    """Reject a checkpoint written under another numerical profile, saying why."""
    man = checkpoint.get(MANIFEST_KEY) or {}
    saved = man.get("profile")
    if saved is not None and saved != PROFILE:
        raise ProfileMismatchError(
            f"checkpoint was written under numerical profile {saved!r}, but this lightning_det uses "
            f"{PROFILE!r}. The two profiles round differently, so a resumed run would not continue the "
            f"saved one bitwise. Resume with the lightning_det release that provides {saved!r}, or start a "
            "new run (loading the weights as an initialization, not as an exact resume)."
        )


def load_checkpoint(path: str, map_location: Any = "cpu") -> dict:
    """Load a checkpoint for inspection, with a clear error for a truncated or foreign file."""
    return read_checkpoint(path, map_location)
