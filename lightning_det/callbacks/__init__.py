"""Lightning callbacks: run digests, capture for localization, checkpoint manifests, exact resume."""
from .digest import DigestCallback, ReplicaMismatchError
from .resume import ExactResumeCallback, ManifestCallback

__all__ = ["DigestCallback", "ReplicaMismatchError", "ManifestCallback", "ExactResumeCallback"]
