"""Compaction of the SQLite log: the oldest events that a snapshot covers are deleted, and the
log_start row says where the retained log starts. Everything here runs inside the caller's
write transaction, so a crash leaves the log as it was before or as it is after, never between.

Only a prefix of the log is dropped, up to an intact snapshot (the cut): the state there is the
snapshot, so replay (snapshot + the facts after it) needs nothing that was dropped. Deleted
pages go to SQLite's free list and later appends reuse them: the file stops growing at about
the budget, but does not shrink (`SQLiteRecorder.vacuum` rewrites it). See docs/store.md.
"""

from __future__ import annotations

import sqlite3

from dynaresized.store.layout import (
    COMPACTED_SCHEMA_VERSION,
    LOG_START_SCHEMA,
    as_text,
    log_start_crc,
    log_start_intact,
    snapshot_intact,
)
from dynaresized.store.recorder import Compaction, CorruptLogError, LogStart, check_cut, plan_cut


def read_log_start(conn: sqlite3.Connection) -> LogStart | None:
    """The log_start row of a compacted log, or None for a log never compacted. Raises
    CorruptLogError (without the file's name) if the row is damaged."""
    if conn.execute("PRAGMA user_version").fetchone()[0] < COMPACTED_SCHEMA_VERSION:
        return None
    table = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'log_start'").fetchone()
    rows = [] if not table[0] else conn.execute(
        "SELECT stream, version, position, compacted_at, crc FROM log_start").fetchall()
    if len(rows) != 1 or not log_start_intact(*rows[0]):
        raise CorruptLogError(
            f"the log was compacted, but its log_start record is {'damaged' if rows else 'missing'}: where the "
            "retained events start is unknown. Restore the log from a backup"
        )
    stream, version, position, compacted_at, _ = rows[0]
    return LogStart(stream=as_text(stream), version=version, position=position, compacted_at=compacted_at)


def bytes_in_use(conn: sqlite3.Connection) -> int:
    """The bytes of the database's pages that hold something (the rest are on the free list)."""
    pages = conn.execute("PRAGMA page_count").fetchone()[0] - conn.execute("PRAGMA freelist_count").fetchone()[0]
    return int(pages * conn.execute("PRAGMA page_size").fetchone()[0])


class DamagedCut(Exception):
    """The snapshot at the chosen cut fails its CRC: compacting there would lose the state."""


def compact_log(conn: sqlite3.Connection, stream: str, start: LogStart | None, base: int, *,
                recorded_before: float | None, max_bytes: int | None, max_events: int | None,
                now: float) -> Compaction:
    """Inside the caller's write transaction: drop the events of the log up to the newest
    snapshot of `stream` whose last event was recorded before `recorded_before`, then up to
    later snapshots one at a time while the database's pages in use exceed `max_bytes`, at most
    `max_events` events (`recorder.plan_cut`). `base` is the stream's version at `start` (0:
    never compacted). Raises DamagedCut (the caller rolls back) if the snapshot at the cut is
    damaged, ValueError if events of other streams lie before the cut."""
    cuts = [v for (v,) in conn.execute(
        "SELECT version FROM snapshots WHERE stream = ? AND version > ? "
        "AND version <= (SELECT max(version) FROM events WHERE stream = ?) ORDER BY version", (stream, base, stream))]
    aged = base
    if recorded_before is not None:
        # The event at a snapshot's version is the last one it covers; the (stream, version)
        # index finds it for each snapshot.
        aged = conn.execute(
            "SELECT max(s.version) FROM snapshots s JOIN events e ON e.stream = s.stream AND e.version = s.version "
            "WHERE s.stream = ? AND s.version > ? AND e.recorded_at < ?", (stream, base, recorded_before),
        ).fetchone()[0] or base
    dropped_events = dropped_snapshots = 0
    new_start = start

    def drop_through(version: int) -> None:
        nonlocal dropped_events, dropped_snapshots, new_start
        if version <= (base if new_start is None else new_start.version):
            return
        position = conn.execute("SELECT position FROM events WHERE stream = ? AND version = ?",
                                (stream, version)).fetchone()[0]
        check_cut(stream, new_start, version, position)
        # A range of rowids: SQLite walks it once, freeing whole pages of the table and its index.
        dropped_events += conn.execute("DELETE FROM events WHERE position <= ?", (position,)).rowcount
        dropped_snapshots += conn.execute("DELETE FROM snapshots WHERE stream = ? AND version < ?",
                                          (stream, version)).rowcount
        new_start = LogStart(stream=stream, version=version, position=position, compacted_at=now)

    def over_budget(cut: int) -> bool:  # measured: the pages a deletion frees depend on the rows' layout
        drop_through(cut)
        return max_bytes is not None and bytes_in_use(conn) > max_bytes

    cut, behind = plan_cut(cuts, base, aged=aged, max_events=max_events, over_budget=over_budget)
    drop_through(cut)
    size = bytes_in_use(conn)
    if new_start is not start:
        snapshot = conn.execute("SELECT stream, version, data, recorded_at, crc FROM snapshots "
                                "WHERE stream = ? AND version = ?", (stream, cut)).fetchone()
        if not snapshot_intact(*snapshot):
            raise DamagedCut(f"the snapshot of stream {stream!r} at version {cut} fails its CRC32 check")
        assert new_start is not None
        write_log_start(conn, new_start)
    return Compaction(start=new_start, dropped_events=dropped_events, dropped_snapshots=dropped_snapshots,
                      bytes_in_use=size, over_budget=max_bytes is not None and size > max_bytes, behind=behind)


def write_log_start(conn: sqlite3.Connection, start: LogStart) -> None:
    """Record where the log starts (creating the table and marking the schema on the first
    compaction), inside the caller's transaction."""
    conn.execute(LOG_START_SCHEMA)
    conn.execute("DELETE FROM log_start")
    conn.execute(
        "INSERT INTO log_start (stream, version, position, compacted_at, crc) VALUES (?, ?, ?, ?, ?)",
        (start.stream, start.version, start.position, start.compacted_at,
         log_start_crc(start.stream.encode(), start.version, start.position, start.compacted_at)),
    )
    conn.execute(f"PRAGMA user_version = {COMPACTED_SCHEMA_VERSION}")
