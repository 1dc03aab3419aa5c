"""The recorder contract: every implementation (in memory, SQLite) passes the same suite."""

from __future__ import annotations

import threading

import pytest

from dynaresized.store import (
    CompactedError,
    ConcurrencyError,
    InMemoryRecorder,
    Recorder,
    RecorderClosedError,
    SQLiteRecorder,
    StoredEvent,
    open_recorder,
)
from dynaresized.store.layout import CHUNK
from tests.store.conftest import FakeClock


def test_is_a_recorder(recorder: Recorder) -> None:
    assert isinstance(recorder, Recorder)


def test_an_empty_store_has_nothing(recorder: Recorder) -> None:
    assert recorder.last_position() == 0
    assert recorder.last_version("cluster") == 0
    assert list(recorder.read("cluster")) == []
    assert list(recorder.read_all()) == []
    assert recorder.load_snapshot("cluster") is None


def test_append_numbers_versions_per_stream_and_positions_globally(recorder: Recorder, clock: FakeClock) -> None:
    assert recorder.append("a", 0, [("x", b"a1"), ("y", b"a2")]) == 2
    clock.now += 5
    assert recorder.append("b", 0, [("x", b"b1")]) == 1
    assert recorder.append("a", 2, [("z", b"a3")]) == 3
    t0 = 1_700_000_000.0
    assert list(recorder.read_all()) == [
        StoredEvent(1, "a", 1, "x", b"a1", t0),
        StoredEvent(2, "a", 2, "y", b"a2", t0),
        StoredEvent(3, "b", 1, "x", b"b1", t0 + 5),
        StoredEvent(4, "a", 3, "z", b"a3", t0 + 5),
    ]
    assert [e.position for e in recorder.read("a")] == [1, 2, 4]
    assert [e.version for e in recorder.read("a")] == [1, 2, 3]
    assert recorder.last_version("a") == 3
    assert recorder.last_version("b") == 1
    assert recorder.last_position() == 4


def test_data_is_opaque_bytes(recorder: Recorder) -> None:
    blobs = [b"", b"\x00" * 10, bytes(range(256)), b"\xff" * 70_000]  # the last spans SQLite overflow pages
    recorder.append("s", 0, [("t", b) for b in blobs])
    recorder.append("strom-ü", 0, [("typ-ß", bytearray(b"\x00x"))])
    assert [e.data for e in recorder.read("s")] == blobs
    assert [(e.stream, e.type, e.data) for e in recorder.read("strom-ü")] == [("strom-ü", "typ-ß", b"\x00x")]


@pytest.mark.parametrize("expected", [0, 1, 3, 7])
def test_append_with_a_stale_or_future_version_fails_and_writes_nothing(recorder: Recorder, expected: int) -> None:
    recorder.append("s", 0, [("x", b"1"), ("x", b"2")])
    recorder.append("other", 0, [("x", b"o")])
    with pytest.raises(ConcurrencyError) as info:
        recorder.append("s", expected, [("x", b"3")])
    assert (info.value.stream, info.value.expected, info.value.actual) == ("s", expected, 2)
    assert "'s'" in str(info.value) and "version 2" in str(info.value) and f"version {expected}" in str(info.value)
    assert recorder.last_position() == 3
    assert [e.data for e in recorder.read("s")] == [b"1", b"2"]


def test_an_empty_batch_checks_the_version_and_writes_nothing(recorder: Recorder) -> None:
    recorder.append("s", 0, [("x", b"1")])
    assert recorder.append("s", 1, []) == 1
    with pytest.raises(ConcurrencyError):
        recorder.append("s", 0, [])
    assert recorder.last_position() == 1


