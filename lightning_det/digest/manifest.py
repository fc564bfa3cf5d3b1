"""Checkpoint manifests: per-tensor dtype, shape, byte count and SHA-256, plus the profile.

Plain SHA-256 of the raw bytes (not the chunked digest) so that anyone can check a manifest
with standard tools. No Lightning import: usable on any ``torch.save``-d dict.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..profile import PROFILE
from .core import dtype_name, iter_named_tensors

__all__ = ["MANIFEST_KEY", "ManifestError", "ProfileMismatchError", "build_manifest", "verify_manifest",
           "check_profile", "load_checkpoint"]

MANIFEST_KEY = "ldet_manifest"


class ManifestError(RuntimeError):
    """A checkpoint does not match its manifest (corrupted, truncated or edited)."""

    def __init__(self, msg: str, problems: list[dict] | None = None) -> None:
        super().__init__(msg)
        self.problems = problems or []


class ProfileMismatchError(RuntimeError):
    """A checkpoint was written under a different numerical profile than this library's."""


def _sha256(t: torch.Tensor) -> str:
    t = t.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def build_manifest(checkpoint: dict, extra: dict | None = None) -> dict:
    """The manifest of every tensor in ``checkpoint`` (nested dicts/lists), in traversal order."""
    tensors = []
    for name, t in iter_named_tensors({k: v for k, v in checkpoint.items() if k != MANIFEST_KEY}):
        tensors.append({"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                        "nbytes": t.numel() * t.element_size(), "sha256": _sha256(t)})
    return {"format": "ldet-manifest-v1", "profile": PROFILE, "tensors": tensors, **(extra or {})}


def verify_manifest(checkpoint: dict) -> dict:
    """Check every tensor against the manifest; raise :class:`ManifestError` naming each bad one.

    Returns a summary ``{"ok": True, "tensors": n, "profile": ...}``.
    """
    man = checkpoint.get(MANIFEST_KEY)
    if man is None:
        raise ManifestError("the checkpoint has no lightning_det manifest (it was not saved with "
                            "ManifestCallback / ExactResumeCallback), so it cannot be verified")
    present = dict(iter_named_tensors({k: v for k, v in checkpoint.items() if k != MANIFEST_KEY}))
    problems = []
    for ent in man["tensors"]:
        name = ent["name"]
        t = present.pop(name, None)
        if t is None:
            problems.append({"tensor": name, "problem": "missing"})
            continue
        got = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}
        for key, val in got.items():
            if ent[key] != val:
                problems.append({"tensor": name, "problem": f"{key} is {val}, manifest says {ent[key]}"})
                break
        else:
            if _sha256(t) != ent["sha256"]:
                problems.append({"tensor": name, "problem": "SHA-256 of the bytes differs from the manifest"})
    for name in present:
        problems.append({"tensor": name, "problem": "not listed in the manifest"})
    if problems:
        lines = "; ".join(f"{p['tensor']}: {p['problem']}" for p in problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ManifestError(f"checkpoint does not match its manifest: {lines}{more}", problems)
    return {"ok": True, "tensors": len(man["tensors"]), "profile": man.get("profile")}


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
    """``torch.load`` a checkpoint for inspection; checkpoints are trusted input here, as in Lightning."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception:  # noqa: BLE001 - Lightning checkpoints may hold hparams objects
        return torch.load(path, map_location=map_location, weights_only=False)
