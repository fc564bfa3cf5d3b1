"""``lightning-det verify CHECKPOINT``: check a checkpoint file against its manifest, byte for byte."""
from __future__ import annotations

import json

from ..digest.manifest import (CheckpointFileError, ManifestError, ProfileMismatchError, check_profile,
                               verify_file)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="check a checkpoint against its manifest; exit 1 on any difference",
        description="Check a checkpoint written with ManifestCallback or ExactResumeCallback: every leaf of its "
                    "content (tensors by dtype, shape, byte count and SHA-256; RNG states, sampler positions, "
                    "hyper-parameters and counters by the SHA-256 of their values) against its manifest, every "
                    "byte of its zip container against its CRCs and torch.save's layout, and its numerical "
                    "profile against this library's. Names the first differing entry by its path.")
    p.add_argument("checkpoint", help="path of a .ckpt / torch.save file")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    res: dict = {"checkpoint": args.checkpoint}
    try:
        ckpt, summary = verify_file(args.checkpoint)
        res.update(summary)
        check_profile(ckpt)
        res["label"] = ckpt["ldet_manifest"].get("verified", "unknown")
    except CheckpointFileError as exc:
        res.update(ok=False, problems=[{"entry": "checkpoint", "problem": str(exc)}])
    except ManifestError as exc:
        res.update(ok=False, problems=exc.problems or [{"entry": "checkpoint", "problem": str(exc)}])
    except ProfileMismatchError as exc:
        res.update(ok=False, problems=[{"entry": "ldet_manifest/profile", "problem": str(exc)}])
    if args.json:
        print(json.dumps(res, indent=2))
    elif res["ok"]:
        print(f"OK: {res['entries']} entries ({res['tensors']} tensors) and every byte of the file match the "
              f"manifest (profile {res['profile']}; run label {res['label']})")
    else:
        print(f"FAILED: {args.checkpoint}")
        for p in res["problems"]:
            print(f"  {p['entry']}: {p['problem']}")
    return 0 if res["ok"] else 1
