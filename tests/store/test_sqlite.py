"""What only the SQLite recorder does: durability settings, one writer, read-only readers,
CRC checks, snapshots as a cache, salvage, and the operator commands."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from dynaresized.store import CorruptLogError, SQLiteRecorder, StoreLockedError, salvage
from dynaresized.store.layout import APPLICATION_ID, event_crc


def fill(path: Path, n: int, *, stream: str = "cluster") -> None:
    with SQLiteRecorder(path) as r:
        r.append(stream, 0, [("fact", f"event {i}".encode()) for i in range(1, n + 1)])


def rot(path: Path, position: int) -> None:
    """Change an event's bytes behind the store's back, as bit rot would (the CRC stays)."""
    conn = sqlite3.connect(path)
    (data,) = conn.execute("SELECT data FROM events WHERE position = ?", (position,)).fetchone()
    conn.execute("UPDATE events SET data = ? WHERE position = ?", (bytes([data[0] ^ 0x20]) + data[1:], position))
    conn.commit()
    conn.close()


def test_events_and_snapshots_outlive_the_recorder(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as r:
        r.append("s", 0, [("t", b"1"), ("t", b"2")])
        r.save_snapshot("s", 2, b"state")
    with SQLiteRecorder(path) as again:
        assert [e.data for e in again.read("s")] == [b"1", b"2"]
        assert again.load_snapshot("s") == (2, b"state")
        assert again.append("s", 2, [("t", b"3")]) == 3
    assert not (tmp_path / "events.sqlite-wal").exists()  # a clean close checkpoints the WAL away


def test_wal_mode_and_full_sync(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as r:
        r.append("s", 0, [("t", b"")])
        assert r._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        other = sqlite3.connect(path)
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert other.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        other.close()


def test_one_writer_per_file(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    first = SQLiteRecorder(path)
    with pytest.raises(StoreLockedError, match=rf"already open for writing \(pid {os.getpid()}"):
        SQLiteRecorder(path)
    first.close()
    SQLiteRecorder(path).close()  # free again


def test_a_reader_follows_a_live_writer_and_cannot_write(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as writer, SQLiteRecorder(path, read_only=True) as reader:
        writer.append("s", 0, [("t", b"1")])
        assert [e.data for e in reader.read_all()] == [b"1"]
        writer.append("s", 1, [("t", b"2")])
        assert [e.data for e in reader.read_all(after_position=1)] == [b"2"]
        with pytest.raises(PermissionError, match="read-only"):
            reader.append("s", 2, [("t", b"3")])
        with pytest.raises(PermissionError, match="read-only"):
            reader.save_snapshot("s", 1, b"")


def test_a_reader_needs_a_log_and_a_writer_its_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no event log at"):
        SQLiteRecorder(tmp_path / "missing.sqlite", read_only=True)
    assert not (tmp_path / "missing.sqlite").exists()
    with pytest.raises(FileNotFoundError, match=r"no directory .*/nowhere for the event log"):
        SQLiteRecorder(tmp_path / "nowhere" / "events.sqlite")


def test_another_applications_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(ValueError, match=r"is not a dynaresized event log .*\['users'\]"):
        SQLiteRecorder(path)
    with pytest.raises(ValueError, match="is not a dynaresized event log"):
        SQLiteRecorder(path, read_only=True)


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    fill(path, 1)
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(ValueError, match="written by a newer dynaresized"):
        SQLiteRecorder(path)


def test_a_file_that_is_not_sqlite_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    before = path.read_bytes()
    with pytest.raises(CorruptLogError, match="no event could be read") as info:
        SQLiteRecorder(path)
    assert info.value.path == str(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.sqlite", "events.sqlite.lock"]


def test_a_rotten_event_in_the_middle_is_reported_never_dropped(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    fill(path, 400)
    rot(path, 20)
    # With a tail of 100 events, position 20 is in the middle of the log. Opening checks
    # only the tail, so the damage is found when it is read.
    with SQLiteRecorder(path, tail_window=100) as r:
        events = r.read("cluster")
        for _ in range(19):
            next(events)
        damaged = r"position 20 \(stream 'cluster', version 20\) fails its CRC32"
        with pytest.raises(CorruptLogError, match=damaged) as info:
            next(events)
        assert info.value.position == 20 and info.value.path == str(path)
        with pytest.raises(CorruptLogError, match="position 20"):
            list(r.read_all(after_position=10))
        assert [e.position for e in r.read_all(after_position=20)][:1] == [21]
        with pytest.raises(CorruptLogError, match="position 20"):
            r.check()
    before = path.read_bytes()
    # A writer asked to verify everything finds it too, and will not cut the log there.
    with pytest.raises(CorruptLogError, match=r"the damage is in the middle of the log.*--through 19"):
        SQLiteRecorder(path, verify="full", tail_window=100)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob("*.corrupt-*"))


def test_a_rotten_last_event_is_salvaged_and_the_damaged_file_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    fill(path, 50)
    rot(path, 50)
    damaged_bytes = path.read_bytes()
    with capture_logs() as logs, SQLiteRecorder(path) as r:
        assert [e.version for e in r.read("cluster")] == list(range(1, 50))
        assert r.append("cluster", 49, [("fact", b"after recovery")]) == 50
    salvaged = [e for e in logs if e["event"] == "store.salvaged"]
    assert len(salvaged) == 1 and salvaged[0]["log_level"] == "warning"
    assert salvaged[0]["file"] == str(path)
    assert salvaged[0]["last_good_position"] == 49
    assert "position 50" in salvaged[0]["reason"] and "CRC32" in salvaged[0]["reason"]
    (copy,) = tmp_path.glob("events.sqlite.corrupt-*")
    assert salvaged[0]["damaged_copy"] == str(copy)
    assert copy.read_bytes() == damaged_bytes


def test_the_operator_may_cut_the_log_deliberately(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    fill(path, 50)
    rot(path, 20)
    with pytest.raises(CorruptLogError, match="cannot keep events through position 30"):
        salvage(path, reason="operator", through=30)
    report = salvage(path, reason="operator", through=19)
    assert report.last_good_position == 19 and report.streams == {"cluster": 19}
    assert report.lost_events == 31
    with SQLiteRecorder(path) as r:
        assert [e.data for e in r.read("cluster")] == [f"event {i}".encode() for i in range(1, 20)]
        assert r.check().events == 19


def test_snapshots_are_a_cache_a_damaged_one_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as r:
        r.append("s", 0, [("t", b"")] * 30)
        for v in (10, 20, 30):
            r.save_snapshot("s", v, f"state at {v}".encode())
    conn = sqlite3.connect(path)
    conn.execute("UPDATE snapshots SET data = x'00' WHERE version = 30")
    conn.commit()
    conn.close()
    with capture_logs() as logs, SQLiteRecorder(path) as r:
        assert r.load_snapshot("s") == (20, b"state at 20")
        check = r.check()
    assert (check.snapshots, check.damaged_snapshots) == (3, 1)
    assert [(e["event"], e["version"]) for e in logs] == [("store.snapshot_damaged", 30)]


def test_check_counts_a_healthy_log(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as r:
        r.append("a", 0, [("t", b"")] * 3)
        r.append("b", 0, [("t", b"")] * 2)
        r.save_snapshot("a", 3, b"")
    with SQLiteRecorder(path, read_only=True) as reader:
        check = reader.check()
    assert (check.events, check.streams, check.snapshots, check.damaged_snapshots) == (5, {"a": 3, "b": 2}, 1, 0)


def run_store_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynaresized.store", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_operator_commands_check_and_salvage(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    fill(path, 30)
    ok = run_store_command("check", str(path))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["events"] == 30
    rot(path, 10)
    bad = run_store_command("check", str(path))
    assert bad.returncode == 1
    assert "position 10" in bad.stderr and "fails its CRC32 check" in bad.stderr
    cut = run_store_command("salvage", str(path), "--through", "9")
    assert cut.returncode == 0, cut.stderr
    report = json.loads(cut.stdout)
    assert report["last_good_position"] == 9 and Path(report["damaged_copy"]).exists()
    assert json.loads(run_store_command("check", str(path)).stdout)["events"] == 9
    with SQLiteRecorder(path):
        locked = run_store_command("salvage", str(path), "--through", "5")
    assert locked.returncode == 1 and "already open for writing" in locked.stderr


def test_salvage_reads_the_wal_and_keeps_it_with_the_damaged_copy(tmp_path: Path) -> None:
    """A crash image: the last events are only in the WAL, and the last one is damaged."""
    live = tmp_path / "live.sqlite"
    fill(live, 20)
    writer = SQLiteRecorder(live)
    writer.append("cluster", 20, [("fact", f"event {i}".encode()) for i in range(21, 31)])
    raw = sqlite3.connect(live)  # damage event 30 behind the store's back, still in the WAL
    raw.execute("UPDATE events SET data = ? WHERE position = 30", (b"EVENT 30",))
    raw.commit()
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal"):  # the files as a crash would leave them: nothing checkpointed
        shutil.copyfile(f"{live}{suffix}", crashed / f"events.sqlite{suffix}")
    raw.close()
    writer.close()
    path = crashed / "events.sqlite"
    with capture_logs() as logs, SQLiteRecorder(path) as r:
        assert [e.data for e in r.read("cluster")] == [f"event {i}".encode() for i in range(1, 30)]
    (salvaged,) = [e for e in logs if e["event"] == "store.salvaged"]
    assert salvaged["last_good_position"] == 29 and "position 30" in salvaged["prefix_ends"]
    damaged = Path(salvaged["damaged_copy"])
    assert Path(f"{damaged}-wal").stat().st_size > 0
    forensics = sqlite3.connect(f"file:{damaged}?mode=ro", uri=True)  # the copy still opens, WAL and all
    assert forensics.execute("SELECT count(*) FROM events").fetchone()[0] == 30
    forensics.close()


def test_a_damaged_index_page_never_hides_events_from_a_read(tmp_path: Path) -> None:
    """Cut the cell count of a page in the middle of the (stream, version) index: SQLite reads
    it without complaint, but a read by stream must notice the events it no longer sees."""
    path = tmp_path / "events.sqlite"
    fill(path, 3000)
    conn = sqlite3.connect(path)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'sqlite_autoindex_events_1'").fetchone()
    conn.close()
    data = bytearray(path.read_bytes())
    page = data[(root - 1) * page_size : root * page_size]
    assert page[0] == 0x02, "the index root is an interior page"
    cells = int.from_bytes(page[3:5], "big")
    middle = int.from_bytes(page[8 + 4 + 2 * (cells // 2) : 8 + 4 + 2 * (cells // 2) + 2], "big")
    child = int.from_bytes(page[middle : middle + 4], "big")  # a leaf in the middle of the index
    leaf = (child - 1) * page_size
    assert data[leaf] == 0x0A, "an index leaf page"
    data[leaf + 3 : leaf + 5] = (3).to_bytes(2, "big")  # the leaf now "holds" 3 entries
    path.write_bytes(bytes(data))
    # A reader does not check the file when it opens it; it finds out when it reads.
    with SQLiteRecorder(path, read_only=True) as reader:
        with pytest.raises(CorruptLogError, match=r"jumps from version \d+ to \d+|stops at version"):
            list(reader.read("cluster"))
        assert [e.position for e in reader.read_all()] == list(range(1, 3001))  # the table itself is whole
    # A writer checks the index when it opens the log, and rebuilds it: no event is lost.
    with capture_logs() as logs, SQLiteRecorder(path) as writer:
        assert [e.data for e in writer.read("cluster")] == [f"event {i}".encode() for i in range(1, 3001)]
    (salvaged,) = [e for e in logs if e["event"] == "store.salvaged"]
    assert salvaged["last_good_position"] == 3000 and salvaged["lost_events"] == 0


@pytest.mark.parametrize("max_rows", [256, 4, 1])
def test_appends_of_any_size_write_every_row_with_its_crc(tmp_path: Path, max_rows: int) -> None:
    """Appends go in multi-row INSERTs of power-of-two sizes; every row is the one a row-by-row
    insert would have written: position, version, columns and the CRC32 docs/store.md describes."""
    path = tmp_path / "events.sqlite"
    sizes = [1, 2, 255, 256, 257, 600, 3]
    with SQLiteRecorder(path, clock=lambda: 1_700_000_000.25) as r:
        r._max_insert_rows = max_rows
        version = 0
        for n in sizes:
            batch = [(f"type-{i % 3}-é", f"event {version + i}".encode()) for i in range(n)]
            version = r.append("strëam", version, batch)
        r.append("other", 0, [("t", bytearray(b"x")), ("t", memoryview(b"y"))])
    total = sum(sizes)
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT position, stream, version, type, data, recorded_at, crc FROM events "
                        "ORDER BY position").fetchall()
    conn.close()
    assert [row[0] for row in rows] == list(range(1, total + 3))
    assert [row[2] for row in rows[:total]] == list(range(1, total + 1))
    for position, stream, version, kind, data, recorded_at, crc in rows:
        assert crc == event_crc(position, stream, version, kind, data, recorded_at)
    assert rows[0][1:5] == ("strëam", 1, "type-0-é", b"event 0")
    assert [row[4] for row in rows[total:]] == [b"x", b"y"]
    with SQLiteRecorder(path, verify="full") as again:
        assert [e.data for e in again.read("strëam")] == [f"event {i}".encode() for i in range(total)]
        assert again.check().events == total + 2


@pytest.fixture
def widest_umask() -> Any:
    """Whoever starts the daemon, with whatever umask: the widest one."""
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_log_its_wal_shm_and_lock_are_born_0640_under_any_umask(tmp_path: Path, widest_umask: Any) -> None:
    path = tmp_path / "events.sqlite"
    with SQLiteRecorder(path) as r:
        r.append("s", 0, [("t", b"1")])
        files = [path, tmp_path / "events.sqlite-wal", tmp_path / "events.sqlite-shm", tmp_path / "events.sqlite.lock"]
        assert {f.name: _mode(f) for f in files} == {f.name: 0o640 for f in files}


def test_a_log_left_readable_by_an_older_version_is_tightened_on_open(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    fill(path, 2)
    for leftover in (path, Path(f"{path}.lock")):
        os.chmod(leftover, 0o644)
    with SQLiteRecorder(path) as r:
        assert len(list(r.read_all())) == 2
        assert _mode(path) == _mode(Path(f"{path}.lock")) == _mode(Path(f"{path}-wal")) == 0o640
