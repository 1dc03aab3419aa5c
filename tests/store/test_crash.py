"""Crash consistency of the SQLite recorder, on real files.

Whatever happens to the end of the log — a process killed mid-append, a write-ahead log cut
short or damaged, a database file whose last pages are cut or overwritten — reopening gives
events 1..k of the stream with no gaps and every event's bytes intact, with k at least what
had been acknowledged as durable where that survives; or, where damage leaves intact events
after it, a CorruptLogError naming the file, with the file untouched. Never a silent hole.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dynaresized.store import CorruptLogError, SQLiteRecorder

STREAM = "cluster"


def payload(version: int) -> bytes:
    """The bytes of event `version`: deterministic, 32 B to 1.3 KB, and every 17th spans
    several pages (SQLite overflow pages)."""
    size = 6000 if version % 17 == 0 else 32 * (1 + version % 40)
    seed = hashlib.sha256(f"event {version}".encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def append_batches(recorder: SQLiteRecorder, rng: random.Random, batches: int, largest: int = 3) -> list[int]:
    """Append `batches` batches of 1..`largest` events; the stream version after each."""
    versions = []
    v = recorder.last_version(STREAM)
    for _ in range(batches):
        size = rng.randint(1, largest)
        v = recorder.append(STREAM, v, [("fact", payload(v + i)) for i in range(1, size + 1)])
        versions.append(v)
    return versions


def consistent_prefix(path: Path, *, at_least: int, at_most: int) -> int:
    """Open the log as the daemon would; check it holds events 1..k of the stream, intact,
    with at_least <= k <= at_most, and passes a full check. Returns k."""
    with SQLiteRecorder(path) as r:
        events = list(r.read(STREAM))
        k = len(events)
        assert [e.version for e in events] == list(range(1, k + 1))
        assert [e.position for e in events] == list(range(1, k + 1))
        for e in events:
            assert e.data == payload(e.version), f"event {e.version} came back with other bytes"
        assert at_least <= k <= at_most, f"recovered {k} events, expected between {at_least} and {at_most}"
        assert r.check().events == k
    return k


# -- a real crash: SIGKILL a process that appends in a loop ------------------------------------------

CHILD = textwrap.dedent(
    """
    import random, sys
    sys.path[:0] = [{root!r}]
    from dynaresized.store import SQLiteRecorder
    from tests.store.test_crash import payload
    recorder = SQLiteRecorder(sys.argv[1])
    rng = random.Random(int(sys.argv[2]))
    v = recorder.last_version("cluster")
    print("ready", v, flush=True)
    while True:
        size = rng.randint(1, 4)
        v = recorder.append("cluster", v, [("fact", payload(v + i)) for i in range(1, size + 1)])
        print(v, flush=True)  # acknowledged: append() returned, so the events are durable
    """
)


def test_sigkill_during_appends_keeps_every_acknowledged_event(tmp_path: Path) -> None:
    path = tmp_path / "events.sqlite"
    root = str(Path(__file__).resolve().parents[2])
    rng = random.Random(20251)
    acked = 0
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(root=root), str(path), str(round_)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        assert child.stdout.readline().split() == ["ready", str(acked)]
        for _ in range(rng.randint(40, 200)):
            acked = int(child.stdout.readline())
        child.send_signal(signal.SIGKILL)  # mid-append, most likely: it appends in a tight loop
        for line in child.stdout:  # acknowledged before it died
            acked = int(line)
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        with capture_logs() as logs:
            # At most the batch in flight (<= 4 events) may have committed without its ack.
            acked = consistent_prefix(path, at_least=acked, at_most=acked + 4)
        assert not [e for e in logs if e["event"] == "store.salvaged"], "a killed process never damages the file"
    assert acked > 100


# -- the write-ahead log cut short or damaged ---------------------------------------------------------


class CrashImage:
    """A log as a crash leaves it: the database file and its WAL copied while the writer is
    open (every append fsynced, nothing checkpointed), with the WAL size after each append."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir()
        live = directory / "live.sqlite"
        recorder = SQLiteRecorder(live)
        self.commits: list[tuple[int, int]] = []  # (WAL size, stream version) after each append
        rng = random.Random(7)
        v = 0
        for _ in range(120):
            v = append_batches(recorder, rng, 1)[0]
            self.commits.append((os.path.getsize(str(live) + "-wal"), v))
        sizes = [size for size, _ in self.commits]
        assert sizes == sorted(set(sizes)), "the WAL was checkpointed during the setup; use fewer events"
        self.db = directory / "image.sqlite"
        self.wal = directory / "image.sqlite-wal"
        shutil.copyfile(live, self.db)
        shutil.copyfile(str(live) + "-wal", self.wal)
        recorder.close()
        self.total = v
        self.wal_size = sizes[-1]

    def restore(self, where: Path) -> tuple[Path, Path]:
        where.mkdir()
        db, wal = where / "events.sqlite", where / "events.sqlite-wal"
        shutil.copyfile(self.db, db)
        shutil.copyfile(self.wal, wal)
        return db, wal

    def committed_before(self, offset: int) -> int:
        """The stream version of the last append whose WAL frames all lie before `offset`."""
        return max((v for size, v in self.commits if size <= offset), default=0)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> CrashImage:
    return CrashImage(tmp_path_factory.mktemp("crash") / "image")


