"""The SQLite recorder: the daemon's durable event log, one SQLite file in WAL mode.

Durability: the connection runs with `synchronous=FULL`, so SQLite fsyncs the write-ahead log
before a commit returns; once `append()` returns, its events survive a crash of the process
or of the machine. Integrity: every row carries a CRC32 of its columns, so a damaged row is
found when it is read. Recovery: SQLite itself discards a torn tail of the write-ahead log
(we detect that and log it); a damaged tail of the database file is salvaged into a fresh
file, keeping the damaged one beside it as `<name>.corrupt-<timestamp>`. Damage with intact
events after it is never cut away silently: it raises `CorruptLogError`, and an operator
decides (`python -m dynaresized.store salvage PATH --through N`). See docs/store.md.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import struct
import threading
import time
import zlib
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog

from dynaresized.store.recorder import (
    Clock,
    ConcurrencyError,
    CorruptLogError,
    RecorderClosedError,
    StoredEvent,
    check_count,
    check_events,
    check_limit,
    check_snapshot,
    check_stream,
    check_types,
)

log = structlog.get_logger("dynaresized.store")

APPLICATION_ID = 0x44524C47  # "DRLG" in the SQLite header: marks the file as a dynaresized log
SCHEMA_VERSION = 1
CHUNK = 2048  # rows per query when reading: no statement stays open between chunks
TAIL_ROWS = 256  # rows whose CRC is checked when a writer opens the log

Verify = Literal["tail", "full"]

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
_STREAM_INDEX = "sqlite_autoindex_events_1"  # SQLite's name for the UNIQUE (stream, version) index
_COLUMNS = "position, stream, version, type, data, recorded_at, crc"

_EVENT_HEAD = struct.Struct("<qqd")
_SNAPSHOT_HEAD = struct.Struct("<qd")

# SQLite primary result codes that mean "the file is damaged", as opposed to busy, locked,
# read-only or out of disk, which are not ours to repair.
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26


def event_crc(position: int, stream: str, version: int, type: str, data: bytes, recorded_at: float) -> int:
    head = _EVENT_HEAD.pack(position, version, recorded_at) + stream.encode() + b"\0" + type.encode() + b"\0"
    return zlib.crc32(data, zlib.crc32(head))


def snapshot_crc(stream: str, version: int, data: bytes, recorded_at: float) -> int:
    head = _SNAPSHOT_HEAD.pack(version, recorded_at) + stream.encode() + b"\0"
    return zlib.crc32(data, zlib.crc32(head))


def is_corruption(error: BaseException) -> bool:
    """Whether a sqlite3 error says the database file is damaged."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, sqlite3.DatabaseError) and code is not None and (code & 0xFF) in (
        _SQLITE_CORRUPT,
        _SQLITE_NOTADB,
    )


class StoreLockedError(RuntimeError):
    """Another process (or recorder) already has this log open for writing."""


class SalvageReport(msgspec.Struct, frozen=True):
    """What `salvage` kept and where it put the damaged file."""

    path: str
    damaged_copy: str
    reason: str
    last_good_position: int
    streams: dict[str, int]  # last good version per stream
    lost_events: int | None  # events the damaged file's index knew of beyond the salvaged prefix
    snapshots_kept: int


class LogCheck(msgspec.Struct, frozen=True):
    """The result of `SQLiteRecorder.check()`: the whole log was read and verified."""

    path: str
    events: int
    streams: dict[str, int]
    snapshots: int
    damaged_snapshots: int


