"""A full disk under the log, for real: a 2 MiB tmpfs filled up. A write that runs out of space
is rolled back whole and raises `DiskFull` naming the file; what was appended before is intact;
once there is space, the same FactLog appends the failed facts again, with the versions they
would have had, and the log replays to the fold of everything appended."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dynaresized.core.facts import StepObserved, encode_fact
from dynaresized.core.state import encode_state, fold
from dynaresized.domain import StepTiming
from dynaresized.store import DiskFull, FactLog, SQLiteRecorder


@pytest.fixture
def small_disk(small_tmpfs) -> Path:  # type: ignore[no-untyped-def]
    """A 2 MiB tmpfs mounted for the test (tests/conftest.py)."""
    return small_tmpfs("2m")


def fill_up(path: Path) -> None:
    """Write `path` until the filesystem has no byte left."""
    with open(path, "ab", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1 << 8, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC


def batch(first: int, n: int) -> list[StepObserved]:
    """Facts first..first+n-1: step reports of about 1 KB each (a long worker id)."""
    return [StepObserved(at=float(i), worker_id=f"trainer-{i:0>1000}",
                         timing=StepTiming(step=i, rollout_s=1.0, train_s=1.0))
            for i in range(first, first + n)]


def test_a_full_disk_rolls_the_write_back_and_the_log_goes_on_once_there_is_space(small_disk: Path) -> None:
    path = small_disk / "events.sqlite"
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * (1536 * 1024))  # leave about half a MiB for the log
    factlog = FactLog(SQLiteRecorder(path), snapshot_every=1 << 30)
    appended: list[StepObserved] = []
    failed: list[StepObserved] = []
    for _ in range(1000):
        facts = batch(len(appended), 20)
        try:
            factlog.append(facts)
        except DiskFull as e:
            failed, error = facts, e
            break
        appended += facts
    else:
        pytest.fail("the disk never filled up")
    assert appended, "the log took no batch before the disk filled"
    # One typed error, an OSError, that names the file and says what happened and what to do.
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(path)
    assert str(path) in str(error) and "disk is full" in str(error) and "Free space" in str(error)
    assert "appending 20 event(s) to stream 'cluster' after version" in error.doing
    assert factlog.version == len(appended)

    # Take the last bytes too: a snapshot is refused the same way. (A small append may still fit
    # in the WAL's blocks that the rolled-back write left allocated.)
    fill_up(small_disk / "filler-2")
    with pytest.raises(DiskFull, match="saving a snapshot of stream 'cluster'"):
        factlog.recorder.save_snapshot("cluster", factlog.version, encode_state(fold(appended)))

    # Read-only, alongside the writer: exactly the facts appended before, intact, nothing half-written.
    with SQLiteRecorder(path, read_only=True) as reader:
        assert [e.data for e in reader.read_all()] == [encode_fact(f) for f in appended]
        assert reader.check().events == len(appended)
        assert reader.load_snapshot("cluster") is None

    # Space returns: the same fact log appends the failed facts, at the versions they would have had.
    os.remove(filler)
    os.remove(small_disk / "filler-2")
    factlog.append(failed)
    assert factlog.version == len(appended) + len(failed)
    everything = appended + failed
    with SQLiteRecorder(path, read_only=True) as reader:
        stored = list(reader.read("cluster"))
        assert [e.version for e in stored] == list(range(1, len(everything) + 1))
        assert [e.data for e in stored] == [encode_fact(f) for f in everything]
        assert encode_state(FactLog(reader).replay()) == encode_state(fold(everything))
    state = fold(everything)
    factlog.snapshot_every = 1
    assert factlog.maybe_snapshot(state)
    factlog.close()
    with SQLiteRecorder(path) as again:
        assert encode_state(FactLog(again).replay()) == encode_state(state)
        assert again.load_snapshot("cluster") is not None
