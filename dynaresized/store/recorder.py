"""The recorder interface of the event store, its records and errors, and the in-memory recorder.

A recorder keeps append-only streams of opaque events. Each stream is versioned 1, 2, 3, ...
with no gaps, and every event also gets a global `position` (1, 2, 3, ... across all streams),
so a reader can follow the whole log in the order it was written. Writers use optimistic
concurrency: an append names the stream version it expects and fails with `ConcurrencyError`
if another append got there first. `compact()` drops the oldest events that a snapshot
covers; the log then starts after them (`log_start()`), and a read of what was dropped raises
`CompactedError`. The SQLite recorder (`dynaresized.store.sqlite`) and the in-memory recorder
here pass the same contract test suite, so code written against `Recorder` runs on either.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Protocol, runtime_checkable

import msgspec

Clock = Callable[[], float]


class StoredEvent(msgspec.Struct, frozen=True):
    """One event as the store keeps it."""

    position: int  # global, strictly increasing across streams, starts at 1, no gaps
    stream: str
    version: int  # per stream, starts at 1, no gaps
    type: str  # the fact tag, e.g. "resize_started"
    data: bytes  # the encoded fact; opaque to the store
    recorded_at: float  # wall clock when recorded (the recorder's clock)


class LogStart(msgspec.Struct, frozen=True):
    """Where a compacted log's retained history starts: what compactions dropped so far."""

    stream: str  # the stream whose events were dropped (compaction keeps to one stream)
    version: int  # its events 1..version are gone; its snapshot at `version` holds their fold
    position: int  # the log's events 1..position are gone: the first one kept is position + 1
    compacted_at: float  # wall clock of the compaction that last moved the start

    def summary(self) -> str:
        """Where the retained history starts, in a sentence for operators."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.compacted_at))
        return (f"facts before position {self.position + 1} (versions 1..{self.version} of stream {self.stream!r}) "
                f"were compacted at {when}; the snapshot at version {self.version} holds their state")


class Compaction(msgspec.Struct, frozen=True):
    """What one `compact()` did."""

    start: LogStart | None  # where the retained log starts now (None: it was never compacted)
    dropped_events: int  # by this compaction (0: nothing was due)
    dropped_snapshots: int
    bytes_in_use: int  # what the log holds afterwards (SQLite: its pages in use)
    over_budget: bool  # max_bytes is not met (more is due, or the events after the newest snapshot take more)
    behind: bool = False  # max_events stopped it: a further compaction would drop more now


class ConcurrencyError(Exception):
    """An append expected a stream version other than the one in the store."""

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        self.stream = stream
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"stream {stream!r} is at version {actual}, but the append expected version {expected}; "
            "another writer appended first: re-read the stream and decide again"
        )


class CorruptLogError(Exception):
    """The log is damaged in a way the store will not repair on its own. The message says
    what is damaged, where, and what an operator can do."""

    def __init__(self, message: str, *, path: str | None = None, position: int | None = None) -> None:
        self.path = path
        self.position = position
        super().__init__(message)


class RecorderClosedError(RuntimeError):
    """The recorder was used after `close()`."""


class CompactedError(LookupError):
    """A read asked for events that a compaction dropped. Their fold is the snapshot at the
    log's start (`start.version`): read after it."""

    def __init__(self, message: str, *, start: LogStart) -> None:
        self.start = start
        super().__init__(message)


class DiskFull(OSError):
    """The disk under the log filled up during a write. The write was rolled back whole;
    everything written before it is intact and durable; the same recorder can write again
    (the same events get the same versions) once there is space. `doing` says which write."""

    def __init__(self, path: str, doing: str) -> None:
        self.doing = doing
        folder = os.path.dirname(path) or "."
        super().__init__(
            errno.ENOSPC,
            f"{path}: the disk is full while {doing}; the write was rolled back (nothing of it is in the log, "
            f"everything before it is). Free space on the filesystem of {folder} (or lower [store] "
            "retention_bytes and run `dynaresized store compact`, docs/store.md), then write again",
            path,
        )

    def __str__(self) -> str:
        return str(self.strerror)


