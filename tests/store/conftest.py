"""Fixtures for the event store tests: every recorder implementation, on real files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynaresized.store import InMemoryRecorder, Recorder, SQLiteRecorder


class FakeClock:
    """A wall clock that moves only when told to."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class RecorderFactory:
    """Opens recorders of one kind on one store: the same object for "memory", the same file
    for "sqlite" (so opening again is what a restarted daemon does)."""

    def __init__(self, kind: str, path: Path, clock: FakeClock) -> None:
        self.kind = kind
        self.path = path
        self.clock = clock
        self.opened: list[Recorder] = []
        self._memory = InMemoryRecorder(clock=clock)

    def __call__(self, **kw: Any) -> Recorder:
        recorder: Recorder
        if self.kind == "memory":
            recorder = self._memory
        else:
            recorder = SQLiteRecorder(self.path, clock=self.clock, **kw)
        self.opened.append(recorder)
        return recorder


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "sqlite"])
def make_recorder(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[RecorderFactory]:
    factory = RecorderFactory(request.param, tmp_path / "events.sqlite", clock)
    yield factory
    for r in factory.opened:
        r.close()


@pytest.fixture
def recorder(make_recorder: RecorderFactory) -> Recorder:
    return make_recorder()
