"""The fact log: the core's facts on one stream of a recorder, and the state they fold to.

The daemon appends each step's facts here *before* it sends the commands they imply, so a
command never leaves for a fact the log could lose. `replay()` rebuilds the cluster state
from the latest snapshot plus a fold of the facts after it; `maybe_snapshot()` saves one
every `snapshot_every` facts, so a restart folds at most that many, and then compacts the log
to its retention (`compact()`): facts past it that a snapshot covers are dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import structlog

from dynaresized.core.facts import Fact, decode_fact, encode_facts
from dynaresized.core.state import ClusterState, decode_state, encode_state, mutate
from dynaresized.store.recorder import CompactedError, Compaction, CorruptLogError, Recorder
from dynaresized.store.retention import Retention

log = structlog.get_logger("dynaresized.store")
_FALLBACK = "replaying the whole log instead (a compacted one from the snapshot at its start)"
_REPLAY_TRIES = 3  # a replay that a concurrent compaction overtook is tried again, this many times in all
# A compaction drops at most this many snapshot intervals of facts: 15-25 ms each on a 2-core
# machine (1,024 devices: 10,000 facts and a 655 KB snapshot). A log far over its bounds (after an
# upgrade, or a bound lowered) then shrinks by a few intervals per interval, and the log writer is
# never held up for long nor the WAL filled with one huge transaction.
CATCH_UP_INTERVALS = 4


class FactLog:
    """Appends facts to `stream` with optimistic concurrency, and replays them.

    `version` is the stream version this fact log has seen: a second writer on the same
    stream makes the next `append()` fail with `ConcurrencyError` instead of interleaving.
    With a `retention`, every snapshot is followed by a compaction at `clock()` (wall time,
    the clock facts are recorded by); without one the log keeps everything.
    """

    def __init__(self, recorder: Recorder, stream: str = "cluster", snapshot_every: int = 10_000,
                 retention: Retention | None = None, clock: Callable[[], float] = time.time) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.recorder = recorder
        self.stream = stream
        self.snapshot_every = snapshot_every
        self.retention = retention
        self._clock = clock
        self.version = recorder.last_version(stream)
        snapshot = recorder.load_snapshot(stream)
        self.snapshot_version = 0 if snapshot is None else snapshot[0]

    def append(self, facts: Sequence[Fact]) -> None:
        """Record `facts` as one atomic, durable batch (nothing to do for none). On a full disk
        it raises `DiskFull` having recorded none of them: append them again once there is space
        (they get the versions they would have had)."""
        if not facts:
            return
        self.version = self.recorder.append(self.stream, self.version, encode_facts(facts))

    def replay(self, *, use_snapshot: bool = True) -> ClusterState:
        """The state the log folds to: the latest snapshot (unless `use_snapshot` is False or
        it cannot be decoded) plus every fact after it. Without it, the whole log is folded:
        from the start, or in a compacted log from the snapshot at its start, which holds the
        fold of the facts compacted away. Also brings `version` up to date."""
        for _ in range(_REPLAY_TRIES - 1):
            try:
                return self._replay(use_snapshot)
            except CompactedError:
                # Another process (the daemon, when this is a reader) compacted the log between
                # the snapshot and the read: its start moved on, and so does the replay.
                continue
        return self._replay(use_snapshot)

    def _replay(self, use_snapshot: bool) -> ClusterState:
        start = self.recorder.log_start()
        base = start.version if start is not None and start.stream == self.stream else 0
        state = self._snapshot_state(self.recorder.load_snapshot(self.stream)) if use_snapshot else None
        if state is None and base:
            state = self._snapshot_state(self.recorder.load_snapshot(self.stream, base))
            if state is None:
                raise CorruptLogError(
                    f"stream {self.stream!r} was compacted through version {base}, and its snapshot there, which "
                    "holds the state of the facts compacted away, is missing, damaged or unreadable (see the "
                    "warnings above): the state cannot be rebuilt from this log. Restore the log from a backup",
                    position=None if start is None else start.position,
                )
        if state is None:
            state = ClusterState()
        for event in self.recorder.read(self.stream, after_version=state.version):
            try:
                fact = decode_fact(event.data)
            except msgspec.DecodeError as e:
                raise CorruptLogError(
                    f"stream {self.stream!r} version {event.version} (position {event.position}, type "
                    f"{event.type!r}) is not a fact this dynaresized can read: {e}",
                    position=event.position,
                ) from e
            state = mutate(state, fact)
        self.version = state.version
        return state

    def _snapshot_state(self, snapshot: tuple[int, bytes] | None) -> ClusterState | None:
        """The state a snapshot holds, or None (with a warning) if it cannot be used."""
        if snapshot is None:
            return None
        version, data = snapshot
        try:
            state = decode_state(data)
        except msgspec.DecodeError as e:
            # A snapshot is only a cache of the fold: the caller falls back to an older one.
            log.warning("store.snapshot_unusable", stream=self.stream, version=version,
                        reason=f"cannot decode: {e}; {_FALLBACK}")
            return None
        if state.version != version:
            log.warning("store.snapshot_unusable", stream=self.stream, version=version,
                        reason=f"it holds {state.version} facts; {_FALLBACK}")
            return None
        return state

    def maybe_snapshot(self, state: ClusterState) -> bool:
        """Save a snapshot of `state` if `snapshot_every` facts were appended since the last
        one, then compact the log to the retention, if there is one. `state` must be the fold
        of exactly the facts in the log. Returns whether it saved. A `DiskFull` from here
        comes after the facts were appended (they are durable): the snapshot or the compaction
        failed, and the next snapshot tries again."""
        if state.version != self.version:
            raise ValueError(
                f"the state has folded {state.version} facts but stream {self.stream!r} holds {self.version}: "
                "snapshot only a state whose facts were all appended"
            )
        if state.version - self.snapshot_version < self.snapshot_every:
            return False
        self.recorder.save_snapshot(self.stream, state.version, encode_state(state))
        self.snapshot_version = state.version
        if self.retention is not None and self.retention.bounded:
            self.compact(self._clock())
        return True

    def compact(self, now_wall_s: float, *, catch_up: bool = False) -> Compaction:
        """Drop the facts past the retention at `now_wall_s` that a snapshot covers: those
        recorded more than `retention.max_age_s` ago, then the oldest while the log takes more
        than `retention.max_bytes`; up to a snapshot, which stays as the log's start; at most
        CATCH_UP_INTERVALS × `snapshot_every` facts (`behind` says more is due), or all that is
        due with `catch_up`. One transaction: a crash leaves the log as it was or as it is after.
        Logs what it dropped, and a warning when the facts after the newest snapshot alone exceed
        the size bound."""
        if self.retention is None:
            raise ValueError("this fact log has no retention: it keeps every fact")
        result = self.recorder.compact(self.stream, recorded_before=self.retention.recorded_before(now_wall_s),
                                       max_bytes=self.retention.byte_budget(),
                                       max_events=None if catch_up else CATCH_UP_INTERVALS * self.snapshot_every)
        if result.dropped_events or result.dropped_snapshots:
            assert result.start is not None
            log.info("store.compacted", stream=self.stream, dropped_events=result.dropped_events,
                     dropped_snapshots=result.dropped_snapshots, starts_after_version=result.start.version,
                     starts_after_position=result.start.position, bytes_in_use=result.bytes_in_use,
                     behind=result.behind)
        if result.over_budget and not result.behind:
            log.warning("store.over_budget", stream=self.stream, bytes_in_use=result.bytes_in_use,
                        max_bytes=self.retention.max_bytes,
                        reason="the facts after the newest snapshot alone take more than the size bound; "
                               "raise [store] retention_bytes or lower daemon.snapshot_every")
        return result

    def close(self) -> None:
        """Close the recorder underneath (idempotent)."""
        self.recorder.close()
