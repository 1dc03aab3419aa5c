"""Recovery of a damaged event log: what a writer checks when it opens the log, what SQLite
dropped from the end of the write-ahead log, and the salvage of a damaged tail.

SQLite replays its write-ahead log up to the last complete commit by itself; we only find
out and say so (`inspect_wal_tail`). Damage to the database file is ours to handle: a
damaged tail is salvaged into a fresh file (`salvage`), the damaged file kept beside it;
damage in the middle is refused with `CorruptLogError`, for an operator to decide.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import time
from typing import Any

import msgspec
import structlog

from dynaresized.store.compaction import read_log_start, write_log_start
from dynaresized.store.layout import (
    CHUNK,
    COLUMNS,
    STREAM_INDEX,
    as_text,
    create_schema,
    is_corruption,
    quote_uri_path,
    row_intact,
    snapshot_intact,
)
from dynaresized.store.recorder import CorruptLogError, LogStart, check_count

log = structlog.get_logger("dynaresized.store")

TAIL_WINDOW = 1000
"""The last events of the log that count as its tail: a writer checks them when it opens the
log, and damage among them is salvaged automatically (see `salvage`)."""


class SalvageReport(msgspec.Struct, frozen=True):
    """What `salvage` kept and where it put the damaged file."""

    path: str
    damaged_copy: str
    reason: str
    last_good_position: int
    streams: dict[str, int]  # last good version per stream
    lost_events: int | None  # events the damaged file's index knew of beyond the salvaged prefix
    prefix_ends: str  # why the salvaged prefix ends where it does
    snapshots_kept: int


# -- verification ---------------------------------------------------------------------------


def _row_problem(row: tuple[Any, ...], position: int, versions: dict[bytes, int]) -> str | None:
    """Why `row` (as read) cannot be the event at `position` given each stream's last
    version, or None."""
    pos, stream, version = row[:3]
    if pos != position:
        return f"the log jumps from position {position - 1} to {pos}"
    if not row_intact(row):
        return f"the event at position {pos} (stream {as_text(stream)!r}, version {version}) fails its CRC32 check"
    expected = versions.get(stream, 0) + 1
    if version != expected:
        return f"the event at position {pos} has stream {as_text(stream)!r} version {version}, expected {expected}"
    return None


def _bases(start: LogStart | None) -> tuple[int, dict[bytes, int]]:
    """The last position a compaction dropped, and each stream's last version it dropped."""
    return (0, {}) if start is None else (start.position, {start.stream.encode(): start.version})