class SQLiteRecorder:
    """The recorder on one SQLite file. One writer per file (a lock file enforces it); any
    number of `read_only=True` recorders may read while it writes (the CLI tailing the log).
    Thread-safe: calls are serialized on one connection."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        read_only: bool = False,
        clock: Clock = time.time,
        busy_timeout_s: float = 5.0,
        keep_snapshots: int = 2,
        verify: Verify = "tail",
    ) -> None:
        if verify not in ("tail", "full"):
            raise ValueError(f"verify must be 'tail' or 'full', got {verify!r}")
        if keep_snapshots < 1:
            raise ValueError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        self.path = os.path.abspath(os.fspath(path))
        self.read_only = read_only
        self._clock = clock
        self._busy_ms = int(busy_timeout_s * 1000)
        self._keep_snapshots = keep_snapshots
        self._lock = threading.RLock()
        self._closed = False
        self._lock_fd: int | None = None
        if read_only:
            if not os.path.exists(self.path):
                raise FileNotFoundError(f"no event log at {self.path}")
            self._conn = self._connect(read_only=True)
            try:
                self._check_identity(self._conn)
            except BaseException:
                self._conn.close()
                raise
            return
        self._lock_fd = take_writer_lock(self.path)
        try:
            self._conn = self._open_writer(verify)
        except BaseException:
            release_writer_lock(self._lock_fd)
            self._lock_fd = None
            raise

    # -- opening ----------------------------------------------------------------------------

    def _connect(self, *, read_only: bool = False) -> sqlite3.Connection:
        if read_only:
            uri = "file:" + _quote_uri_path(self.path) + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        conn.execute("PRAGMA cell_size_check = ON")  # find damaged b-tree pages early
        return conn

    def _check_identity(self, conn: sqlite3.Connection) -> bool:
        """Whether the file is already a dynaresized log (False: an empty database).
        Raises if it is some other application's database or a newer schema."""
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        user_version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id == APPLICATION_ID:
            if user_version > SCHEMA_VERSION:
                raise ValueError(
                    f"{self.path} was written by a newer dynaresized (schema {user_version}; "
                    f"this one reads up to {SCHEMA_VERSION}); upgrade dynaresized to open it"
                )
            return True
        if app_id != 0 or tables:
            raise ValueError(
                f"{self.path} is not a dynaresized event log (a SQLite database with application_id={app_id:#x} "
                f"and tables {sorted(tables)}); point the store at another file"
            )
        if self.read_only:
            raise ValueError(f"{self.path} is an empty database, not a dynaresized event log yet")
        return False

    def _prepare(self, conn: sqlite3.Connection) -> None:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise OSError(
                f"SQLite could not put {self.path} in WAL mode (got {mode!r}); "
                "the log needs a local filesystem that supports shared memory"
            )
        conn.execute("PRAGMA synchronous = FULL")
        if not self._check_identity(conn):
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in SCHEMA.split(";"):
                    if statement.strip():
                        conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _open_writer(self, verify: Verify) -> sqlite3.Connection:
        existed = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        conn = self._connect()
        problem: str | None = None
        wal_tail: dict[str, Any] | None = None
        try:
            self._prepare(conn)
            if existed:
                wal_tail = inspect_wal_tail(self.path, conn)
                problem = verify_log(conn, full=verify == "full")
        except sqlite3.DatabaseError as e:
            if not is_corruption(e):
                conn.close()
                raise
            problem = f"SQLite reports: {e}"
        except BaseException:
            conn.close()
            raise
        if problem is not None:
            conn.close()
            salvage(self.path, reason=problem)  # raises CorruptLogError unless only the tail is bad
            conn = self._connect()
            try:
                self._prepare(conn)
            except BaseException:
                conn.close()
                raise
        if wal_tail is not None:
            last = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
            log.warning(
                "store.wal_tail_discarded",
                file=self.path + "-wal",
                last_good_position=last,
                **wal_tail,
            )
        return conn

    # -- plumbing ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RecorderClosedError(f"the recorder on {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise PermissionError(f"the recorder on {self.path} was opened read-only")

    def _corrupt(self, e: sqlite3.DatabaseError, doing: str) -> CorruptLogError:
        return CorruptLogError(
            f"{self.path}: SQLite reports the file is damaged ({e}) while {doing}; "
            "reopen it with a writer to salvage a damaged tail, or see docs/store.md",
            path=self.path,
        )

    def _query(self, sql: str, params: Sequence[Any], doing: str) -> list[Any]:
        with self._lock:
            self._check_open()
            try:
                return self._conn.execute(sql, params).fetchall()
            except sqlite3.DatabaseError as e:
                if is_corruption(e):
                    raise self._corrupt(e, doing) from e
                raise

    def _event(self, row: tuple[Any, ...]) -> StoredEvent:
        position, stream, version, type_, data, recorded_at, crc = row
        if event_crc(position, stream, version, type_, data, recorded_at) != crc:
            raise CorruptLogError(
                f"{self.path}: the event at position {position} (stream {stream!r}, version {version}) "
                "fails its CRC32 check: its bytes were damaged after they were written. "
                f"Run `python -m dynaresized.store check {self.path}` for the extent of the damage",
                path=self.path,
                position=position,
            )
        return StoredEvent(position, stream, version, type_, data, recorded_at)

    # -- the Recorder interface -------------------------------------------------------------

    def append(self, stream: str, expected_version: int, events: Sequence[tuple[str, bytes]]) -> int:
        check_stream(stream)
        check_count("expected_version", expected_version)
        batch = check_events(events)
        with self._lock:
            self._check_writable()
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    actual = conn.execute(
                        "SELECT max(version) FROM events WHERE stream = ?", (stream,)
                    ).fetchone()[0] or 0
                    if actual != expected_version:
                        raise ConcurrencyError(stream, expected_version, actual)
                    last = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
                    now = float(self._clock())
                    rows = []
                    for i, (kind, data) in enumerate(batch, start=1):
                        position, version = last + i, expected_version + i
                        crc = event_crc(position, stream, version, kind, data, now)
                        rows.append((position, stream, version, kind, data, now, crc))
                    conn.executemany(f"INSERT INTO events ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
                    conn.execute("COMMIT")  # synchronous=FULL: the WAL is fsynced before this returns
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.IntegrityError as e:
                # The UNIQUE (stream, version) key caught a writer the version check did not see.
                actual = self.last_version(stream)
                raise ConcurrencyError(stream, expected_version, actual) from e
            except sqlite3.DatabaseError as e:
                if is_corruption(e):
                    raise self._corrupt(e, f"appending to stream {stream!r}") from e
                raise
            return expected_version + len(batch)

    def read(self, stream: str, after_version: int = 0, limit: int | None = None) -> Iterator[StoredEvent]:
        check_stream(stream)
        check_count("after_version", after_version)
        stop = check_limit(limit)
        self._check_open()
        return self._read_stream(stream, after_version, stop)

    def _read_stream(self, stream: str, after: int, stop: int | None) -> Iterator[StoredEvent]:
        sql = f"SELECT {_COLUMNS} FROM events WHERE stream = ? AND version > ? ORDER BY version LIMIT ?"
        while stop is None or stop > 0:
            n = CHUNK if stop is None else min(CHUNK, stop)
            rows = self._query(sql, (stream, after, n), f"reading stream {stream!r} after version {after}")
            for row in rows:
                event = self._event(row)
                if event.version != after + 1:
                    raise CorruptLogError(
                        f"{self.path}: stream {stream!r} jumps from version {after} to {event.version}: "
                        f"{event.version - after - 1} event(s) are missing from the middle of the log",
                        path=self.path,
                        position=event.position,
                    )
                after = event.version
                yield event
            if stop is not None:
                stop -= len(rows)
            if len(rows) < n:
                return

    def read_all(
        self, after_position: int = 0, types: Collection[str] | None = None, limit: int | None = None
    ) -> Iterator[StoredEvent]:
        check_count("after_position", after_position)
        wanted = check_types(types)
        stop = check_limit(limit)
        self._check_open()
        return self._read_all(after_position, wanted, stop)

    def _read_all(self, after: int, wanted: frozenset[str] | None, stop: int | None) -> Iterator[StoredEvent]:
        if wanted is not None and not wanted:
            return
        type_filter = "" if wanted is None else f" AND type IN ({', '.join('?' * len(wanted))})"
        sql = f"SELECT {_COLUMNS} FROM events WHERE position > ?{type_filter} ORDER BY position LIMIT ?"
        extra = () if wanted is None else tuple(sorted(wanted))
        while stop is None or stop > 0:
            n = CHUNK if stop is None else min(CHUNK, stop)
            rows = self._query(sql, (after, *extra, n), f"reading the log after position {after}")
            for row in rows:
                event = self._event(row)
                if wanted is None and event.position != after + 1:
                    raise CorruptLogError(
                        f"{self.path}: the log jumps from position {after} to {event.position}: "
                        f"{event.position - after - 1} event(s) are missing from the middle of the log",
                        path=self.path,
                        position=event.position,
                    )
                after = event.position
                yield event
            if stop is not None:
                stop -= len(rows)
            if len(rows) < n:
                return

    def last_version(self, stream: str) -> int:
        check_stream(stream)
        rows = self._query("SELECT max(version) FROM events WHERE stream = ?", (stream,), "reading a stream version")
        return rows[0][0] or 0

    def last_position(self) -> int:
        return self._query("SELECT max(position) FROM events", (), "reading the last position")[0][0] or 0

    def save_snapshot(self, stream: str, version: int, data: bytes) -> None:
        check_stream(stream)
        with self._lock:
            self._check_writable()
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    last = conn.execute("SELECT max(version) FROM events WHERE stream = ?", (stream,)).fetchone()[0]
                    blob = check_snapshot(stream, version, data, last or 0)
                    now = float(self._clock())
                    conn.execute(
                        "INSERT OR REPLACE INTO snapshots (stream, version, data, recorded_at, crc) VALUES (?, ?, ?, ?, ?)",
                        (stream, version, blob, now, snapshot_crc(stream, version, blob, now)),
                    )
                    # Snapshots are a cache of the fold: keep the newest few, not all of them.
                    conn.execute(
                        "DELETE FROM snapshots WHERE stream = ? AND version NOT IN "
                        "(SELECT version FROM snapshots WHERE stream = ? ORDER BY version DESC LIMIT ?)",
                        (stream, stream, self._keep_snapshots),
                    )
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.DatabaseError as e:
                if is_corruption(e):
                    raise self._corrupt(e, f"saving a snapshot of stream {stream!r}") from e
                raise

    def load_snapshot(self, stream: str) -> tuple[int, bytes] | None:
        check_stream(stream)
        rows = self._query(
            "SELECT version, data, recorded_at, crc FROM snapshots WHERE stream = ? ORDER BY version DESC",
            (stream,),
            f"loading a snapshot of stream {stream!r}",
        )
        last = self.last_version(stream)
        for version, data, recorded_at, crc in rows:
            if version > last:
                log.warning("store.snapshot_ignored", file=self.path, stream=stream, version=version,
                            reason=f"the snapshot is ahead of the stream (at version {last})")
                continue
            if snapshot_crc(stream, version, data, recorded_at) != crc:
                # A snapshot is only a cache of the fold: fall back to an older one (or none).
                log.warning("store.snapshot_damaged", file=self.path, stream=stream, version=version,
                            reason="fails its CRC32 check; using an older snapshot or a full replay")
                continue
            return version, data
        return None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._conn.close()  # the last connection checkpoints the WAL into the file
            finally:
                if self._lock_fd is not None:
                    release_writer_lock(self._lock_fd)
                    self._lock_fd = None

    def __enter__(self) -> SQLiteRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- operators --------------------------------------------------------------------------

    def check(self) -> LogCheck:
        """Read and verify the whole log: SQLite's integrity check, every row's CRC, no gaps in
        positions or versions, every snapshot's CRC. Raises `CorruptLogError` naming the first
        problem; returns counts otherwise."""
        with self._lock:
            self._check_open()
            try:
                problem = verify_log(self._conn, full=True)
            except sqlite3.DatabaseError as e:
                if not is_corruption(e):
                    raise
                problem = f"SQLite reports: {e}"
            if problem is not None:
                raise CorruptLogError(f"{self.path}: {problem}", path=self.path)
            streams = dict(self._conn.execute("SELECT stream, max(version) FROM events GROUP BY stream").fetchall())
            events = self._conn.execute("SELECT count(*) FROM events").fetchone()[0]
            snaps = self._conn.execute("SELECT stream, version, data, recorded_at, crc FROM snapshots").fetchall()
        damaged = sum(1 for s, v, d, r, c in snaps if snapshot_crc(s, v, d, r) != c)
        return LogCheck(path=self.path, events=events, streams=streams, snapshots=len(snaps), damaged_snapshots=damaged)


# -- verification ---------------------------------------------------------------------------


def _row_problem(row: tuple[Any, ...], position: int, versions: dict[str, int]) -> str | None:
    """Why `row` cannot be the event at `position` given each stream's last version, or None."""
    pos, stream, version, type_, data, recorded_at, crc = row
    if pos != position:
        return f"the log jumps from position {position - 1} to {pos}"
    if event_crc(pos, stream, version, type_, data, recorded_at) != crc:
        return f"the event at position {pos} (stream {stream!r}, version {version}) fails its CRC32 check"
    expected = versions.get(stream, 0) + 1
    if version != expected:
        return f"the event at position {pos} has stream {stream!r} version {version}, expected {expected}"
    return None


def verify_log(conn: sqlite3.Connection, *, full: bool) -> str | None:
    """What is wrong with the log, or None. `full=False` checks what a crash or a damaged
    file end would break, cheaply: the row count against the last position, and the CRC and
    versions of the last TAIL_ROWS rows. `full=True` reads everything. May raise
    sqlite3.DatabaseError when SQLite itself finds the damage."""
    if full:
        result = [r[0] for r in conn.execute("PRAGMA integrity_check(20)")]
        if result != ["ok"]:
            return "SQLite's integrity check fails: " + "; ".join(result)
        versions: dict[str, int] = {}
        position = 0
        while True:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM events WHERE position > ? ORDER BY position LIMIT ?", (position, CHUNK)
            ).fetchall()
            for row in rows:
                problem = _row_problem(row, position + 1, versions)
                if problem is not None:
                    return problem
                position = row[0]
                versions[row[1]] = row[2]
            if len(rows) < CHUNK:
                return None
    count, last = conn.execute("SELECT count(*), max(position) FROM events").fetchone()
    last = last or 0
    if count != last:
        return f"the log has {count} events but its last position is {last}: events are missing"
    rows = conn.execute(
        f"SELECT {_COLUMNS} FROM events ORDER BY position DESC LIMIT ?", (TAIL_ROWS,)
    ).fetchall()
    newest: dict[str, int] = {}
    for expected, row in enumerate(rows):
        pos, stream, version, type_, data, recorded_at, crc = row
        if pos != last - expected:
            return f"the log jumps from position {pos} to {last - expected + 1}"
        if event_crc(pos, stream, version, type_, data, recorded_at) != crc:
            return f"the event at position {pos} (stream {stream!r}, version {version}) fails its CRC32 check"
        if stream in newest and version != newest[stream] - 1:
            return f"stream {stream!r} jumps from version {version} to {newest[stream]}"
        if stream not in newest:
            # The newest row of the stream must be the one the (stream, version) index finds last.
            indexed = conn.execute("SELECT max(version) FROM events WHERE stream = ?", (stream,)).fetchone()[0]
            if indexed != version:
                return f"stream {stream!r} ends at version {version} but its index says {indexed}"
        newest[stream] = version
    return None


