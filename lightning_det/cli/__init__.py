"""The ``lightning-det`` command line: ``diff``, ``report``, ``verify``.

Exit codes: 0 success / identical, 1 diverged / verification failed, 2 usage or input error
(with ``--json``, an input error is printed as ``{"error": {...}}`` naming file, line and field).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..digest.schema import DigestFileError
from . import diff, report, verify

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-det",
        description="Compare deterministic training runs, find where they part, check checkpoints.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in (diff, report, verify):
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lightning-det`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (FileNotFoundError, ValueError) as exc:
        if getattr(args, "json", False):
            err = exc.to_json() if isinstance(exc, DigestFileError) else {"problem": str(exc)}
            print(json.dumps({"error": {"type": type(exc).__name__, "message": str(exc), **err}}, indent=2))
        print(f"lightning-det {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
