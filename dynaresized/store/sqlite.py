"""The SQLite recorder: the daemon's durable event log, one SQLite file in WAL mode.

Durability: the connection runs with `synchronous=FULL`, so SQLite fsyncs the write-ahead log
before a commit returns; once `append()` returns, its events survive a crash of the process
or of the machine. Integrity: every row carries a CRC32 of its columns, so a damaged row is
found when it is read. Recovery: SQLite itself discards a torn tail of the write-ahead log
(we detect that and log it); a damaged tail of the database file is salvaged into a fresh
file, keeping the damaged one beside it as `<name>.corrupt-<timestamp>`. Damage with intact
events after it is never cut away silently: it raises `CorruptLogError`, and an operator
decides (`python -m dynaresized.store salvage PATH --through N`). Retention: `compact()`
drops the oldest events a snapshot covers, in one transaction (`dynaresized.store.compaction`).
A full disk: the write is rolled back and `DiskFull` raised; the recorder writes again once
there is space. See docs/store.md.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, Literal

import msgspec
import structlog

from dynaresized.store.compaction import DamagedCut, bytes_in_use, compact_log, read_log_start
from dynaresized.store.layout import (
    APPLICATION_ID,
    CHUNK,
    COLUMNS,
    COMPACTED_SCHEMA_VERSION,
    as_text,
    create_schema,
    event_params,
    insert_events_sql,
    is_corruption,
    is_disk_full,
    quote_uri_path,
    row_intact,
    snapshot_crc,
    snapshot_intact,
)
from dynaresized.store.recorder import (
    Clock,
    CompactedError,
    Compaction,
    ConcurrencyError,
    CorruptLogError,
    DiskFull,
    LogStart,
    RecorderClosedError,
    StoredEvent,
    check_compaction,
    check_count,
    check_events,
    check_limit,
    check_snapshot,
    check_stream,
    check_types,
    compacted_error,
)
from dynaresized.store.recovery import TAIL_WINDOW, inspect_wal_tail, salvage, verify_log

log = structlog.get_logger("dynaresized.store")

Verify = Literal["tail", "full"]

_COLUMN_NAMES = COLUMNS.split(", ")
_MAX_INSERT_ROWS = 256  # rows per INSERT statement (a power of two)
# Once a checkpoint has copied the WAL into the database, SQLite cuts a WAL file larger than
# this back to it: one large transaction (a compaction) leaves no WAL of its size behind.
WAL_SIZE_LIMIT = 64 * 1024 * 1024


@contextmanager
def _write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """BEGIN IMMEDIATE ... COMMIT; anything raised inside rolls back first. With
    synchronous=FULL the WAL is fsynced before COMMIT returns."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


class StoreLockedError(RuntimeError):
    """Another process (or recorder) already has this log open for writing."""