# -- the write-ahead log ------------------------------------------------------------------------


def _wal_checksum(data: bytes, big_endian: bool, s0: int = 0, s1: int = 0) -> tuple[int, int]:
    words = struct.unpack((">" if big_endian else "<") + f"{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def inspect_wal_tail(path: str, conn: sqlite3.Connection) -> dict[str, Any] | None:
    """What SQLite discarded from the end of the write-ahead log when it opened it, or None.

    SQLite replays the WAL up to its last complete, checksummed commit and ignores the rest
    (a crash mid-write leaves a torn frame or an uncommitted transaction there). It says
    nothing about it, so we compare: the frames SQLite uses (`wal_checkpoint` reports them)
    against the bytes in the file. Bytes after the valid frames that belong to the same WAL
    generation (same salts) or that do not make up a whole frame were written and discarded.
    """
    wal = path + "-wal"
    try:
        size = os.path.getsize(wal)
    except FileNotFoundError:
        return None
    if size == 0:
        return None
    _busy, frames, _done = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    frame_size = 24 + page_size
    with open(wal, "rb") as f:
        header = f.read(32)
        if len(header) < 32:
            return {"discarded_bytes": size, "valid_frames": 0, "reason": "the WAL header is incomplete"}
        magic, _version, _page, _seq, salt1, salt2, c1, c2 = struct.unpack(">8I", header)
        if magic not in (0x377F0682, 0x377F0683) or _wal_checksum(header[:24], magic & 1 == 1) != (c1, c2):
            return {"discarded_bytes": size, "valid_frames": 0, "reason": "the WAL header is damaged"}
        valid_end = 32 + max(frames, 0) * frame_size
        if size <= valid_end:
            return None
        f.seek(valid_end)
        discarded = 0
        while True:
            frame = f.read(frame_size)
            if not frame:
                break
            if len(frame) < frame_size:
                discarded += len(frame)  # a frame cut short: a torn write
                break
            fsalt1, fsalt2 = struct.unpack(">II", frame[8:16])
            if (fsalt1, fsalt2) != (salt1, salt2):
                break  # left over from an earlier WAL generation: already checkpointed, not lost
            discarded += frame_size  # written in this generation but not part of a valid commit
    if discarded == 0:
        return None
    return {
        "discarded_bytes": discarded,
        "valid_frames": max(frames, 0),
        "reason": "the WAL ends in an incomplete or damaged transaction (a crash mid-write)",
    }


# -- salvage ----------------------------------------------------------------------------------


def salvage(path: str | os.PathLike[str], *, reason: str, through: int | None = None) -> SalvageReport:
    """Copy the readable, intact prefix of a damaged log into a fresh file at `path`, keeping
    the damaged file (and its WAL) beside it as `<name>.corrupt-<timestamp>`.

    The prefix is events 1..k in position order with valid CRCs and no gaps. If an intact
    event is readable after the damage, the damage is in the middle, and dropping the events
    after it would lose data silently: CorruptLogError, the file untouched. An operator may
    still cut the log there deliberately with `through=k`. The caller must hold the writer
    lock (`take_writer_lock`) or otherwise know no writer has the file open.
    """
    path = os.path.abspath(os.fspath(path))
    if through is not None:
        check_count("through", through)
    tmp = path + ".salvage-tmp"
    for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
        if os.path.exists(leftover):
            os.remove(leftover)
    src = sqlite3.connect(path, isolation_level=None)
    try:
        src.execute("PRAGMA query_only = ON")
        # Lets SQLite read a file shorter than its header says (a truncated tail) instead of
        # refusing the whole file; we only read.
        src.execute("PRAGMA writable_schema = ON")
        dst = sqlite3.connect(tmp, isolation_level=None)
        try:
            dst.execute("PRAGMA journal_mode = WAL")
            dst.execute("PRAGMA synchronous = FULL")
            dst.execute("BEGIN IMMEDIATE")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    dst.execute(statement)
            dst.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            dst.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            good, versions, stop = _copy_prefix(src, dst, through)
            if stop is not None and (through is None or through > good):
                if through is not None:
                    raise CorruptLogError(
                        f"{path}: cannot keep events through position {through}: {stop}; "
                        f"the intact prefix ends at position {good}",
                        path=path,
                        position=good + 1,
                    )
                beyond = _intact_beyond(src, good)
                if beyond is not None:
                    raise CorruptLogError(
                        f"{path}: {stop}, but the event at position {beyond} after it is intact: the damage is "
                        "in the middle of the log, and the store will not drop the events after it silently. "
                        f"The file is untouched. Restore it from a backup, or keep events 1..{good} and set the "
                        f"rest aside with: python -m dynaresized.store salvage {path} --through {good}",
                        path=path,
                        position=good + 1,
                    )
                if good == 0:
                    raise CorruptLogError(
                        f"{path}: no event could be read ({stop}; {reason}). The file is untouched; "
                        "move it aside to start a new log, or restore it from a backup",
                        path=path,
                        position=1,
                    )
            lost = _indexed_beyond(src, good)
            kept_snapshots = _copy_snapshots(src, dst, versions)
            dst.execute("COMMIT")
        except BaseException:
            dst.close()
            for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
                if os.path.exists(leftover):
                    os.remove(leftover)
            raise
        dst.close()  # checkpoints the WAL into tmp and removes it
    finally:
        src.close()
    _fsync(tmp)
    damaged = _set_aside(path)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))
    report = SalvageReport(
        path=path,
        damaged_copy=damaged,
        reason=reason if through is None else f"operator cut the log after position {through}: {reason}",
        last_good_position=good,
        streams=versions,
        lost_events=lost,
        snapshots_kept=kept_snapshots,
    )
    log.warning(
        "store.salvaged",
        file=path,
        reason=report.reason,
        last_good_position=good,
        streams=versions,
        lost_events=lost,
        damaged_copy=damaged,
        snapshots_kept=kept_snapshots,
    )
    return report