def verify_log(conn: sqlite3.Connection, *, full: bool, tail: int = TAIL_WINDOW) -> str | None:
    """What is wrong with the log, or None. `full=False` checks what a crash or a damaged
    file end would break, cheaply: the row count against the positions from the log's start
    to its last, and the CRC and versions of the last `tail` rows, and the snapshots.
    `full=True` reads everything. May raise sqlite3.DatabaseError when SQLite itself finds
    the damage."""
    try:
        first, bases = _bases(read_log_start(conn))
    except CorruptLogError as e:
        return str(e)
    if full:
        result = [as_text(r[0]) for r in conn.execute("PRAGMA integrity_check(20)")]
        if result != ["ok"]:
            return "SQLite's integrity check fails: " + "; ".join(result)
        versions = dict(bases)
        position = first
        while True:
            rows = conn.execute(
                f"SELECT {COLUMNS} FROM events WHERE position > ? ORDER BY position LIMIT ?", (position, CHUNK)
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
    last = last or first
    if count != last - first:
        kept = f"its last position is {last}" if not first else f"it keeps positions {first + 1}..{last}"
        return f"the log has {count} events but {kept}: events are missing"
    rows = conn.execute(
        f"SELECT {COLUMNS} FROM events ORDER BY position DESC LIMIT ?", (tail,)
    ).fetchall()
    top: dict[bytes, int] = {}  # each stream's highest version in the tail (seen first)
    lowest: dict[bytes, int] = {}  # and its lowest so far (walking down)
    for expected, row in enumerate(rows):
        pos, stream, version = row[:3]
        if pos != last - expected:
            return f"the log jumps from position {pos} to {last - expected + 1}"
        if not row_intact(row):
            return f"the event at position {pos} (stream {as_text(stream)!r}, version {version}) fails its CRC32 check"
        if stream in lowest and version != lowest[stream] - 1:
            return f"stream {as_text(stream)!r} jumps from version {version} to {lowest[stream]}"
        top.setdefault(stream, version)
        lowest[stream] = version
    # The (stream, version) index must hold exactly the tail's events, up to the same last
    # version: reads by stream use it, and a damaged index page can hide events from them
    # without SQLite noticing.
    for stream, first in lowest.items():
        name = stream.decode()  # intact, so valid UTF-8; the column compares as text
        indexed, indexed_last = conn.execute(
            f"SELECT count(*), max(version) FROM events INDEXED BY {STREAM_INDEX} WHERE stream = ? AND version >= ?",
            (name, first),
        ).fetchone()
        if (indexed, indexed_last) != (top[stream] - first + 1, top[stream]):
            return (
                f"the (stream, version) index holds {indexed} entries up to version {indexed_last} for stream "
                f"{name!r} from version {first}, but the log holds versions {first}..{top[stream]}"
            )
    # Snapshots are few; reading them all (with their overflow pages) finds damaged pages there.
    conn.execute("SELECT stream, version, data, crc FROM snapshots").fetchall()
    return None


# -- the write-ahead log ------------------------------------------------------------------------

_WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums little-endian / big-endian
_WAL_HEADER = struct.Struct(">8I")  # magic, version, page size, checkpoint seq, salt1, salt2, cksum1, cksum2
_FRAME_HEADER = struct.Struct(">6I")  # page, db size after commit (0: not a commit), salt1, salt2, cksum1, cksum2


def _wal_checksum(data: bytes, big_endian: bool, s0: int = 0, s1: int = 0) -> tuple[int, int]:
    """SQLite's WAL checksum (a Fibonacci-weighted sum of 32-bit words), continued from (s0, s1)."""
    words = struct.unpack((">" if big_endian else "<") + f"{len(data) // 4}I", data)
    it = iter(words)
    for a, b in zip(it, it, strict=True):  # the data is a whole number of 8-byte pairs
        s0 = (s0 + a + s1) & 0xFFFFFFFF
        s1 = (s1 + b + s0) & 0xFFFFFFFF
    return s0, s1


def inspect_wal_tail(path: str) -> dict[str, Any] | None:
    """What SQLite will discard from the end of the write-ahead log when it opens it, or None.

    SQLite replays the WAL up to its last commit frame whose checksum chain is intact and
    ignores the rest (a crash mid-write leaves a torn frame or a transaction without its
    commit frame there), without saying so. We read the WAL the same way before SQLite opens
    it: bytes of the current WAL generation (same salts) after the last valid commit were
    written and will be lost. Frames of an earlier generation were checkpointed long ago.
    """
    wal = path + "-wal"
    try:
        f = open(wal, "rb")
    except FileNotFoundError:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None
        header = f.read(32)
        if len(header) < 32:
            return {"discarded_bytes": size, "valid_frames": 0, "reason": "the WAL header is incomplete"}
        magic, _version, page_size, _seq, salt1, salt2, c1, c2 = _WAL_HEADER.unpack(header)
        big_endian = magic == _WAL_MAGIC[1]
        if (
            magic not in _WAL_MAGIC
            or page_size < 512
            or page_size & (page_size - 1)
            or _wal_checksum(header[:24], big_endian) != (c1, c2)
        ):
            return {"discarded_bytes": size, "valid_frames": 0, "reason": "the WAL header is damaged"}
        frame_size = 24 + page_size
        checksum = (c1, c2)
        frames = valid = 0  # frames read with an intact chain; frames up to the last commit among them
        chain_intact = True
        end = 32  # the end of the current generation's bytes
        why = "a transaction without its commit frame (a crash mid-write)"
        while True:
            frame = f.read(frame_size)
            if not frame:
                break
            if len(frame) < frame_size:
                end += len(frame)
                why = "an incomplete frame (a torn write)"
                break
            page, commit, fsalt1, fsalt2, fc1, fc2 = _FRAME_HEADER.unpack_from(frame)
            if (fsalt1, fsalt2) != (salt1, salt2):
                break  # an earlier generation's frame: not part of this log
            end += frame_size
            if chain_intact:
                checksum = _wal_checksum(frame[:8] + frame[24:], big_endian, *checksum)
                if checksum != (fc1, fc2):
                    chain_intact = False
                    why = "a frame that fails its checksum (damaged or torn)"
                    continue
                frames += 1
                if commit:
                    valid = frames
    discarded = end - (32 + valid * frame_size)
    if discarded <= 0:
        return None
    return {"discarded_bytes": discarded, "valid_frames": valid, "reason": f"the WAL ends in {why}"}


# -- salvage ----------------------------------------------------------------------------------


def salvage(
    path: str | os.PathLike[str], *, reason: str, through: int | None = None, tail_window: int = TAIL_WINDOW
) -> SalvageReport:
    """Copy the readable, intact prefix of a damaged log into a fresh file at `path`, keeping
    the damaged file (and its WAL) beside it as `<name>.corrupt-<timestamp>`.

    The prefix is events 1..k in position order, each with a valid CRC, with no gaps: the
    fold cannot skip an event, so nothing after the first damaged event is usable either.
    If the damage is in the tail (no intact event `tail_window` or more positions after the
    first damaged one), the log is cut there: the events after it stay in the damaged copy
    and the warning says how many. Otherwise the damage is in the middle of the log: dropping
    everything after it is an operator's decision, so CorruptLogError, the file untouched;
    the operator can still cut the log there with `through=k`. The caller must hold the
    writer lock (`take_writer_lock`) or otherwise know no writer has the file open.
    """
    path = os.path.abspath(os.fspath(path))
    if through is not None:
        check_count("through", through)
    tmp = path + ".salvage-tmp"
    for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
        if os.path.exists(leftover):
            os.remove(leftover)
    # Read-only: closing it neither checkpoints nor removes the WAL, so the damaged copy we
    # keep is exactly what we found.
    src = sqlite3.connect("file:" + quote_uri_path(path) + "?mode=ro", uri=True, isolation_level=None)
    src.text_factory = bytes  # see layout.as_text
    try:
        # Lets SQLite read a file shorter than its header says (a truncated tail) instead of
        # refusing the whole file; we only read.
        src.execute("PRAGMA writable_schema = ON")
        dst = sqlite3.connect(tmp, isolation_level=None)
        try:
            dst.execute("PRAGMA journal_mode = WAL")
            dst.execute("PRAGMA synchronous = FULL")
            dst.execute("BEGIN IMMEDIATE")
            create_schema(dst)
            start = _log_start_of(src, path)
            if start is not None:
                write_log_start(dst, start)
            first, _ = _bases(start)
            if through is not None and through < first:
                raise CorruptLogError(f"{path}: cannot keep events through position {through}: the log was "
                                      f"compacted, its first event is at position {first + 1}", path=path)
            good, versions, stop = _copy_prefix(src, dst, through, start)
            if stop is not None and (through is None or through > good):
                if through is not None:
                    raise CorruptLogError(
                        f"{path}: cannot keep events through position {through}: {stop}; "
                        f"the intact prefix ends at position {good}",
                        path=path,
                        position=good + 1,
                    )
                beyond = _intact_from(src, good + 1 + tail_window)
                if beyond is not None:
                    raise CorruptLogError(
                        f"{path}: {stop}, but the event at position {beyond}, more than {tail_window} events "
                        "later, is intact: the damage is in the middle of the log, and the store will not drop "
                        f"the events after it on its own. The file is untouched. Restore it from a backup, or "
                        f"keep events 1..{good} and set the rest aside with: "
                        f"python -m dynaresized.store salvage {path} --through {good}",
                        path=path,
                        position=good + 1,
                    )
                if good == first:
                    raise CorruptLogError(
                        f"{path}: no event could be read ({stop}; {reason}). The file is untouched; "
                        "move it aside to start a new log, or restore it from a backup",
                        path=path,
                        position=1,
                    )
            lost = _indexed_beyond(src, good)
            kept_snapshots = _copy_snapshots(src, dst, versions, path)
            streams = {as_text(stream): version for stream, version in versions.items()}
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
        streams=streams,
        lost_events=lost,
        prefix_ends=stop or "at the end of the readable log",
        snapshots_kept=kept_snapshots,
    )
    log.warning(
        "store.salvaged",
        file=path,
        reason=report.reason,
        last_good_position=good,
        streams=streams,
        lost_events=lost,
        prefix_ends=report.prefix_ends,
        damaged_copy=damaged,
        snapshots_kept=kept_snapshots,
    )
    return report


