"""The recorder interface of the event store, its records and errors, and the in-memory recorder.

A recorder keeps append-only streams of opaque events. Each stream is versioned 1, 2, 3, ...
with no gaps, and every event also gets a global `position` (1, 2, 3, ... across all streams),
so a reader can follow the whole log in the order it was written. Writers use optimistic
concurrency: an append names the stream version it expects and fails with `ConcurrencyError`
if another append got there first. The SQLite recorder (`dynaresized.store.sqlite`) and the
in-memory recorder here pass the same contract test suite, so code written against
`Recorder` runs on either.
"""

from __future__ import annotations

import itertools
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
        """The events of `stream` with version > `after_version`, oldest first."""
        ...

    def read_all(
        self, after_position: int = 0, types: Collection[str] | None = None, limit: int | None = None
    ) -> Iterator[StoredEvent]:
        """Every stream's events with position > `after_position`, in the order they were
        recorded; only those whose type is in `types` when given."""
        ...

    def last_version(self, stream: str) -> int:
        """The stream's version: its number of events (0 for a stream never written)."""
        ...

    def last_position(self) -> int:
        """The position of the last event recorded (0 for an empty store)."""
        ...

    def save_snapshot(self, stream: str, version: int, data: bytes) -> None:
        """Keep `data` as the stream's state after its first `version` events."""
        ...

    def load_snapshot(self, stream: str) -> tuple[int, bytes] | None:
        """The latest intact snapshot of `stream` as (version, data), or None."""
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
    `--store :memory:`. Thread-safe; same behaviour as the SQLite recorder, minus durability."""

    def __init__(self, *, clock: Clock = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._log: list[StoredEvent] = []  # index i holds position i + 1
        self._streams: dict[str, list[StoredEvent]] = {}  # index i holds version i + 1
        self._snapshots: dict[str, tuple[int, bytes]] = {}
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RecorderClosedError("the in-memory recorder is closed")

    def append(self, stream: str, expected_version: int, events: Sequence[tuple[str, bytes]]) -> int:
        check_stream(stream)
        check_count("expected_version", expected_version)
        batch = check_events(events)
        with self._lock:
            self._check_open()
            records = self._streams.get(stream, [])
            if len(records) != expected_version:
                raise ConcurrencyError(stream, expected_version, len(records))
            now = self._clock()
            start = len(self._log)
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
            end = None if stop is None else after_version + stop
            return iter(self._streams.get(stream, [])[after_version:end])

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
            events: Iterator[StoredEvent] = itertools.islice(self._log, after_position, len(self._log))
        if wanted is not None:
            events = (e for e in events if e.type in wanted)
        return itertools.islice(events, stop)

    def last_version(self, stream: str) -> int:
        check_stream(stream)
        with self._lock:
            self._check_open()
            return len(self._streams.get(stream, ()))

    def last_position(self) -> int:
        with self._lock:
            self._check_open()
            return len(self._log)

    def save_snapshot(self, stream: str, version: int, data: bytes) -> None:
        with self._lock:
            self._check_open()
            blob = check_snapshot(stream, version, data, len(self._streams.get(stream, ())))
            old = self._snapshots.get(stream)
            if old is None or version >= old[0]:
                self._snapshots[stream] = (version, blob)

    def load_snapshot(self, stream: str) -> tuple[int, bytes] | None:
        check_stream(stream)
        with self._lock:
            self._check_open()
            return self._snapshots.get(stream)

    def close(self) -> None:
        with self._lock:
            self._closed = True
