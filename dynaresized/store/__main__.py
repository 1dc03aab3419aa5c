"""Operator commands on an event log file (see docs/store.md); also `dynaresized store ...`:

  python -m dynaresized.store check PATH              read and verify everything; JSON counts
  python -m dynaresized.store salvage PATH [--through N]
                                                      rewrite the log from its intact prefix
                                                      (events 1..N), keeping the old file as
                                                      PATH.corrupt-<timestamp>
  python -m dynaresized.store compact PATH --retention-s S --retention-bytes B [--vacuum]
                                                      drop the facts past that retention that
                                                      a snapshot covers (what the daemon does
                                                      after each snapshot)

Each prints one JSON object on stdout; problems go to stderr with exit status 1. salvage and
compact take the writer lock: stop the daemon first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable

import msgspec
import structlog

from dynaresized.store.factlog import FactLog
from dynaresized.store.recorder import Compaction, CorruptLogError, DiskFull
from dynaresized.store.recovery import salvage
from dynaresized.store.retention import Retention
from dynaresized.store.sqlite import SQLiteRecorder, StoreLockedError, release_writer_lock, take_writer_lock


class CompactReport(msgspec.Struct, frozen=True):
    """What `compact` printed: the compaction, and the file's size after it."""

    path: str
    compaction: Compaction
    file_bytes: int
    vacuumed: bool


def main(argv: list[str] | None = None, *, prog: str = "python -m dynaresized.store") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="read and verify the whole log (read-only)")
    check.add_argument("path")
    cut = sub.add_parser("salvage", help="rewrite the log from its intact prefix; the daemon must be stopped")
    cut.add_argument("path")
    cut.add_argument("--through", type=int, default=None, metavar="N",
                     help="keep events 1..N even if intact events follow the damage (they are set aside)")
    compact = sub.add_parser("compact", help="drop the facts past a retention that a snapshot covers; "
                                             "the daemon must be stopped")
    compact.add_argument("path")
    compact.add_argument("--retention-s", type=_at_least_zero(float), required=True, metavar="S",
                         help="drop facts older than S seconds (the daemon's store.retention_s; 0: no age bound)")
    compact.add_argument("--retention-bytes", type=_at_least_zero(int), required=True, metavar="B",
                         help="then the oldest while the log takes more than B bytes (store.retention_bytes; 0: none)")
    compact.add_argument("--stream", default="cluster", help="the stream to compact (default: cluster)")
    compact.add_argument("--vacuum", action="store_true",
                         help="then rewrite the file without its free pages, giving the space back to the "
                              "filesystem (needs free space about the size of the log)")
    args = parser.parse_args(argv)
    # Warnings are for the operator's terminal; stdout carries only the JSON result.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    path = os.path.abspath(args.path)
    try:
        if args.command == "check":
            with SQLiteRecorder(path, read_only=True) as recorder:
                result: object = recorder.check()
        elif args.command == "compact":
            result = _compact(path, Retention(max_age_s=args.retention_s, max_bytes=args.retention_bytes),
                              args.stream, vacuum=args.vacuum)
        else:
            if not os.path.exists(path):
                raise FileNotFoundError(f"no event log at {path}")
            lock = take_writer_lock(path)
            try:
                result = salvage(path, reason="requested by an operator", through=args.through)
            finally:
                release_writer_lock(lock)
    except (CorruptLogError, StoreLockedError, FileNotFoundError, ValueError, DiskFull) as e:
        print(f"dynaresized.store: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


def _at_least_zero(kind: type[float] | type[int]) -> Callable[[str], float]:
    """An argparse type: a number of `kind`, finite and >= 0."""

    def number(text: str) -> float:
        value = kind(text)
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: no bound), got {text}")
        return value

    return number


def _compact(path: str, retention: Retention, stream: str, *, vacuum: bool) -> CompactReport:
    """Open the log as its writer (recovering it as the daemon would), compact it as the daemon
    does after a snapshot, and rewrite the file if asked."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no event log at {path}")
    with SQLiteRecorder(path) as recorder:
        compaction = FactLog(recorder, stream, retention=retention).compact(time.time(), catch_up=True)
        if vacuum:
            recorder.vacuum()
    return CompactReport(path=path, compaction=compaction, file_bytes=os.path.getsize(path), vacuumed=vacuum)


if __name__ == "__main__":
    raise SystemExit(main())
