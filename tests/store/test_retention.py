"""Retention: compaction keeps the log within its bounds and changes nothing a reader of the
state can see. Replay after compaction is byte for byte the fold of every fact ever appended;
a crash inside a compaction leaves the old log or the new one; the bounds on age and size hold
compaction after compaction; a compacted log still checks, recovers and reads."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

from dynaresized.core.facts import Fact
from dynaresized.core.state import encode_state
from dynaresized.store import (
    CompactedError,
    CorruptLogError,
    FactLog,
    InMemoryRecorder,
    Recorder,
    Retention,
    SQLiteRecorder,
    salvage,
)
from dynaresized.store import compaction as compaction_module
from dynaresized.store.layout import CHUNK
from dynaresized.store.sqlite import WAL_SIZE_LIMIT
from tests.store.conftest import FakeClock, RecorderFactory
from tests.store.test_factlog import Cluster, _facts
from tests.store.test_sqlite import rot

DROP_ALL_COVERED = Retention(max_age_s=0, max_bytes=1)  # every compaction cuts at the newest snapshot


class TwinLog(FactLog):
    """A fact log that also appends every fact to `whole`, a log that keeps them all."""

    def __init__(self, recorder: Recorder, whole: FactLog, **kw: object) -> None:
        super().__init__(recorder, **kw)  # type: ignore[arg-type]
        self.whole = whole

    def append(self, facts: Sequence[Fact]) -> None:
        super().append(facts)
        self.whole.append(facts)


def full_fold(recorder: Recorder) -> bytes:
    return encode_state(FactLog(recorder).replay(use_snapshot=False))


def test_replay_after_compaction_is_the_fold_of_every_fact(make_recorder: RecorderFactory, tmp_path: Path) -> None:
    whole = SQLiteRecorder(tmp_path / "whole.sqlite")
    recorder = make_recorder()
    cluster = Cluster(TwinLog(recorder, FactLog(whole), snapshot_every=7, retention=DROP_ALL_COVERED))
    cluster.start()
    cluster.run_steps(6, rollout_s=255, train_s=100)
    cluster.run_steps(8, rollout_s=80, train_s=200)
    start = recorder.log_start()
    assert start is not None and start.version > 100, "the log was compacted as it went"
    assert start.version == recorder.load_snapshot("cluster")[0]  # type: ignore[index]
    everything = full_fold(whole)
    assert encode_state(FactLog(recorder).replay()) == everything
    assert full_fold(recorder) == everything  # from the snapshot at the log's start
    assert FactLog(recorder).replay().durable() == cluster.state.durable()
    if make_recorder.kind == "sqlite":
        recorder.close()
        reopened = make_recorder()
        assert encode_state(FactLog(reopened).replay()) == everything
        assert reopened.check().start == start  # type: ignore[attr-defined]
    whole.close()


def test_the_daemon_s_compaction_changes_no_replay(tmp_path: Path) -> None:
    """A log written without retention, then compacted: state before == state after, bytes."""
    recorder = SQLiteRecorder(tmp_path / "events.sqlite")
    cluster = Cluster(FactLog(recorder, snapshot_every=7))
    cluster.start()
    cluster.run_steps(8, rollout_s=255, train_s=100)
    before, latest = full_fold(recorder), encode_state(FactLog(recorder).replay())
    assert before == latest
    done = FactLog(recorder, retention=DROP_ALL_COVERED).compact(now_wall_s=0)
    assert done.dropped_events > 0 and done.start == recorder.log_start()
    assert encode_state(FactLog(recorder).replay()) == before
    assert full_fold(recorder) == before
    assert recorder.check().events == cluster.state.version - done.start.version  # type: ignore[union-attr]
    recorder.close()


def test_a_failure_inside_the_compaction_leaves_the_log_as_it_was(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "events.sqlite"
    recorder = SQLiteRecorder(path)
    cluster = Cluster(FactLog(recorder, snapshot_every=7))
    cluster.start()
    cluster.run_steps(4, rollout_s=255, train_s=100)
    before = full_fold(recorder)
    events, snapshots = recorder.check().events, recorder.check().snapshots

    def fail(*args: object) -> None:
        raise RuntimeError("injected: the compaction fails after its deletes, before its commit")

    monkeypatch.setattr(compaction_module, "write_log_start", fail)
    with pytest.raises(RuntimeError, match="injected"):
        FactLog(recorder, retention=DROP_ALL_COVERED).compact(now_wall_s=0)
    assert recorder.log_start() is None
    assert (recorder.check().events, recorder.check().snapshots) == (events, snapshots)
    assert [e.position for e in recorder.read_all()] == list(range(1, events + 1))
    assert full_fold(recorder) == before
    monkeypatch.undo()
    assert FactLog(recorder, retention=DROP_ALL_COVERED).compact(now_wall_s=0).dropped_events > 0
    assert full_fold(recorder) == before
    recorder.close()


KILLED_MID_COMPACTION = textwrap.dedent(
    """
    import os, signal, sys
    sys.path[:0] = [{root!r}]
    from dynaresized.store import FactLog, Retention, SQLiteRecorder
    from dynaresized.store import compaction
    recorder = SQLiteRecorder(sys.argv[1])
    recorder._conn.execute("PRAGMA cache_size = 2")  # spill the deletes' pages to the WAL uncommitted
    # The deletes are done, the log_start row not yet written, nothing committed: die here.
    compaction.write_log_start = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    FactLog(recorder, retention=Retention(max_age_s=0, max_bytes=1)).compact(0.0)
    print("not killed", flush=True)
    """
)


def test_sigkill_inside_the_compaction_leaves_the_old_log(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as recorder:
        cluster = Cluster(FactLog(recorder, snapshot_every=7))
        cluster.start()
        cluster.run_steps(6, rollout_s=255, train_s=100)
        before = full_fold(recorder)
        events = recorder.last_position()
    root = str(Path(__file__).resolve().parents[2])
    child = subprocess.run([sys.executable, "-c", KILLED_MID_COMPACTION.format(root=root), str(path)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert os.path.getsize(str(path) + "-wal") > 0, "the child wrote its deletes to the WAL before it died"
    with SQLiteRecorder(path) as recorder:  # as the restarted daemon opens it
        assert recorder.log_start() is None
        assert [e.position for e in recorder.read_all()] == list(range(1, events + 1))
        assert recorder.check().events == events
        assert full_fold(recorder) == before
        done = FactLog(recorder, retention=DROP_ALL_COVERED).compact(now_wall_s=0)
        assert done.dropped_events > 0
    with SQLiteRecorder(path) as recorder:
        assert recorder.log_start() == done.start
        assert full_fold(recorder) == encode_state(FactLog(recorder).replay()) == before


def test_the_bounds_hold_compaction_after_compaction(tmp_path: Path, clock: FakeClock) -> None:
    """Batches of 100 events, a snapshot after each and the daemon's compaction: first large
    events (the size bound decides), then small ones (the age bound does)."""
    path = tmp_path / "events.sqlite"
    retention = Retention(max_age_s=200, max_bytes=1 << 20)
    recorder = SQLiteRecorder(path, clock=clock)
    batch_s, version = 10.0, 0
    largest = 100 * (1000 + 64)  # the bytes of a batch of large events, with SQLite's overhead
    for n in range(120):
        size = 1000 if n < 60 else 20
        version = recorder.append("cluster", version, [("fact", bytes([n]) * size)] * 100)
        recorder.save_snapshot("cluster", version, b"state" * 400)
        clock.now += batch_s
        done = recorder.compact("cluster", recorded_before=retention.recorded_before(clock.now),
                                max_bytes=retention.max_bytes)
        assert not done.over_budget and done.bytes_in_use <= retention.max_bytes
        # The file grows by at most what is written between two compactions: freed pages are reused.
        assert os.path.getsize(path) <= retention.max_bytes + 2 * largest + 64 * 1024
        assert os.path.getsize(str(path) + "-wal") <= WAL_SIZE_LIMIT
        first = next(recorder.read_all())
        # Nothing older than the age bound stays, but for the snapshot interval after the cut.
        assert first.recorded_at >= clock.now - retention.max_age_s - batch_s
        if n >= 80:  # small events only: the age bound keeps 20 batches (40 KB), far under the size bound
            assert done.start is not None and version - done.start.version == 2000
            assert first.recorded_at == clock.now - retention.max_age_s
        elif 20 <= n < 60:  # large events: the size bound keeps fewer than the age bound would
            assert done.start is not None and version - done.start.version < 2000
    assert recorder.check().events == 2000
    recorder.close()


def test_a_compacted_log_recovers_a_damaged_tail_and_keeps_its_start(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as recorder:
        factlog = FactLog(recorder, snapshot_every=10, retention=DROP_ALL_COVERED)
        for n in range(1, 36):
            factlog.append(list(_facts(1)))
            factlog.maybe_snapshot(factlog.replay())
        start = recorder.log_start()
    assert start is not None and (start.version, start.position) == (30, 30)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2  # older code refuses it
    rot(path, 35)
    with SQLiteRecorder(path) as recorder:  # salvaged: events 31..34 kept, the start with them
        assert recorder.log_start() == start
        assert [e.version for e in recorder.read("cluster", after_version=30)] == [31, 32, 33, 34]
        assert FactLog(recorder).replay().version == 34
    assert list(tmp_path.glob("events.sqlite.corrupt-*"))
    with pytest.raises(CorruptLogError, match="the log was compacted, its first event is at position 31"):
        salvage(path, reason="operator", through=20)


def test_a_read_across_a_compaction_says_so(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    writer = SQLiteRecorder(path)
    writer.append("cluster", 0, [("t", b"")] * (2 * CHUNK + 100))
    writer.save_snapshot("cluster", 2 * CHUNK, b"state")
    reader = SQLiteRecorder(path, read_only=True)  # another process: `dynaresized events --follow`
    everything, stream = reader.read_all(), reader.read("cluster")
    assert next(everything).position == 1 and next(stream).version == 1  # the first chunks are read
    writer.compact("cluster", max_bytes=0)
    with pytest.raises(CompactedError, match=r"was compacted while it was read \(the log now starts after position"):
        list(everything)
    with pytest.raises(CompactedError, match="was compacted while it was read"):
        list(stream)
    assert [e.position for e in reader.read_all()][:1] == [2 * CHUNK + 1]  # a new read: the retained log
    with pytest.raises(CompactedError, match=r"versions 1\.\.4096"):
        reader.read("cluster")
    reader.close()
    writer.close()


def test_without_a_usable_snapshot_at_its_start_a_compacted_log_cannot_be_replayed() -> None:
    recorder = InMemoryRecorder()
    factlog = FactLog(recorder, retention=DROP_ALL_COVERED)
    factlog.append(list(_facts(10)))
    recorder.save_snapshot("cluster", 10, b"\xc1 not a state")
    factlog.compact(now_wall_s=0)
    with pytest.raises(CorruptLogError, match="compacted through version 10, and its snapshot there"):
        FactLog(recorder).replay()
    with pytest.raises(ValueError, match="no retention"):
        FactLog(recorder).compact(now_wall_s=0)