def _copy_prefix(
    src: sqlite3.Connection, dst: sqlite3.Connection, through: int | None
) -> tuple[int, dict[str, int], str | None]:
    """Copy events 1..k from src to dst for the largest intact k (at most `through`).
    Returns k, each stream's last version, and why the copy stopped before the end (None if
    it reached the end of the readable log)."""
    good = 0
    versions: dict[str, int] = {}
    insert = f"INSERT INTO events ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
    scan = f"SELECT {_COLUMNS} FROM events WHERE position > ? ORDER BY position"
    point = f"SELECT {_COLUMNS} FROM events WHERE position = ?"

    def take(row: tuple[Any, ...]) -> str | None:
        nonlocal good
        problem = _row_problem(row, good + 1, versions)
        if problem is None:
            dst.execute(insert, row)
            good, versions[row[1]] = row[0], row[2]
        return problem

    while True:
        try:
            for row in src.execute(scan, (good,)):
                if through is not None and row[0] > through:
                    return good, versions, None
                problem = take(row)
                if problem is not None:
                    return good, versions, problem
            return good, versions, None
        except sqlite3.DatabaseError as e:
            if not is_corruption(e):
                raise
            unreadable = f"SQLite cannot read the log after position {good} ({e})"
        # A scan stops at the first page SQLite cannot read, but a lookup by position may
        # still reach rows next to it: go on one by one, and scan again after a while.
        start = good
        while through is None or good < through:
            try:
                rows = src.execute(point, (good + 1,)).fetchall()
            except sqlite3.DatabaseError as e:
                if not is_corruption(e):
                    raise
                return good, versions, unreadable
            if not rows:
                return good, versions, unreadable
            problem = take(rows[0])
            if problem is not None:
                return good, versions, problem
            if good - start >= 64:
                break
        else:
            return good, versions, None