def _log_start_of(src: sqlite3.Connection, path: str) -> LogStart | None:
    """Where the damaged log starts. A file whose header SQLite cannot read counts as never
    compacted: then no event can be placed at position 1 either, and the salvage refuses."""
    try:
        return read_log_start(src)
    except CorruptLogError as e:
        raise CorruptLogError(f"{path}: {e}. The file is untouched", path=path) from None
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
        return None


def _copy_prefix(
    src: sqlite3.Connection, dst: sqlite3.Connection, through: int | None, start: LogStart | None
) -> tuple[int, dict[bytes, int], str | None]:
    """Copy events s+1..k from src to dst for the largest intact k (at most `through`), s the
    last position a compaction dropped (`start`; 0 if none). Returns k, each stream's last
    version, and why the copy stopped before the end (None if it reached the end of the
    readable log)."""
    good, versions = _bases(start)
    insert = f"INSERT INTO events ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
    scan = f"SELECT {COLUMNS} FROM events WHERE position > ? ORDER BY position"
    point = f"SELECT {COLUMNS} FROM events WHERE position = ?"

    def take(row: tuple[Any, ...]) -> str | None:
        nonlocal good
        problem = _row_problem(row, good + 1, versions)
        if problem is None:
            # Intact, so its text is valid UTF-8: store it as text again.
            dst.execute(insert, (row[0], row[1].decode(), row[2], row[3].decode(), *row[4:]))
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