@runtime_checkable
class Recorder(Protocol):
    """What the daemon, the CLI and the fact log need from an event store."""

    def append(self, stream: str, expected_version: int, events: Sequence[tuple[str, bytes]]) -> int:
        """Append `events` (type, data) to `stream` atomically: all or none. `expected_version`
        is the stream version the caller last saw (0 for a new stream); returns the stream's
        new version. Raises `ConcurrencyError` if the stream is at another version. Once this
        returns, the events are durable (for the SQLite recorder: fsynced)."""
        ...

    def read(self, stream: str, after_version: int = 0, limit: int | None = None) -> Iterator[StoredEvent]:
        """The events of `stream` with version > `after_version`, oldest first. Raises
        `CompactedError` if a compaction dropped some of them (`after_version` is before the
        stream's start)."""
        ...

    def read_all(
        self, after_position: int = 0, types: Collection[str] | None = None, limit: int | None = None
    ) -> Iterator[StoredEvent]:
        """Every stream's events with position > `after_position`, in the order they were
        recorded; only those whose type is in `types` when given. Of a compacted log, the
        retained events: from the log's start (`log_start()`) if `after_position` is before it."""
        ...

    def last_version(self, stream: str) -> int:
        """The stream's version: its number of events, compacted ones included (0 for a stream
        never written)."""
        ...

    def last_position(self) -> int:
        """The position of the last event recorded (0 for an empty store)."""
        ...

    def save_snapshot(self, stream: str, version: int, data: bytes) -> None:
        """Keep `data` as the stream's state after its first `version` events."""
        ...

    def load_snapshot(self, stream: str, version: int | None = None) -> tuple[int, bytes] | None:
        """The latest intact snapshot of `stream` as (version, data), or None; with `version`,
        the intact snapshot at exactly that version, or None."""
        ...

    def log_start(self) -> LogStart | None:
        """Where the retained log starts, or None if it was never compacted."""
        ...

    def compact(self, stream: str, *, recorded_before: float | None = None, max_bytes: int | None = None,
                max_events: int | None = None) -> Compaction:
        """Drop the oldest events of the log, up to a snapshot of `stream` that covers them, all
        or nothing: up to the newest snapshot whose last event was recorded before
        `recorded_before`, then further, a snapshot at a time, while the log takes more than
        `max_bytes`; at most `max_events` events (but always up to the first snapshot due). The
        snapshot at the cut is kept (the new start); older ones are dropped. The events dropped
        must all be `stream`'s (ValueError otherwise)."""
        ...

    def close(self) -> None:
        """Release the store; later calls raise `RecorderClosedError`. Idempotent."""
        ...


# -- argument checks shared by every recorder -------------------------------------------


def check_stream(stream: object) -> str:
    if not isinstance(stream, str) or not stream:
        raise ValueError(f"stream must be a non-empty string, got {stream!r}")
    return stream


def check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def check_limit(limit: object) -> int | None:
    if limit is None:
        return None
    return check_count("limit", limit)


def check_events(events: object) -> list[tuple[str, bytes]]:
    """The events of an append as a list of (type, bytes), or a ValueError naming the bad one."""
    if isinstance(events, (str, bytes)) or not isinstance(events, Sequence):
        raise ValueError(f"events must be a sequence of (type, data) pairs, got {type(events).__name__}")
    # The common case (what FactLog appends): a list of (str, bytes) tuples, kept as they are.
    fast = list(events)
    for item in fast:
        if type(item) is not tuple or len(item) != 2 or type(item[0]) is not str or not item[0] \
                or type(item[1]) is not bytes:
            break
    else:
        return fast
    checked: list[tuple[str, bytes]] = []
    for i, item in enumerate(events):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"events[{i}] must be a (type, data) pair, got {item!r:.80}")
        kind, data = item
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"events[{i}]: type must be a non-empty string, got {kind!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"events[{i}] ({kind}): data must be bytes, got {type(data).__name__}")
        checked.append((kind, bytes(data)))
    return checked


def check_types(types: object) -> frozenset[str] | None:
    if types is None:
        return None
    if isinstance(types, (str, bytes)) or not isinstance(types, Collection):
        # A bare string is a collection of characters: almost certainly a mistake.
        raise ValueError(f"types must be a collection of type names (e.g. a set), got {types!r}")
    bad = [t for t in types if not isinstance(t, str)]
    if bad:
        raise ValueError(f"types must be strings, got {bad[0]!r}")
    return frozenset(types)


