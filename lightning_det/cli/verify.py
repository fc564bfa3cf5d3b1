"""``lightning-det verify CHECKPOINT``: check a checkpoint against its manifest."""
from __future__ import annotations

import json

from ..digest.manifest import ManifestError, ProfileMismatchError, check_profile, load_checkpoint, verify_manifest


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="check a checkpoint's tensors against its manifest; exit 1 on a mismatch",
        description="Recompute the SHA-256 of every tensor in a checkpoint written with ManifestCallback or "
                    "ExactResumeCallback and compare dtype, shape, byte count and hash with its manifest, and "
                    "its numerical profile with this library's.")
    p.add_argument("checkpoint", help="path of a .ckpt / torch.save file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    res: dict = {"checkpoint": args.checkpoint}
    try:
        ckpt = load_checkpoint(args.checkpoint)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is a failed verification
        res.update(ok=False, problems=[{"tensor": None, "problem": f"cannot load the file: {type(exc).__name__}: {exc}"}])
    else:
        try:
            res.update(verify_manifest(ckpt))
            check_profile(ckpt)
        except ManifestError as exc:
            res.update(ok=False, problems=exc.problems or [{"tensor": None, "problem": str(exc)}])
        except ProfileMismatchError as exc:
            res.update(ok=False, problems=[{"tensor": None, "problem": str(exc)}])
    if args.json:
        print(json.dumps(res, indent=2))
    elif res["ok"]:
        print(f"OK: {res['tensors']} tensors match the manifest (profile {res['profile']})")
    else:
        print(f"FAILED: {args.checkpoint}")
        for p in res["problems"]:
            print(f"  {p['tensor'] + ': ' if p['tensor'] else ''}{p['problem']}")
    return 0 if res["ok"] else 1
