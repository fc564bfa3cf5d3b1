"""The ``lightning-det`` command line: ``diff``, ``report``, ``verify``.

Exit codes: 0 success / identical, 1 diverged / verification failed, 2 usage or input error.
"""
from __future__ import annotations

import argparse
import sys

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
        print(f"lightning-det {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