def test_a_bad_batch_is_refused_whole(recorder: Recorder) -> None:
    with pytest.raises(ValueError, match=r"events\[1\] \(t\): data must be bytes"):
        recorder.append("s", 0, [("t", b"ok"), ("t", "not bytes")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"events\[0\]: type must be a non-empty string"):
        recorder.append("s", 0, [("", b"x")])
    with pytest.raises(ValueError, match=r"events\[0\] must be a \(type, data\) pair"):
        recorder.append("s", 0, [b"x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="events must be a sequence"):
        recorder.append("s", 0, b"xy")  # type: ignore[arg-type]
    assert recorder.last_position() == 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.append("", 0, [("t", b"")]), "stream must be a non-empty string"),
        (lambda r: r.append("s", -1, [("t", b"")]), "expected_version must be an integer >= 0"),
        (lambda r: r.append("s", True, [("t", b"")]), "expected_version must be an integer >= 0"),
        (lambda r: r.read("s", after_version=-1), "after_version must be an integer >= 0"),
        (lambda r: r.read("s", limit=-1), "limit must be an integer >= 0"),
        (lambda r: r.read_all(after_position=-2), "after_position must be an integer >= 0"),
        (lambda r: r.read_all(types="resize_started"), "types must be a collection"),
        (lambda r: r.read_all(types=[1]), "types must be strings"),
        (lambda r: r.last_version(""), "stream must be a non-empty string"),
        (lambda r: r.save_snapshot("s", 0, b""), "snapshot version must be an integer >= 1"),
        (lambda r: r.save_snapshot("s", 1, b""), "the stream is only at version 0"),
    ],
)
def test_bad_arguments_get_a_clear_error(recorder: Recorder, call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call(recorder)


def test_read_after_and_limit(recorder: Recorder) -> None:
    recorder.append("s", 0, [("t", str(i).encode()) for i in range(1, 11)])
    recorder.append("u", 0, [("t", b"u")])
    assert [e.version for e in recorder.read("s", after_version=7)] == [8, 9, 10]
    assert [e.version for e in recorder.read("s", after_version=2, limit=3)] == [3, 4, 5]
    assert list(recorder.read("s", limit=0)) == []
    assert list(recorder.read("s", after_version=10)) == []
    assert list(recorder.read("s", after_version=99)) == []
    assert [e.position for e in recorder.read_all(after_position=9)] == [10, 11]
    assert [e.position for e in recorder.read_all(after_position=3, limit=2)] == [4, 5]
    assert list(recorder.read_all(limit=0)) == []


def test_read_all_filters_by_type(recorder: Recorder) -> None:
    kinds = ["step_observed", "resize_started", "op_acked", "resize_started", "resize_committed", "step_observed"]
    recorder.append("cluster", 0, [(k, b"") for k in kinds])
    started = list(recorder.read_all(types={"resize_started"}))
    assert [e.position for e in started] == [2, 4]
    assert [e.position for e in recorder.read_all(types=["resize_started", "resize_committed"], after_position=2)] == [
        4,
        5,
    ]
    assert [e.position for e in recorder.read_all(types=("step_observed",), limit=1)] == [1]
    assert list(recorder.read_all(types=set())) == []
    assert list(recorder.read_all(types={"never"})) == []


def test_reads_longer_than_one_query(recorder: Recorder) -> None:
    n = 2 * CHUNK + 17
    recorder.append("s", 0, [("t", i.to_bytes(4, "big")) for i in range(n)])
    recorder.append("o", 0, [("t", b"")])
    assert [int.from_bytes(e.data, "big") for e in recorder.read("s")] == list(range(n))
    assert [e.position for e in recorder.read_all()] == list(range(1, n + 2))
    assert len(list(recorder.read("s", after_version=CHUNK - 1, limit=CHUNK + 2))) == CHUNK + 2


def test_a_read_covers_the_log_as_it_was_when_it_started(recorder: Recorder) -> None:
    recorder.append("s", 0, [("t", b"%d" % i) for i in range(CHUNK + 10)])
    stream = recorder.read("s")
    everything = recorder.read_all()
    first = [next(stream), next(everything)]
    recorder.append("s", CHUNK + 10, [("t", b"later")])
    assert len([first[0], *stream]) == CHUNK + 10
    assert len([first[1], *everything]) == CHUNK + 10
    assert [e.data for e in recorder.read("s", after_version=CHUNK + 10)] == [b"later"]


def test_snapshots_load_the_latest(recorder: Recorder) -> None:
    recorder.append("s", 0, [("t", b"")] * 9)
    recorder.append("u", 0, [("t", b"")] * 2)
    recorder.save_snapshot("s", 3, b"three")
    recorder.save_snapshot("s", 8, b"eight")
    recorder.save_snapshot("s", 5, b"five")  # an older one saved late does not win
    recorder.save_snapshot("u", 2, b"u-two")
    assert recorder.load_snapshot("s") == (8, b"eight")
    assert recorder.load_snapshot("u") == (2, b"u-two")
    recorder.save_snapshot("s", 8, b"eight again")  # same version: replaced
    assert recorder.load_snapshot("s") == (8, b"eight again")
    assert recorder.load_snapshot("never") is None
    with pytest.raises(ValueError, match="the stream is only at version 9"):
        recorder.save_snapshot("s", 10, b"ahead")


# -- compaction ------------------------------------------------------------------------------


def _ten_a_second(recorder: Recorder, clock: FakeClock, n: int, snapshot_every: int) -> None:
    """Stream "s": n events of 1 KB (several to a SQLite page), one every 0.1 s of the clock,
    a snapshot every `snapshot_every`."""
    for v in range(1, n + 1):
        recorder.append("s", v - 1, [("t", b"%04d" % v * 250)])
        if v % snapshot_every == 0:
            recorder.save_snapshot("s", v, b"state at %d" % v)
        clock.now += 0.1


def test_compaction_by_age_drops_up_to_the_newest_snapshot_past_it(recorder: Recorder, clock: FakeClock) -> None:
    t0 = clock.now
    _ten_a_second(recorder, clock, 100, snapshot_every=20)  # event v recorded at t0 + (v - 1) / 10
    assert recorder.log_start() is None
    # Events 1..55 are older than t0 + 5.45; the newest snapshot covering only them is at 40.
    done = recorder.compact("s", recorded_before=t0 + 5.45)
    assert (done.dropped_events, done.dropped_snapshots, done.over_budget) == (40, 1, False)
    assert done.start is not None and (done.start.stream, done.start.version, done.start.position) == ("s", 40, 40)
    assert done.start.compacted_at == clock.now and recorder.log_start() == done.start
    # What is kept reads as before; versions and positions go on where they were.
    assert [e.version for e in recorder.read("s", after_version=40)] == list(range(41, 101))
    assert [e.position for e in recorder.read_all()] == list(range(41, 101))  # the retained log
    assert [e.position for e in recorder.read_all(after_position=70)] == list(range(71, 101))
    assert (recorder.last_version("s"), recorder.last_position()) == (100, 100)
    assert recorder.load_snapshot("s") == (100, b"state at 100")
    assert recorder.load_snapshot("s", 40) == (40, b"state at 40")  # the start's snapshot stays
    assert recorder.load_snapshot("s", 20) is None
    with pytest.raises(CompactedError, match=r"facts before position 41 \(versions 1\.\.40 of stream 's'\) were") as info:
        recorder.read("s", after_version=39)
    assert info.value.start == done.start
    assert recorder.append("s", 100, [("t", b"101")]) == 101
    assert [e.position for e in recorder.read_all(after_position=100)] == [101]
    # Nothing more is due: a compaction changes nothing.
    again = recorder.compact("s", recorded_before=t0 + 5.45)
    assert (again.dropped_events, again.start) == (0, done.start)


def test_compaction_by_size_drops_snapshot_by_snapshot_until_the_log_fits(recorder: Recorder, clock: FakeClock) -> None:
    _ten_a_second(recorder, clock, 100, snapshot_every=20)
    whole = recorder.compact("s", max_bytes=1 << 40)
    assert whole.dropped_events == 0 and not whole.over_budget
    fits = recorder.compact("s", max_bytes=whole.bytes_in_use - 1)  # a byte too many: the oldest snapshot's worth
    assert fits.start is not None and fits.start.version == 20 and fits.bytes_in_use < whole.bytes_in_use
    # A bound nothing can meet drops all a snapshot covers, keeps the newest, and says so.
    everything = recorder.compact("s", max_bytes=0)
    assert everything.start is not None and everything.start.version == 100 and everything.over_budget
    assert list(recorder.read_all()) == [] and list(recorder.read("s", after_version=100)) == []
    assert (recorder.last_version("s"), recorder.last_position()) == (100, 100)  # the count goes on
    assert recorder.append("s", 100, [("t", b"101")]) == 101
    assert [(e.position, e.version) for e in recorder.read_all()] == [(101, 101)]


def test_compaction_drops_at_most_max_events_and_says_when_more_is_due(recorder: Recorder, clock: FakeClock) -> None:
    _ten_a_second(recorder, clock, 100, snapshot_every=20)
    first = recorder.compact("s", max_bytes=0, max_events=30)  # the snapshot at 40 lies beyond 30 events
    assert first.start is not None and first.start.version == 20 and first.behind and first.over_budget
    # Fewer than a snapshot interval still drops up to the first snapshot due: a compaction always gets on.
    second = recorder.compact("s", recorded_before=clock.now, max_events=5)
    assert second.start is not None and second.start.version == 40 and second.behind
    rest = recorder.compact("s", recorded_before=clock.now)
    assert rest.start is not None and rest.start.version == 100 and not rest.behind
    assert rest.dropped_events == 60 and rest.dropped_snapshots == 3


def test_compaction_keeps_to_one_stream_and_changes_nothing_when_refused(recorder: Recorder) -> None:
    recorder.append("s", 0, [("t", b"")] * 3)
    recorder.append("u", 0, [("t", b"")])
    recorder.append("s", 3, [("t", b"")] * 3)
    recorder.save_snapshot("s", 6, b"six")
    with pytest.raises(ValueError, match="events of other streams lie before it"):
        recorder.compact("s", max_bytes=0)
    assert recorder.log_start() is None and [e.position for e in recorder.read_all()] == list(range(1, 8))
    assert recorder.load_snapshot("s") == (6, b"six")
    with pytest.raises(ValueError, match="max_bytes must be an integer >= 0"):
        recorder.compact("s", max_bytes=-1)


def test_close_is_idempotent_and_final(recorder: Recorder) -> None:
    recorder.append("s", 0, [("t", b"")])
    recorder.close()
    recorder.close()
    for call in (
        lambda: recorder.append("s", 1, [("t", b"")]),
        lambda: recorder.read("s"),
        lambda: recorder.read_all(),
        lambda: recorder.last_version("s"),
        lambda: recorder.last_position(),
        lambda: recorder.load_snapshot("s"),
        lambda: recorder.save_snapshot("s", 1, b""),
        lambda: recorder.log_start(),
        lambda: recorder.compact("s", max_bytes=0),
    ):
        with pytest.raises(RecorderClosedError, match="closed"):
            call()


def test_concurrent_writers_never_lose_or_interleave_a_batch(recorder: Recorder) -> None:
    """Two threads append batches of 3 to one stream, re-reading the version after each
    ConcurrencyError. Every batch lands whole and contiguous; versions have no gaps."""
    batches_per_writer = 40
    conflicts = [0, 0]

    def writer(name: str, slot: int) -> None:
        for b in range(batches_per_writer):
            batch = [("t", f"{name}-{b}-{i}".encode()) for i in range(3)]
            while True:
                try:
                    recorder.append("s", recorder.last_version("s"), batch)
                    break
                except ConcurrencyError:
                    conflicts[slot] += 1

    threads = [threading.Thread(target=writer, args=(n, i)) for i, n in enumerate(("a", "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = list(recorder.read("s"))
    assert [e.version for e in events] == list(range(1, 2 * batches_per_writer * 3 + 1))
    for i in range(0, len(events), 3):
        names = {e.data.decode().rsplit("-", 1)[0] for e in events[i : i + 3]}
        assert len(names) == 1, f"batch at version {i + 1} was interleaved: {names}"
    assert {e.data for e in events} == {f"{n}-{b}-{i}".encode() for n in "ab" for b in range(40) for i in range(3)}


def test_open_recorder_picks_the_implementation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for where in (None, ":memory:"):
        r = open_recorder(where)
        assert isinstance(r, InMemoryRecorder)
        r.close()
    r = open_recorder(tmp_path / "log.sqlite")
    assert isinstance(r, SQLiteRecorder)
    r.append("s", 0, [("t", b"x")])
    reader = open_recorder(str(tmp_path / "log.sqlite"), read_only=True)
    assert isinstance(reader, SQLiteRecorder) and [e.data for e in reader.read("s")] == [b"x"]
    reader.close()
    r.close()
    with pytest.raises(ValueError, match="in-memory store cannot be opened read-only"):
        open_recorder(None, read_only=True)
