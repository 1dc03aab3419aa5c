"""Fixtures for the event store tests: every recorder implementation, on real files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dynaresized.store import InMemoryRecorder, Recorder, SQLiteRecorder


class FakeClock:
    """A wall clock that moves only when told to."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


RecorderFactory = Callable[..., Recorder]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "sqlite"])
def make_recorder(request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock) -> Iterator[RecorderFactory]:
    """Opens a recorder of the parametrized kind; "reopen" means the same store again
    (the same object for memory, the same file for SQLite)."""
    opened: list[Recorder] = []
    memory = InMemoryRecorder(clock=clock)

    def make(**kw: object) -> Recorder:
        if request.param == "memory":
            recorder: Recorder = memory
        else:
            recorder = SQLiteRecorder(tmp_path / "events.sqlite", clock=clock, **kw)  # type: ignore[arg-type]
        opened.append(recorder)
        return recorder

    make.kind = request.param  # type: ignore[attr-defined]
    yield make
    for r in opened:
        r.close()


@pytest.fixture
def recorder(make_recorder: RecorderFactory) -> Recorder:
    return make_recorder()
