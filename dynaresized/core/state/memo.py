"""Answers remembered per state: a pure function of some of a state's maps (`derived`), one of
items that grow at their end (`grown`), and the live workers per device (`owners`), carried
from state to state as facts change one worker at a time. Folds no fact."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from dynaresized.domain import DeviceId, Worker, WorkerId, WorkerKind, WorkerStatus


_DERIVED: dict[object, tuple[tuple[object, ...], object]] = {}
_T = TypeVar("_T")
_I = TypeVar("_I")


def derived(key: object, compute: Callable[[], _T], *sources: object) -> _T:
    """`compute()`, a pure function of `sources` (some of a state's maps), remembered for the
    latest `sources` per `key`. A state's maps are never changed in place (every fact makes
    new ones), so the same objects mean the same answer: the split and the pools are
    asked for several times per event and cost a pass over every device each (at 1,024
    devices most of a simulated run, `docs/simulator.md`). The entry holds `sources`, so their
    identities cannot be reused while remembered."""
    hit = _DERIVED.get(key)
    # Tuples compare their items by identity first, so the same maps answer in C; equal maps
    # that are other objects compare by value, which is as good (the answer is a function of it).
    if hit is not None and hit[0] == sources:
        return hit[1]  # type: ignore[return-value]
    value = compute()
    _DERIVED[key] = (sources, value)
    return value


_GROWN: dict[object, tuple[tuple[object, ...], tuple[object, ...], object]] = {}


def grown(key: object, items: tuple[_I, ...], compute: Callable[[tuple[_I, ...]], _T],
          extend: Callable[[_T, tuple[_I, ...]], _T], *sources: object) -> _T:
    """`compute(items)` remembered per `key`, like `derived`, for `items` that grow at their
    end while `sources` stay the same (an op's answers, a step's dry engines): the answer for
    a longer `items` is the last one passed to `extend` with only the new items (the prefix is
    compared in C), so T items arriving one at a time cost O(T), not O(T^2). `extend` may
    change the last answer in place: the shorter `items` it was for are not asked for again."""
    hit = _GROWN.get(key)
    if hit is not None:
        last, last_sources, value = hit
        if last_sources == sources and len(items) >= len(last) and items[:len(last)] == last:
            if len(items) > len(last):
                value = extend(value, items[len(last):])  # type: ignore[arg-type]
                _GROWN[key] = (items, sources, value)
            return value  # type: ignore[return-value]
    value = compute(items)
    _GROWN[key] = (items, sources, value)
    return value


_OWNERS: list[object] = [None, {}]  # [the workers map indexed, {(device, kind): live worker ids}]


def owners(workers: dict[WorkerId, Worker]) -> dict[tuple[DeviceId, WorkerKind], set[WorkerId]]:
    """The live workers per (device, kind) of `workers`, remembered for the latest map and
    carried along as facts change one worker at a time (`carry_owners`): a registration storm
    of W workers costs O(W), not O(W^2). Any other map is indexed afresh (one pass)."""
    if _OWNERS[0] is not workers:
        index: dict[tuple[DeviceId, WorkerKind], set[WorkerId]] = {}
        for w in workers.values():
            if w.status is WorkerStatus.LIVE:
                for d in w.devices:
                    index.setdefault((d, w.kind), set()).add(w.worker_id)
        _OWNERS[:] = [workers, index]
    return _OWNERS[1]  # type: ignore[return-value]


def carry_owners(old: dict[WorkerId, Worker], new: dict[WorkerId, Worker], worker_id: WorkerId) -> None:
    """`new` is `old` with `worker_id`'s entry set: move the index from `old` to `new` (if it
    was `old`'s) by that one change. The index then answers for `new` only."""
    if _OWNERS[0] is not old:
        return
    index: dict[tuple[DeviceId, WorkerKind], set[WorkerId]] = _OWNERS[1]  # type: ignore[assignment]
    was, now = old.get(worker_id), new[worker_id]
    if was is not None and was.status is WorkerStatus.LIVE:
        for d in was.devices:
            index.get((d, was.kind), set()).discard(worker_id)
    if now.status is WorkerStatus.LIVE:
        for d in now.devices:
            index.setdefault((d, now.kind), set()).add(worker_id)
    _OWNERS[:] = [new, index]
