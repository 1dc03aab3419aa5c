"""Operator commands on an event log file (see docs/store.md):

  python -m dynaresized.store check PATH              read and verify everything; JSON counts
  python -m dynaresized.store salvage PATH [--through N]
                                                      rewrite the log from its intact prefix
                                                      (events 1..N), keeping the old file as
                                                      PATH.corrupt-<timestamp>

Both print one JSON object on stdout; problems go to stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import msgspec
import structlog

from dynaresized.store.recorder import CorruptLogError
from dynaresized.store.recovery import salvage
from dynaresized.store.sqlite import SQLiteRecorder, StoreLockedError, release_writer_lock, take_writer_lock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynaresized.store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="read and verify the whole log (read-only)")
    check.add_argument("path")
    cut = sub.add_parser("salvage", help="rewrite the log from its intact prefix; the daemon must be stopped")
    cut.add_argument("path")
    cut.add_argument("--through", type=int, default=None, metavar="N",
                     help="keep events 1..N even if intact events follow the damage (they are set aside)")
    args = parser.parse_args(argv)
    # Warnings are for the operator's terminal; stdout carries only the JSON result.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    path = os.path.abspath(args.path)
    try:
        if args.command == "check":
            with SQLiteRecorder(path, read_only=True) as recorder:
                result: object = recorder.check()
        else:
            if not os.path.exists(path):
                raise FileNotFoundError(f"no event log at {path}")
            lock = take_writer_lock(path)
            try:
                result = salvage(path, reason="requested by an operator", through=args.through)
            finally:
                release_writer_lock(lock)
    except (CorruptLogError, StoreLockedError, FileNotFoundError, ValueError) as e:
        print(f"dynaresized.store: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