def _intact_beyond(src: sqlite3.Connection, good: int) -> int | None:
    """The position of a readable event with a valid CRC after position good + 1, or None.
    Looks where the (stream, version) index says events were, then next to the damage, then
    at doubling distances from it."""
    candidates: list[int] = []
    try:
        for (position,) in src.execute(
            f"SELECT position FROM events INDEXED BY {_STREAM_INDEX} WHERE position > ? LIMIT 10000", (good + 1,)
        ):
            candidates.append(position)
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
    candidates.extend(range(good + 2, good + 2 + 256))
    candidates.extend(good + 1 + (1 << i) for i in range(8, 63))
    for position in sorted(set(candidates)):
        try:
            rows = src.execute(
                f"SELECT {_COLUMNS} FROM events WHERE position >= ? ORDER BY position LIMIT 1", (position,)
            ).fetchall()
        except sqlite3.DatabaseError as e:
            if not is_corruption(e):
                raise
            continue
        if not rows:
            if position > good + 1 + 256:
                break  # past the end of the readable table
            continue
        pos, stream, version, type_, data, recorded_at, crc = rows[0]
        if event_crc(pos, stream, version, type_, data, recorded_at) == crc:
            return pos
    return None


def _indexed_beyond(src: sqlite3.Connection, good: int) -> int | None:
    """How many events the damaged file's index knows of after position `good` (None if the
    index cannot be read)."""
    try:
        row = src.execute(
            f"SELECT count(*) FROM events INDEXED BY {_STREAM_INDEX} WHERE position > ?", (good,)
        ).fetchone()
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
        return None
    return row[0]