def _intact_from(src: sqlite3.Connection, start: int) -> int | None:
    """The position of some readable event with a valid CRC at or after `start`, or None.
    Looks where the (stream, version) index says events are, at the end of the table, and at
    doubling distances from `start`: a damaged page hides the rows on it, not the others."""
    candidates: list[int] = []
    try:
        for (position,) in src.execute(
            f"SELECT position FROM events INDEXED BY {STREAM_INDEX} WHERE position >= ? LIMIT 10000", (start,)
        ):
            candidates.append(position)
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
    try:
        for row in src.execute(f"SELECT {COLUMNS} FROM events WHERE position >= ? ORDER BY position DESC", (start,)):
            if row_intact(row):
                return row[0]
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
    candidates.extend(range(start, start + 256))
    candidates.extend(start + (1 << i) for i in range(8, 63))
    for position in sorted(set(candidates)):
        try:
            rows = src.execute(
                f"SELECT {COLUMNS} FROM events WHERE position >= ? ORDER BY position LIMIT 1", (position,)
            ).fetchall()
        except sqlite3.DatabaseError as e:
            if not is_corruption(e):
                raise
            continue
        if not rows:
            if position > start + 256:
                break  # past the end of the readable table
            continue
        if row_intact(rows[0]):
            return rows[0][0]
    return None


def _indexed_beyond(src: sqlite3.Connection, good: int) -> int | None:
    """How many events the damaged file's index knows of after position `good` (None if the
    index cannot be read)."""
    try:
        row = src.execute(
            f"SELECT count(*) FROM events INDEXED BY {STREAM_INDEX} WHERE position > ?", (good,)
        ).fetchone()
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
        return None
    return row[0]


def _copy_snapshots(src: sqlite3.Connection, dst: sqlite3.Connection, versions: dict[bytes, int], path: str) -> int:
    kept = 0
    try:
        rows = src.execute("SELECT stream, version, data, recorded_at, crc FROM snapshots").fetchall()
    except sqlite3.DatabaseError as e:
        if not is_corruption(e):
            raise
        log.warning("store.snapshots_unreadable", file=path, reason=f"{e}; the salvaged log starts without snapshots")
        return 0
    for stream, version, data, recorded_at, crc in rows:
        if snapshot_intact(stream, version, data, recorded_at, crc) and version <= versions.get(stream, 0):
            dst.execute(
                "INSERT INTO snapshots (stream, version, data, recorded_at, crc) VALUES (?, ?, ?, ?, ?)",
                (stream.decode(), version, data, recorded_at, crc),
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
        if os.path.getsize(path + "-wal") > 0:
            os.replace(path + "-wal", damaged + "-wal")  # SQLite opens `<damaged>` with it
        else:
            os.remove(path + "-wal")
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
