"""The fact log: the core's facts on one stream of a recorder, and the state they fold to.

The daemon appends each step's facts here *before* it sends the commands they imply, so a
command never leaves for a fact the log could lose. `replay()` rebuilds the cluster state
from the latest snapshot plus a fold of the facts after it; `maybe_snapshot()` saves one
every `snapshot_every` facts, so a restart folds at most that many.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import structlog

from dynaresized.core.facts import Fact, decode_fact, encode_facts
from dynaresized.core.state import ClusterState, decode_state, encode_state, mutate
from dynaresized.store.recorder import CorruptLogError, Recorder

log = structlog.get_logger("dynaresized.store")


class FactLog:
    """Appends facts to `stream` with optimistic concurrency, and replays them.

    `version` is the stream version this fact log has seen: a second writer on the same
    stream makes the next `append()` fail with `ConcurrencyError` instead of interleaving.
    """

    def __init__(self, recorder: Recorder, stream: str = "cluster", snapshot_every: int = 10_000) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.recorder = recorder
        self.stream = stream
        self.snapshot_every = snapshot_every
        self.version = recorder.last_version(stream)
        snapshot = recorder.load_snapshot(stream)
        self.snapshot_version = 0 if snapshot is None else snapshot[0]

    def append(self, facts: Sequence[Fact]) -> None:
        """Record `facts` as one atomic, durable batch (nothing to do for none)."""
        if not facts:
            return
        self.version = self.recorder.append(self.stream, self.version, encode_facts(facts))

    def replay(self, *, use_snapshot: bool = True) -> ClusterState:
        """The state the log folds to: the latest snapshot (unless `use_snapshot` is False or
        it cannot be decoded) plus every fact after it. Also brings `version` up to date."""
        state = ClusterState()
        snapshot = self.recorder.load_snapshot(self.stream) if use_snapshot else None
        if snapshot is not None:
            version, data = snapshot
            try:
                candidate = decode_state(data)
            except msgspec.DecodeError as e:
                # A snapshot is only a cache of the fold: fall back to folding everything.
                log.warning("store.snapshot_unusable", stream=self.stream, version=version,
                            reason=f"cannot decode: {e}; replaying the whole log")
            else:
                if candidate.version == version:
                    state = candidate
                else:
                    log.warning("store.snapshot_unusable", stream=self.stream, version=version,
                                reason=f"it holds {candidate.version} facts; replaying the whole log")
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

    def maybe_snapshot(self, state: ClusterState) -> bool:
        """Save a snapshot of `state` if `snapshot_every` facts were appended since the last
        one. `state` must be the fold of exactly the facts in the log. Returns whether it saved."""
        if state.version != self.version:
            raise ValueError(
                f"the state has folded {state.version} facts but stream {self.stream!r} holds {self.version}: "
                "snapshot only a state whose facts were all appended"
            )
        if state.version - self.snapshot_version < self.snapshot_every:
            return False
        self.recorder.save_snapshot(self.stream, state.version, encode_state(state))
        self.snapshot_version = state.version
        return True

    def close(self) -> None:
        """Close the recorder underneath (idempotent)."""
        self.recorder.close()