def _copy_snapshots(src: sqlite3.Connection, dst: sqlite3.Connection, versions: dict[str, int]) -> int:
    kept = 0
    try:
        rows = src.execute("SELECT stream, version, data, recorded_at, crc FROM snapshots").fetchall()
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
        log.warning("store.snapshots_unreadable", reason=str(e))
        return 0
    for stream, version, data, recorded_at, crc in rows:
        if version <= versions.get(stream, 0) and snapshot_crc(stream, version, data, recorded_at) == crc:
            dst.execute(
                "INSERT INTO snapshots (stream, version, data, recorded_at, crc) VALUES (?, ?, ?, ?, ?)",
                (stream, version, data, recorded_at, crc),
            )
            kept += 1
    return kept


def _set_aside(path: str) -> str:
    """Move the damaged file and its WAL to `<path>.corrupt-<UTC timestamp>` (and `-wal`)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    damaged = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.exists(damaged):
        n += 1
        damaged = f"{path}.corrupt-{stamp}-{n}"
    os.replace(path, damaged)
    if os.path.exists(path + "-wal"):
        os.replace(path + "-wal", damaged + "-wal")  # SQLite opens `<damaged>` with it
    if os.path.exists(path + "-shm"):
        os.remove(path + "-shm")  # an index of the WAL, rebuilt from it on open
    return damaged


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the writer lock ------------------------------------------------------------------------------


def take_writer_lock(path: str) -> int:
    """Lock `<path>.lock` for this writer, or raise StoreLockedError. A separate file, because
    closing any descriptor of the database file would drop SQLite's own POSIX locks on it."""
    lock_path = path + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLockedError(
            f"{path} is already open for writing (pid {holder}, per {lock_path}); "
            "one daemon per event log: stop the other one, or open the log read-only"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_writer_lock(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases the flock


def _quote_uri_path(path: str) -> str:
    # '?' and '#' end the path part of a URI, '%' starts an escape.
    return path.replace("%", "%25").replace("?", "%3f").replace("#", "%23")