def wal_cuts(image: CrashImage) -> list[int]:
    rng = random.Random(99)
    boundaries = [size for size, _ in image.commits]
    cuts = [rng.randint(32, image.wal_size - 1) for _ in range(24)]
    cuts += [boundaries[60], boundaries[60] + 1, boundaries[60] - 1, image.wal_size - 1, image.wal_size, 16, 0]
    return cuts


def test_a_wal_cut_short_recovers_every_complete_commit(image: CrashImage, tmp_path: Path) -> None:
    boundaries = {size for size, _ in image.commits}
    for i, cut in enumerate(wal_cuts(image)):
        db, wal = image.restore(tmp_path / f"cut{i}")
        with open(wal, "r+b") as f:
            f.truncate(cut)
        expected = image.committed_before(cut)
        with capture_logs() as logs:
            k = consistent_prefix(db, at_least=expected, at_most=expected)
        discarded = [e for e in logs if e["event"] == "store.wal_tail_discarded"]
        if cut == 0 or cut in boundaries:
            assert discarded == [], f"cut at {cut} is a commit boundary: nothing was lost"
        else:
            assert len(discarded) == 1, f"cut at {cut} tore a transaction; it must be reported"
            assert discarded[0]["file"] == str(wal)
            assert discarded[0]["last_good_position"] == k
            assert discarded[0]["log_level"] == "warning"