def check_compaction(stream: str, start: LogStart | None, recorded_before: object, max_bytes: object,
                     max_events: object) -> int:
    """The base version of `stream` (0 if never compacted); ValueError for bad arguments or a
    log whose start belongs to another stream."""
    check_stream(stream)
    if recorded_before is not None and (isinstance(recorded_before, bool)
                                        or not isinstance(recorded_before, (int, float))):
        raise ValueError(f"recorded_before must be a wall-clock time in seconds or None, got {recorded_before!r}")
    for name, value in (("max_bytes", max_bytes), ("max_events", max_events)):
        if value is not None:
            check_count(name, value)
    if start is None:
        return 0
    if start.stream != stream:
        raise ValueError(
            f"the log was compacted on stream {start.stream!r}; compaction keeps to one stream, not {stream!r}"
        )
    return start.version


def plan_cut(cuts: Sequence[int], base: int, *, aged: int, max_events: int | None,
             over_budget: Callable[[int], bool]) -> tuple[int, bool]:
    """Where a compaction cuts: the version to drop through (`base`: nothing), and whether more
    is due than `max_events` let it drop. `cuts` are the snapshot versions after `base`,
    ascending; `aged` the newest of them past the age bound (or `base`); `over_budget(cut)` says
    whether the log compacted through `cut` still exceeds the size bound (the SQLite recorder
    drops through `cut` to measure it, so it is asked about cuts in ascending order)."""
    if not cuts:
        return base, False
    reach = cuts[-1] if max_events is None else max(base + max_events, cuts[0])
    cut = max((v for v in cuts if v <= min(aged, reach)), default=base)
    behind = aged > cut
    for later in cuts:
        if later <= cut:
            continue
        if not over_budget(cut):
            break
        if later > reach:
            behind = True
            break
        cut = later
    return cut, behind


def check_cut(stream: str, start: LogStart | None, cut_version: int, cut_position: int) -> None:
    """Raise ValueError unless every event up to `cut_position` not yet dropped is `stream`'s
    (its versions up to `cut_version`): positions and versions advance together then."""
    base_version, base_position = (0, 0) if start is None else (start.version, start.position)
    if cut_position - base_position != cut_version - base_version:
        raise ValueError(
            f"cannot compact stream {stream!r} through version {cut_version} (position {cut_position}): "
            "events of other streams lie before it, and compaction keeps to one stream"
        )


def compacted_error(stream: str, after_version: int, start: LogStart) -> CompactedError:
    """The error for a read of `stream` after `after_version`, before the log's start."""
    return CompactedError(
        f"stream {stream!r} after version {after_version} cannot be read: {start.summary()}. "
        f"Read after version {start.version}",
        start=start,
    )


def check_snapshot(stream: str, version: object, data: object, last_version: int) -> bytes:
    check_stream(stream)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"snapshot version must be an integer >= 1, got {version!r}")
    if version > last_version:
        raise ValueError(
            f"cannot snapshot stream {stream!r} at version {version}: the stream is only at version {last_version}"
        )
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"snapshot data must be bytes, got {type(data).__name__}")
    return bytes(data)


# -- in memory ---------------------------------------------------------------------------


