"""The event log's file layout: the SQLite schema, the CRC32 every row carries, and how to
tell an error that means "the file is damaged" from the others.

Shared by the SQLite recorder (`dynaresized.store.sqlite`) and recovery
(`dynaresized.store.recovery`); docs/store.md describes the same layout for operators.
"""

from __future__ import annotations

import sqlite3
import struct
import zlib
from collections.abc import Sequence
from typing import Any

APPLICATION_ID = 0x44524C47  # "DRLG" in the SQLite header: marks the file as a dynaresized log
SCHEMA_VERSION = 1  # a log never compacted: what a new log is, and what dynaresized before compaction reads
COMPACTED_SCHEMA_VERSION = 2  # a compacted log (it has a log_start row); the newest schema this code reads
CHUNK = 2048  # rows per query when reading: no statement stays open between chunks
SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    position    INTEGER PRIMARY KEY,   -- the rowid: 1, 2, 3, ... across all streams, no gaps
    stream      TEXT    NOT NULL,
    version     INTEGER NOT NULL,      -- 1, 2, 3, ... within the stream, no gaps
    type        TEXT    NOT NULL,
    data        BLOB    NOT NULL,
    recorded_at REAL    NOT NULL,
    crc         INTEGER NOT NULL,      -- CRC32 of all the other columns (event_crc)
    UNIQUE (stream, version)           -- the optimistic-concurrency key
);
CREATE TABLE IF NOT EXISTS snapshots (
    stream      TEXT    NOT NULL,
    version     INTEGER NOT NULL,      -- the state after the stream's first `version` events
    data        BLOB    NOT NULL,
    recorded_at REAL    NOT NULL,
    crc         INTEGER NOT NULL,      -- CRC32 of the other columns (snapshot_crc)
    PRIMARY KEY (stream, version)
);
"""
# Created by the first compaction, which also sets user_version to COMPACTED_SCHEMA_VERSION: a
# dynaresized that does not know compaction then refuses the log instead of taking the missing
# events for damage.
LOG_START_SCHEMA = """
CREATE TABLE IF NOT EXISTS log_start (
    stream       TEXT    NOT NULL,     -- the stream compacted
    version      INTEGER NOT NULL,     -- its events 1..version are gone; its snapshot at version is kept
    position     INTEGER NOT NULL,     -- the log's events 1..position are gone
    compacted_at REAL    NOT NULL,     -- wall clock of the compaction that last moved the start
    crc          INTEGER NOT NULL      -- CRC32 of the other columns (log_start_crc)
)
"""
STREAM_INDEX = "sqlite_autoindex_events_1"  # SQLite's name for the UNIQUE (stream, version) index
COLUMNS = "position, stream, version, type, data, recorded_at, crc"

_EVENT_HEAD = struct.Struct("<qqd")
_SNAPSHOT_HEAD = struct.Struct("<qd")
_LOG_START_HEAD = struct.Struct("<qqd")

# SQLite primary result codes that mean "the file is damaged", as opposed to busy, locked,
# read-only or out of disk, which are not ours to repair.
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_SQLITE_FULL = 13  # how SQLite's unix VFS reports a write that failed with ENOSPC or ran short


def _crc(position: int, version: int, recorded_at: float, names: bytes, data: bytes) -> int:
    """The one layout an event's CRC covers; `names` is stream + NUL + type + NUL, as UTF-8."""
    return zlib.crc32(_EVENT_HEAD.pack(position, version, recorded_at) + names + data)


def _event_crc(position: int, stream: bytes, version: int, type: bytes, data: bytes, recorded_at: float) -> int:
    return _crc(position, version, recorded_at, stream + b"\0" + type + b"\0", data)


def event_crc(position: int, stream: str, version: int, type: str, data: bytes, recorded_at: float) -> int:
    """The CRC32 stored with an event: over every other column, text as UTF-8."""
    return _event_crc(position, stream.encode(), version, type.encode(), data, recorded_at)


def event_params(first_position: int, stream: str, first_version: int, events: Sequence[tuple[str, bytes]],
                 recorded_at: float) -> list[Any]:
    """The INSERT parameters of consecutive events, flat and in COLUMNS order, each row with its
    `event_crc` (the same value, computed with the stream's and each type's bytes encoded once)."""
    prefix = stream.encode() + b"\0"
    names: dict[str, bytes] = {}
    params: list[Any] = []
    add = params.extend
    position, version = first_position, first_version
    for kind, data in events:
        both = names.get(kind)
        if both is None:
            both = names[kind] = prefix + kind.encode() + b"\0"
        add((position, stream, version, kind, data, recorded_at, _crc(position, version, recorded_at, both, data)))
        position += 1
        version += 1
    return params


def insert_events_sql(rows: int) -> str:
    """One INSERT of `rows` events (multi-row VALUES), taking `event_params` for them."""
    return f"INSERT INTO events ({COLUMNS}) VALUES " + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * rows)


def row_intact(row: Sequence[Any]) -> bool:
    """Whether an events row as read (in COLUMNS order, text as bytes) matches its CRC. A row
    whose columns have the wrong types (damage SQLite did not notice) does not."""
    try:
        return _event_crc(*row[:6]) == row[6]
    except (TypeError, struct.error):
        return False


def _snapshot_crc(stream: bytes, version: int, data: bytes, recorded_at: float) -> int:
    head = _SNAPSHOT_HEAD.pack(version, recorded_at) + stream + b"\0"
    return zlib.crc32(data, zlib.crc32(head))


def snapshot_crc(stream: str, version: int, data: bytes, recorded_at: float) -> int:
    """The CRC32 stored with a snapshot: over every other column, text as UTF-8."""
    return _snapshot_crc(stream.encode(), version, data, recorded_at)


def snapshot_intact(stream: Any, version: Any, data: Any, recorded_at: Any, crc: Any) -> bool:
    """Whether a snapshots row as read (text as bytes) matches its CRC."""
    try:
        return _snapshot_crc(stream, version, data, recorded_at) == crc
    except (TypeError, struct.error):
        return False


def log_start_crc(stream: bytes, version: int, position: int, compacted_at: float) -> int:
    """The CRC32 stored with the log_start row: version and position (int64), compacted_at
    (double), then the stream's UTF-8 bytes."""
    return zlib.crc32(_LOG_START_HEAD.pack(version, position, compacted_at) + stream)


def log_start_intact(stream: Any, version: Any, position: Any, compacted_at: Any, crc: Any) -> bool:
    """Whether the log_start row as read (text as bytes) matches its CRC."""
    try:
        return log_start_crc(stream, version, position, compacted_at) == crc
    except (TypeError, struct.error):
        return False


def as_text(value: bytes) -> str:
    """A text column read as bytes (our connections read text as bytes, so that damaged text
    fails its CRC instead of failing the whole query), for messages and records."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def is_corruption(error: BaseException) -> bool:
    """Whether a sqlite3 error says the database file is damaged."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, sqlite3.DatabaseError) and code is not None and (code & 0xFF) in (
        _SQLITE_CORRUPT,
        _SQLITE_NOTADB,
    )


def is_disk_full(error: BaseException) -> bool:
    """Whether a sqlite3 error says the disk (or the filesystem's quota) is full."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, sqlite3.DatabaseError) and code is not None and (code & 0xFF) == _SQLITE_FULL


def create_schema(conn: sqlite3.Connection) -> None:
    """Create the tables and mark the file as a dynaresized log, inside the caller's transaction."""
    for statement in SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def quote_uri_path(path: str) -> str:
    """`path` for a `file:` URI: '?' and '#' would end the path part, '%' starts an escape."""
    return path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