class LogCheck(msgspec.Struct, frozen=True):
    """The result of `SQLiteRecorder.check()`: the whole log was read and verified."""

    path: str
    events: int
    streams: dict[str, int]
    snapshots: int
    damaged_snapshots: int
    start: LogStart | None = None  # where the retained log starts, if it was compacted


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
        verify: Verify = "tail",
        tail_window: int = TAIL_WINDOW,
    ) -> None:
        if verify not in ("tail", "full"):
            raise ValueError(f"verify must be 'tail' or 'full', got {verify!r}")
        check_count("tail_window", tail_window)
        self.tail_window = tail_window
        self.path = os.path.abspath(os.fspath(path))
        self.read_only = read_only
        self._clock = clock
        self._busy_ms = int(busy_timeout_s * 1000)
        self._lock = threading.RLock()
        self._closed = False
        self._lock_fd: int | None = None
        self._start: LogStart | None = None  # the writer's record of where the log starts
        if read_only:
            if not os.path.exists(self.path):
                raise FileNotFoundError(f"no event log at {self.path}")
            self._conn = self._connect(read_only=True)
            try:
                if not self._check_identity(self._conn):
                    raise ValueError(f"{self.path} is an empty database, not a dynaresized event log yet")
            except sqlite3.DatabaseError as e:
                self._conn.close()
                if is_corruption(e):
                    raise self._corrupt(e, "opening it read-only") from e
                raise
            except BaseException:
                self._conn.close()
                raise
            return
        if not os.path.isdir(os.path.dirname(self.path)):
            raise FileNotFoundError(f"no directory {os.path.dirname(self.path)} for the event log {self.path}")
        self._lock_fd = take_writer_lock(self.path)
        try:
            create_private(self.path)
            self._conn = self._open_writer(verify)
        except BaseException:
            release_writer_lock(self._lock_fd)
            self._lock_fd = None
            raise
        # The one writer is the only one that moves the log's start: it keeps it (readers read it).
        try:
            self._start = self._read_start(self._conn)
        except BaseException:
            self.close()
            raise
        # As many rows per INSERT as SQLite's limit on bound parameters allows, up to _MAX_INSERT_ROWS.
        rows = self._conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(_COLUMN_NAMES)
        self._max_insert_rows = 1 << (max(min(rows, _MAX_INSERT_ROWS), 1).bit_length() - 1)
        self._insert_sql: dict[int, str] = {}

    # -- opening ----------------------------------------------------------------------------

    def _connect(self, *, read_only: bool = False) -> sqlite3.Connection:
        if read_only:
            uri = "file:" + quote_uri_path(self.path) + "?mode=ro"
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        else:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.text_factory = bytes  # see layout.as_text
        conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        conn.execute("PRAGMA cell_size_check = ON")  # find damaged b-tree pages early
        return conn

    def _check_identity(self, conn: sqlite3.Connection) -> bool:
        """Whether the file is already a dynaresized log (False: an empty database, which a
        writer makes one). Raises if it is another application's database or a newer schema."""
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        user_version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {as_text(r[0]) for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id == APPLICATION_ID:
            if user_version > COMPACTED_SCHEMA_VERSION:
                raise ValueError(
                    f"{self.path} was written by a newer dynaresized (schema {user_version}; "
                    f"this one reads up to {COMPACTED_SCHEMA_VERSION}); upgrade dynaresized to open it"
                )
            return True
        if app_id != 0 or tables:
            raise ValueError(
                f"{self.path} is not a dynaresized event log (a SQLite database with application_id={app_id:#x} "
                f"and tables {sorted(tables)}); point the store at another file"
            )
        return False

    def _prepare(self, conn: sqlite3.Connection) -> None:
        mode = as_text(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        if mode != "wal":
            raise OSError(
                f"SQLite could not put {self.path} in WAL mode (got {mode!r}); "
                "the log needs a local filesystem that supports shared memory"
            )
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        if not self._check_identity(conn):
            with _write_transaction(conn):
                create_schema(conn)

    def _open_writer(self, verify: Verify) -> sqlite3.Connection:
        problem: str | None = None
        wal_tail: dict[str, Any] | None = None
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            # Before SQLite touches the WAL: what will it drop from the end?
            wal_tail = inspect_wal_tail(self.path)
            # Check on a read-only connection: closing it neither checkpoints nor removes the
            # WAL, so a salvage finds (and keeps) the files exactly as the crash left them.
            checker = self._connect(read_only=True)
            try:
                if self._check_identity(checker):
                    problem = verify_log(checker, full=verify == "full", tail=self.tail_window)
            except sqlite3.DatabaseError as e:
                if not is_corruption(e):
                    raise
                problem = f"SQLite reports: {e}"
            finally:
                checker.close()
        if problem is not None:
            # Raises CorruptLogError, leaving the file untouched, unless the damage is in the tail.
            salvage(self.path, reason=problem, tail_window=self.tail_window)
        conn = self._connect()
        try:
            self._prepare(conn)
        except BaseException:
            conn.close()
            raise
        if wal_tail is not None:
            last = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
            log.warning("store.wal_tail_discarded", file=self.path + "-wal", last_good_position=last, **wal_tail)
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

    def _write_error(self, e: sqlite3.DatabaseError, doing: str) -> Exception | None:
        """The store's error for a SQLite error in a write (its transaction already rolled
        back): CorruptLogError, DiskFull, or None for one to raise as it is."""
        if is_corruption(e):
            return self._corrupt(e, doing)
        if is_disk_full(e):
            return DiskFull(self.path, doing)
        return None

    def _read_start(self, conn: sqlite3.Connection) -> LogStart | None:
        try:
            return read_log_start(conn)
        except CorruptLogError as e:
            raise CorruptLogError(f"{self.path}: {e}", path=self.path) from None
        except sqlite3.DatabaseError as e:
            if is_corruption(e):
                raise self._corrupt(e, "reading where the log starts") from e
            raise

    def _log_start(self) -> LogStart | None:
        """Where the log starts: the writer's own record, or read again (another process may
        have compacted the log since)."""
        with self._lock:
            self._check_open()
            return self._read_start(self._conn) if self.read_only else self._start

    def _base(self, stream: str, start: LogStart | None) -> int:
        return start.version if start is not None and start.stream == stream else 0

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
        if not row_intact(row):
            position, stream, version = row[0], as_text(row[1]), row[2]
            raise CorruptLogError(
                f"{self.path}: the event at position {position} (stream {stream!r}, version {version}) "
                "fails its CRC32 check: its bytes were damaged after they were written. "
                f"Run `python -m dynaresized.store check {self.path}` for the extent of the damage",
                path=self.path,
                position=position,
            )
        return StoredEvent(row[0], row[1].decode(), row[2], row[3].decode(), row[4], row[5])

    # -- the Recorder interface -------------------------------------------------------------

    def append(self, stream: str, expected_version: int, events: Sequence[tuple[str, bytes]]) -> int:
        check_stream(stream)
        check_count("expected_version", expected_version)
        batch = check_events(events)
        with self._lock:
            self._check_writable()
            conn = self._conn
            try:
                with _write_transaction(conn):  # durable once it ends
                    start = self._start  # none of its stream's events may be left: then max() is NULL
                    actual = conn.execute(
                        "SELECT max(version) FROM events WHERE stream = ?", (stream,)
                    ).fetchone()[0] or self._base(stream, start)
                    if actual != expected_version:
                        raise ConcurrencyError(stream, expected_version, actual)
                    last = conn.execute("SELECT max(position) FROM events").fetchone()[0] or (
                        0 if start is None else start.position)
                    now = float(self._clock())
                    self._insert(conn, event_params(last + 1, stream, expected_version + 1, batch, now))
            except sqlite3.IntegrityError as e:
                # The UNIQUE (stream, version) key caught a writer the version check did not see.
                actual = self.last_version(stream)
                raise ConcurrencyError(stream, expected_version, actual) from e
            except sqlite3.DatabaseError as e:
                error = self._write_error(e, f"appending {len(batch)} event(s) to stream {stream!r} "
                                             f"after version {expected_version}")
                if error is None:
                    raise
                raise error from e
            return expected_version + len(batch)

    def _insert(self, conn: sqlite3.Connection, params: list[Any]) -> None:
        """Insert the rows of `event_params` with multi-row INSERTs of _MAX_INSERT_ROWS, then of
        halving sizes for the rest: a handful of statements (each cached by the connection), where
        executemany would step once per row and release and re-take the GIL around every step."""
        width = len(_COLUMN_NAMES)
        rows, done = len(params) // width, 0
        while done < rows:
            n = min(rows - done, self._max_insert_rows)
            n = 1 << (n.bit_length() - 1)  # a power of two: at most log2(_MAX_INSERT_ROWS) + 1 statements
            sql = self._insert_sql.get(n)
            if sql is None:
                sql = self._insert_sql[n] = insert_events_sql(n)
            conn.execute(sql, params[done * width:(done + n) * width])
            done += n

    def read(self, stream: str, after_version: int = 0, limit: int | None = None) -> Iterator[StoredEvent]:
        check_stream(stream)
        check_count("after_version", after_version)
        stop = check_limit(limit)
        start = self._log_start()
        if after_version < self._base(stream, start):
            assert start is not None
            raise compacted_error(stream, after_version, start)
        # A read covers the stream as it is now; events appended while it is consumed are not
        # part of it (the next read gets them).
        end = self.last_version(stream)
        return self._read_stream(stream, after_version, stop, end)

    def _read_stream(self, stream: str, after: int, stop: int | None, end: int) -> Iterator[StoredEvent]:
        sql = f"SELECT {COLUMNS} FROM events WHERE stream = ? AND version > ? AND version <= ? ORDER BY version LIMIT ?"
        return self._scan(sql, lambda a, n: (stream, a, end, n), lambda e: e.version, after, end, stop,
                          gapless=True, stream=stream, subject=f"stream {stream!r}", whole="the stream",
                          unit="version")

    def read_all(
        self, after_position: int = 0, types: Collection[str] | None = None, limit: int | None = None
    ) -> Iterator[StoredEvent]:
        check_count("after_position", after_position)
        wanted = check_types(types)
        stop = check_limit(limit)
        start = self._log_start()
        if start is not None:
            after_position = max(after_position, start.position)  # the retained log
        end = self.last_position()  # as in read(): the log as it is now
        return self._read_all(after_position, wanted, stop, end)

    def _read_all(
        self, after: int, wanted: frozenset[str] | None, stop: int | None, end: int
    ) -> Iterator[StoredEvent]:
        if wanted is not None and not wanted:
            return iter(())
        type_filter = "" if wanted is None else f" AND type IN ({', '.join('?' * len(wanted))})"
        sql = (
            f"SELECT {COLUMNS} FROM events WHERE position > ? AND position <= ?{type_filter} "
            "ORDER BY position LIMIT ?"
        )
        extra = () if wanted is None else tuple(sorted(wanted))
        # A filtered read skips positions on purpose: only an unfiltered one can check for gaps.
        return self._scan(sql, lambda a, n: (a, end, *extra, n), lambda e: e.position, after, end, stop,
                          gapless=wanted is None, stream=None, subject="the log", whole="it", unit="position")

    def _scan(self, sql: str, params: Callable[[int, int], tuple[Any, ...]], key: Callable[[StoredEvent], int],
              after: int, end: int, stop: int | None, *, gapless: bool, stream: str | None, subject: str,
              whole: str, unit: str) -> Iterator[StoredEvent]:
        """Read in chunks of CHUNK rows ordered by `key` (versions of `stream`, or positions for
        None), up to `end`; with `gapless`, a key that skips or a scan that ends before `end` means
        events are missing: compacted while the read ran (CompactedError), else CorruptLogError."""
        while stop is None or stop > 0:
            n = CHUNK if stop is None else min(CHUNK, stop)
            rows = self._query(sql, params(after, n), f"reading {subject} after {unit} {after}")
            for row in rows:
                event = self._event(row)
                if gapless and key(event) != after + 1:
                    self._check_not_compacted(stream, after, subject, unit)
                    raise CorruptLogError(
                        f"{self.path}: {subject} jumps from {unit} {after} to {key(event)}: "
                        f"{key(event) - after - 1} event(s) are missing from the middle of the log",
                        path=self.path,
                        position=event.position,
                    )
                after = key(event)
                yield event
            if stop is not None:
                stop -= len(rows)
            if len(rows) < n:
                if gapless and after < end:
                    self._check_not_compacted(stream, after, subject, unit)
                    # A damaged index page can end a scan early without an error from SQLite.
                    raise CorruptLogError(
                        f"{self.path}: reading {subject} stops at {unit} {after}, but {whole} reaches {unit} "
                        f"{end}: events are missing; `python -m dynaresized.store check {self.path}` says where",
                        path=self.path,
                    )
                return

    def _check_not_compacted(self, stream: str | None, after: int, subject: str, unit: str) -> None:
        """Raise CompactedError if events a read was about to return were compacted while it ran
        (it reads in chunks, each its own transaction), rather than report them missing."""
        start = self._log_start()
        if start is None:
            return
        if (start.position if stream is None else self._base(stream, start)) > after:
            raise CompactedError(
                f"{self.path}: {subject} after {unit} {after} was compacted while it was read (the log now "
                f"starts after position {start.position}); read it again",
                start=start,
            )

    def last_version(self, stream: str) -> int:
        check_stream(stream)
        rows = self._query("SELECT max(version) FROM events WHERE stream = ?", (stream,), "reading a stream version")
        return rows[0][0] or self._base(stream, self._log_start())

    def last_position(self) -> int:
        last = self._query("SELECT max(position) FROM events", (), "reading the last position")[0][0]
        if last is not None:
            return int(last)
        start = self._log_start()
        return 0 if start is None else start.position

    def save_snapshot(self, stream: str, version: int, data: bytes) -> None:
        check_stream(stream)
        with self._lock:
            self._check_writable()
            conn = self._conn
            try:
                with _write_transaction(conn):
                    last = conn.execute("SELECT max(version) FROM events WHERE stream = ?", (stream,)).fetchone()[0]
                    blob = check_snapshot(stream, version, data, last or self._base(stream, self._start))
                    now = float(self._clock())
                    # Every snapshot is kept until a compaction drops the events before it (they are
                    # small next to the events they stand for): until then nothing in the file is
                    # deleted, so SQLite allocates pages in the order things were written, and a
                    # file cut short loses only what was written last.
                    conn.execute(
                        "INSERT OR REPLACE INTO snapshots (stream, version, data, recorded_at, crc) "
                        "VALUES (?, ?, ?, ?, ?)",
                        (stream, version, blob, now, snapshot_crc(stream, version, blob, now)),
                    )
            except sqlite3.DatabaseError as e:
                error = self._write_error(e, f"saving a snapshot of stream {stream!r} at version {version}")
                if error is None:
                    raise
                raise error from e

    def load_snapshot(self, stream: str, version: int | None = None) -> tuple[int, bytes] | None:
        check_stream(stream)
        exactly = "" if version is None else " AND version = ?"
        rows = self._query(
            f"SELECT version, data, recorded_at, crc FROM snapshots WHERE stream = ?{exactly} ORDER BY version DESC",
            (stream,) if version is None else (stream, check_count("version", version)),
            f"loading a snapshot of stream {stream!r}",
        )
        last = self.last_version(stream)
        for at, data, recorded_at, crc in rows:
            if not snapshot_intact(stream.encode(), at, data, recorded_at, crc):
                # A snapshot is only a cache of the fold: fall back to an older one (or none).
                log.warning("store.snapshot_damaged", file=self.path, stream=stream, version=at,
                            reason="fails its CRC32 check; using an older snapshot or a full replay")
                continue
            if at > last:
                log.warning("store.snapshot_ignored", file=self.path, stream=stream, version=at,
                            reason=f"the snapshot is ahead of the stream (at version {last})")
                continue
            return at, data
        return None

    def log_start(self) -> LogStart | None:
        return self._log_start()

    def compact(self, stream: str, *, recorded_before: float | None = None, max_bytes: int | None = None,
                max_events: int | None = None) -> Compaction:
        with self._lock:
            self._check_writable()
            base = check_compaction(stream, self._start, recorded_before, max_bytes, max_events)
            conn = self._conn
            try:
                with _write_transaction(conn):  # all or nothing: a crash leaves the old log or the new
                    result = compact_log(conn, stream, self._start, base, recorded_before=recorded_before,
                                         max_bytes=max_bytes, max_events=max_events, now=float(self._clock()))
            except DamagedCut as e:
                # Rolled back. A later compaction cuts at a later snapshot.
                log.warning("store.compaction_skipped", file=self.path, stream=stream,
                            reason=f"{e}; nothing was dropped")
                return Compaction(start=self._start, dropped_events=0, dropped_snapshots=0,
                                  bytes_in_use=bytes_in_use(conn), over_budget=False)
            except sqlite3.DatabaseError as e:
                error = self._write_error(e, f"compacting stream {stream!r}")
                if error is None:
                    raise
                raise error from e
            self._start = result.start
            return result

    def vacuum(self) -> None:
        """Rewrite the database file without its free pages, giving the space a compaction
        freed back to the filesystem (and laying the pages out in written order again). Needs
        free space about the size of the log for the copy; the log is locked meanwhile."""
        with self._lock:
            self._check_writable()
            try:
                self._conn.execute("VACUUM")
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.DatabaseError as e:
                error = self._write_error(e, "rewriting the log (VACUUM)")
                if error is None:
                    raise
                raise error from e

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
                problem = verify_log(self._conn, full=True, tail=self.tail_window)
            except sqlite3.DatabaseError as e:
                if not is_corruption(e):
                    raise
                problem = f"SQLite reports: {e}"
            if problem is not None:
                raise CorruptLogError(f"{self.path}: {problem}", path=self.path)
            start = self._read_start(self._conn)
            streams = {} if start is None else {start.stream: start.version}  # all its events may be gone
            streams.update(
                (as_text(stream), version)
                for stream, version in self._conn.execute("SELECT stream, max(version) FROM events GROUP BY stream")
            )
            events = self._conn.execute("SELECT count(*) FROM events").fetchone()[0]
            snaps = self._conn.execute("SELECT stream, version, data, recorded_at, crc FROM snapshots").fetchall()
        damaged = sum(1 for row in snaps if not snapshot_intact(*row))
        return LogCheck(path=self.path, events=events, streams=streams, snapshots=len(snaps), damaged_snapshots=damaged,
                        start=start)


# -- file modes -----------------------------------------------------------------------------------

LOG_FILE_MODE = 0o640
"""The event log, its -wal and -shm files and its lock: the daemon's user writes, its group
reads (`dynaresized events`), others nothing, whatever umask started the daemon."""


def create_private(path: str) -> None:
    """Create the database file with LOG_FILE_MODE before SQLite opens it (SQLite creates a
    missing file under the umask, and gives its -wal and -shm files the database file's mode);
    tighten the files an older version or a wider umask left readable to others."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, LOG_FILE_MODE)
    except FileExistsError:
        for existing in (path, path + "-wal", path + "-shm"):
            with suppress(FileNotFoundError):
                st = os.stat(existing)
                if st.st_uid == os.geteuid() and st.st_mode & 0o777 != LOG_FILE_MODE:
                    os.chmod(existing, LOG_FILE_MODE)
        return
    try:
        os.fchmod(fd, LOG_FILE_MODE)  # exactly: a umask of 077 would take the group's read away
    finally:
        os.close(fd)


# -- the writer lock ------------------------------------------------------------------------------


def take_writer_lock(path: str) -> int:
    """Lock `<path>.lock` for this writer, or raise StoreLockedError. A separate file, because
    closing any descriptor of the database file would drop SQLite's own POSIX locks on it."""
    lock_path = path + ".lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, LOG_FILE_MODE)
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
    os.fchmod(fd, LOG_FILE_MODE)  # also tightens a lock file an older version left 0644
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def writer_lock_problem(path: str) -> str:
    """Why `path` cannot be opened for writing now: another process holds its writer lock (what
    `take_writer_lock` would raise), or "". Creates nothing: a log without a lock file is free."""
    lock_path = path + ".lock"
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: fails only while a writer holds it
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        return (f"{path} is already open for writing (pid {holder}, per {lock_path}); "
                "one daemon per event log: stop the other one, or give this configuration its own state_dir")
    finally:
        os.close(fd)
    return ""


def release_writer_lock(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases the flock