class InMemoryRecorder:
    """A recorder that keeps everything in this process: for tests, the simulator and
    `--store :memory:`. Thread-safe; same behaviour as the SQLite recorder, minus durability.
    Its `bytes_in_use` counts the events' and snapshots' data."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._log: list[StoredEvent] = []  # the retained events: index i holds position start + i + 1
        self._streams: dict[str, list[StoredEvent]] = {}  # index i holds version base + i + 1
        self._snapshots: dict[str, dict[int, bytes]] = {}
        self._start: LogStart | None = None
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RecorderClosedError("the in-memory recorder is closed")

    def _base(self, stream: str) -> int:
        """The stream's compacted version: its events up to it are gone."""
        start = self._start
        return start.version if start is not None and start.stream == stream else 0

    def _first_position(self) -> int:
        return 0 if self._start is None else self._start.position

    def append(self, stream: str, expected_version: int, events: Sequence[tuple[str, bytes]]) -> int:
        check_stream(stream)
        check_count("expected_version", expected_version)
        batch = check_events(events)
        with self._lock:
            self._check_open()
            records = self._streams.get(stream, [])
            actual = self._base(stream) + len(records)
            if actual != expected_version:
                raise ConcurrencyError(stream, expected_version, actual)
            now = self._clock()
            start = self._first_position() + len(self._log)
            new = [
                StoredEvent(start + i + 1, stream, expected_version + i + 1, kind, data, now)
                for i, (kind, data) in enumerate(batch)
            ]
            self._log.extend(new)
            self._streams.setdefault(stream, records).extend(new)
            return expected_version + len(new)

    def read(self, stream: str, after_version: int = 0, limit: int | None = None) -> Iterator[StoredEvent]:
        check_stream(stream)
        check_count("after_version", after_version)
        stop = check_limit(limit)
        with self._lock:
            self._check_open()
            base = self._base(stream)
            if after_version < base:
                assert self._start is not None
                raise compacted_error(stream, after_version, self._start)
            end = None if stop is None else after_version - base + stop
            return iter(self._streams.get(stream, [])[after_version - base:end])

    def read_all(
        self, after_position: int = 0, types: Collection[str] | None = None, limit: int | None = None
    ) -> Iterator[StoredEvent]:
        check_count("after_position", after_position)
        wanted = check_types(types)
        stop = check_limit(limit)
        with self._lock:
            self._check_open()
            # Bound the read by the log's length now: events appended while the caller
            # iterates are not part of this read (as with SQLite's read transactions).
            skip = max(after_position - self._first_position(), 0)
            events: Iterator[StoredEvent] = itertools.islice(self._log, skip, len(self._log))
        if wanted is not None:
            events = (e for e in events if e.type in wanted)
        return itertools.islice(events, stop)

    def last_version(self, stream: str) -> int:
        check_stream(stream)
        with self._lock:
            self._check_open()
            return self._base(stream) + len(self._streams.get(stream, ()))

    def last_position(self) -> int:
        with self._lock:
            self._check_open()
            return self._first_position() + len(self._log)

    def save_snapshot(self, stream: str, version: int, data: bytes) -> None:
        with self._lock:
            self._check_open()
            last = self._base(stream) + len(self._streams.get(stream, ()))
            blob = check_snapshot(stream, version, data, last)
            self._snapshots.setdefault(stream, {})[version] = blob

    def load_snapshot(self, stream: str, version: int | None = None) -> tuple[int, bytes] | None:
        check_stream(stream)
        if version is not None:
            check_count("version", version)
        with self._lock:
            self._check_open()
            snapshots = self._snapshots.get(stream, {})
            if version is None:
                version = max(snapshots, default=None)
            return None if version not in snapshots else (version, snapshots[version])

    def log_start(self) -> LogStart | None:
        with self._lock:
            self._check_open()
            return self._start

    def compact(self, stream: str, *, recorded_before: float | None = None, max_bytes: int | None = None,
                max_events: int | None = None) -> Compaction:
        with self._lock:
            self._check_open()
            base = check_compaction(stream, self._start, recorded_before, max_bytes, max_events)
            records = self._streams.get(stream, [])
            snapshots = self._snapshots.get(stream, {})
            cuts = sorted(v for v in snapshots if v > base)

            def in_use(cut: int) -> int:  # what the log would hold compacted through `cut`
                dropped = cut - base
                return (sum(len(e.data) for e in self._log[dropped:])
                        + sum(len(blob) for v, blob in snapshots.items() if v >= cut))

            aged = base if recorded_before is None else max(
                (v for v in cuts if records[v - base - 1].recorded_at < recorded_before), default=base)
            cut, behind = plan_cut(cuts, base, aged=aged, max_events=max_events,
                                   over_budget=lambda c: max_bytes is not None and in_use(c) > max_bytes)
            size = in_use(cut)
            over = max_bytes is not None and size > max_bytes
            if cut == base:
                return Compaction(start=self._start, dropped_events=0, dropped_snapshots=0, bytes_in_use=size,
                                  over_budget=over, behind=behind)
            dropped = cut - base
            position = records[dropped - 1].position
            check_cut(stream, self._start, cut, position)
            old = [v for v in snapshots if v < cut]
            self._log = self._log[dropped:]
            self._streams[stream] = records[dropped:]
            self._snapshots[stream] = {v: blob for v, blob in snapshots.items() if v >= cut}
            self._start = LogStart(stream=stream, version=cut, position=position, compacted_at=self._clock())
            return Compaction(start=self._start, dropped_events=dropped, dropped_snapshots=len(old),
                              bytes_in_use=size, over_budget=over, behind=behind)

    def close(self) -> None:
        with self._lock:
            self._closed = True
