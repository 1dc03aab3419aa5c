"""The event store: append-only, versioned streams of facts, in memory or in SQLite.

`open_recorder(path)` gives a recorder (`Recorder`); `FactLog` appends the core's facts to
one stream and rebuilds the cluster state from it (latest snapshot + fold of the rest), and
keeps the log within its `Retention` by compacting it after each snapshot. A write on a full
disk raises `DiskFull`, having written nothing.
"""

from __future__ import annotations

import os

from dynaresized.store.factlog import FactLog
from dynaresized.store.recorder import (
    CompactedError,
    Compaction,
    ConcurrencyError,
    CorruptLogError,
    DiskFull,
    InMemoryRecorder,
    LogStart,
    Recorder,
    RecorderClosedError,
    StoredEvent,
)
from dynaresized.store.recovery import SalvageReport, salvage
from dynaresized.store.retention import DEFAULT_RETENTION_BYTES, DEFAULT_RETENTION_S, MIN_RETENTION_BYTES, Retention
from dynaresized.store.sqlite import SQLiteRecorder, StoreLockedError, writer_lock_problem

MEMORY = ":memory:"


def open_recorder(path: str | os.PathLike[str] | None, *, read_only: bool = False) -> Recorder:
    """The recorder for `path`: in memory for None or ":memory:", else the SQLite file there
    (created if missing, unless `read_only`)."""
    if path is None or os.fspath(path) == MEMORY:
        if read_only:
            raise ValueError("an in-memory store cannot be opened read-only: there is nothing to read")
        return InMemoryRecorder()
    return SQLiteRecorder(path, read_only=read_only)


__all__ = [
    "DEFAULT_RETENTION_BYTES",
    "DEFAULT_RETENTION_S",
    "MEMORY",
    "MIN_RETENTION_BYTES",
    "CompactedError",
    "Compaction",
    "ConcurrencyError",
    "CorruptLogError",
    "DiskFull",
    "FactLog",
    "InMemoryRecorder",
    "LogStart",
    "Recorder",
    "RecorderClosedError",
    "Retention",
    "SQLiteRecorder",
    "SalvageReport",
    "StoreLockedError",
    "writer_lock_problem",
    "StoredEvent",
    "open_recorder",
    "salvage",
]