def test_damaged_wal_bytes_lose_only_the_commits_from_the_damage_on(image: CrashImage, tmp_path: Path) -> None:
    rng = random.Random(5)
    frame = 24 + 4096
    for i in range(20):
        db, wal = image.restore(tmp_path / f"rot{i}")
        offset = rng.randint(image.wal_size // 2, image.wal_size - 1)
        length = rng.choice([1, 1, 8, 300])
        data = bytearray(wal.read_bytes())
        for j in range(offset, min(offset + length, len(data))):
            data[j] ^= rng.randint(1, 255)
        wal.write_bytes(bytes(data))
        frame_start = 32 + (offset - 32) // frame * frame
        expected = image.committed_before(frame_start)
        with capture_logs() as logs:
            k = consistent_prefix(db, at_least=expected, at_most=expected)
        discarded = [e for e in logs if e["event"] == "store.wal_tail_discarded"]
        assert len(discarded) == 1 and discarded[0]["last_good_position"] == k
        assert discarded[0]["discarded_bytes"] >= image.wal_size - frame_start - frame


# -- the database file's last pages cut or overwritten --------------------------------------------------


@pytest.fixture(scope="module")
def closed_log(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A cleanly closed log (everything checkpointed into the file), with snapshots."""
    path = tmp_path_factory.mktemp("closed") / "events.sqlite"
    rng = random.Random(3)
    with SQLiteRecorder(path, clock=lambda: 1_700_000_000.0) as r:
        for _ in range(6):
            v = append_batches(r, rng, 50, largest=8)[-1]
            r.save_snapshot(STREAM, v, payload(v) * 3)
        total = r.last_version(STREAM)
    assert not Path(str(path) + "-wal").exists()
    return path, total


def damage(data: bytes, rng: random.Random, start: int, end: int, kinds: tuple[str, ...] = ()) -> bytes:
    """The file from a random offset in [start, end) cut off or zeroed to the end (blocks a
    filesystem lost), or a stretch there overwritten with zeros or garbage."""
    size = len(data)
    at = rng.randint(start, end - 1)
    kind = rng.choice(kinds or ("truncate", "zero_to_end", "zeros", "garbage"))
    if kind == "truncate":
        return data[:at]
    if kind == "zero_to_end":
        return data[:at] + bytes(size - at)
    length = rng.choice([1, 16, 512, 4096, 3 * 4096])
    junk = bytes(length) if kind == "zeros" else rng.randbytes(length)
    return data[:at] + junk[: size - at] + data[at + length :]


def reopen_damaged(path: Path, damaged: bytes, total: int, tail_window: int) -> tuple[str, int]:
    """Open a damaged copy as the daemon would and check every promise; returns the outcome
    ("refused", "found_on_read", "unharmed", "salvaged") and the events the log kept."""
    path.parent.mkdir()
    path.write_bytes(damaged)
    try:
        with capture_logs() as logs:
            recorder = SQLiteRecorder(path, tail_window=tail_window)
    except CorruptLogError as e:
        assert str(path) in str(e)
        assert path.read_bytes() == damaged, "a refused file must be left untouched"
        assert not list(path.parent.glob("*.corrupt-*"))
        return "refused", -1
    salvaged = [e for e in logs if e["event"] == "store.salvaged"]
    try:
        events = list(recorder.read(STREAM))
    except CorruptLogError as e:
        # Damage the open-time check does not reach is found when read, never skipped.
        assert not salvaged, "a salvaged log must read back whole"
        assert str(path) in str(e)
        return "found_on_read", -1
    finally:
        recorder.close()
    k = len(events)
    assert [e.version for e in events] == list(range(1, k + 1))
    assert all(e.data == payload(e.version) for e in events)
    if not salvaged:
        assert k == total, "events went missing without a report"
        return "unharmed", k
    (copy,) = path.parent.glob("events.sqlite.corrupt-*")
    assert copy.read_bytes() == damaged
    assert salvaged[0]["file"] == str(path) and salvaged[0]["last_good_position"] == k
    assert salvaged[0]["log_level"] == "warning"
    with SQLiteRecorder(path) as again:
        assert again.check().events == k  # the salvaged file is whole
        assert again.append(STREAM, k, [("fact", payload(k + 1))]) == k + 1  # and writable
    return "salvaged", k


def test_a_damaged_file_tail_is_salvaged_to_an_intact_prefix(closed_log: tuple[Path, int], tmp_path: Path) -> None:
    source, total = closed_log
    original = source.read_bytes()
    rng = random.Random(11)
    # The last quarter of the file holds about the last quarter of the events, well inside
    # the tail window of 1,000.
    cases = [original[: len(original) - 4096]]  # the last page lost
    cases += [damage(original, rng, len(original) * 3 // 4, len(original)) for _ in range(24)]
    outcomes: Counter[str] = Counter()
    shortest = total
    for i, damaged in enumerate(cases):
        outcome, k = reopen_damaged(tmp_path / f"case{i}" / "events.sqlite", damaged, total, tail_window=1000)
        outcomes[outcome] += 1
        if outcome == "salvaged":
            assert k > total - 1000
            shortest = min(shortest, k)
    assert set(outcomes) <= {"salvaged", "unharmed"}, outcomes
    assert outcomes["salvaged"] >= 18 and shortest < total - 100, (outcomes, shortest)


def test_damage_in_the_middle_is_reported_never_cut_away(closed_log: tuple[Path, int], tmp_path: Path) -> None:
    source, total = closed_log
    original = source.read_bytes()
    rng = random.Random(13)
    outcomes: Counter[str] = Counter()
    for i in range(20):
        # Events 10-50% into the log lie here; the last 200 events are the tail. (Cutting the
        # file here would make this the tail: nothing after it would be left to read.)
        damaged = damage(original, rng, len(original) // 10, len(original) // 2, kinds=("zeros", "garbage"))
        outcome, k = reopen_damaged(tmp_path / f"case{i}" / "events.sqlite", damaged, total, tail_window=200)
        assert outcome != "salvaged" or k == total, f"case {i}: the log was cut to {k} of {total} events"
        outcomes[outcome] += 1
    assert outcomes["refused"] + outcomes["found_on_read"] >= 8, outcomes
