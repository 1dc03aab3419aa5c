"""Trainer liveness through the store: heartbeat counters, and waits that notice dead peers.

A rank that was SIGKILLed stops incrementing its counter at once; a gloo collective with it
usually fails within milliseconds but sometimes only at the collective timeout, and a store
wait never fails at all. So every wait for peers polls the store and checks the counters of
the ranks it waits on: a counter that has not moved for `peer_timeout_s` means the rank is
dead, and the wait raises `PeerDied` naming it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import structlog
import torch.distributed as dist

log = structlog.get_logger("dynaresized.backends.torch")


class PeerDied(RuntimeError):
    """Ranks stopped heartbeating while this rank waited on them."""

    def __init__(self, ranks: Iterable[int], what: str, names: Callable[[int], str] = str) -> None:
        self.ranks = tuple(sorted(ranks))
        self.what = what
        super().__init__(f"{', '.join(f'rank {r} ({names(r)})' for r in self.ranks)} stopped heartbeating "
                         f"during {what}")


class WaitTimeout(TimeoutError):
    pass


def heartbeat_key(prefix: str, rank: int) -> str:
    return f"{prefix}/hb/{rank}"


class Heartbeat:
    """Increments this rank's counter every `interval_s` on its own store connection."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, interval_s: float) -> None:
        self._store = store
        self._key = heartbeat_key(prefix, rank)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._store.add(self._key, 1)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._store.add(self._key, 1)
            except Exception as exc:  # the store host is gone: peers will declare us dead, say why here
                log.error("heartbeat failed; stopping it", key=self._key, error=str(exc))
                return


class LivenessWatch:
    """Tracks when each watched rank's heartbeat counter last moved (monotonic clock)."""

    def __init__(self, store: dist.Store, prefix: str, peer_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._prefix = prefix
        self.peer_timeout_s = peer_timeout_s
        self._clock = clock
        self._seen: dict[int, tuple[int, float]] = {}

    def sample(self, ranks: Iterable[int]) -> None:
        now = self._clock()
        for r in ranks:
            value = self._store.add(heartbeat_key(self._prefix, r), 0)  # add(0) reads without racing a set
            last = self._seen.get(r)
            if last is None or last[0] != value:
                self._seen[r] = (value, now)

    def dead(self, ranks: Iterable[int]) -> list[int]:
        """Ranks (already sampled) whose counter has not moved for `peer_timeout_s`."""
        now = self._clock()
        return [r for r in ranks if r in self._seen and now - self._seen[r][1] > self.peer_timeout_s]

    def observe(self, ranks: Iterable[int], poll_s: float = 0.05) -> list[int]:
        """Watch `ranks` for one full `peer_timeout_s` and return those that did not heartbeat."""
        ranks = list(ranks)
        self.forget(ranks)
        self.sample(ranks)
        deadline = self._clock() + self.peer_timeout_s * 1.05
        while self._clock() < deadline:
            time.sleep(poll_s)
            self.sample(ranks)
        return self.dead(ranks)

    def forget(self, ranks: Iterable[int]) -> None:
        for r in ranks:
            self._seen.pop(r, None)

    def wait_until(self, ready: Callable[[], bool], *, watch: Callable[[], Iterable[int]], timeout_s: float,
                   what: str, names: Callable[[int], str] = str, poll_s: float = 0.005,
                   cancelled: Callable[[], str | None] | None = None) -> None:
        """Poll `ready()` until true; raise `PeerDied` if a rank in `watch()` dies first,
        `WaitTimeout` after `timeout_s`, or `Cancelled` when `cancelled()` returns a reason."""
        deadline = self._clock() + timeout_s
        self.forget(list(watch()))
        delay = poll_s
        while True:
            if ready():
                return
            if cancelled is not None:
                reason = cancelled()
                if reason is not None:
                    raise Cancelled(f"{what}: {reason}")
            waiting = list(watch())
            self.sample(waiting)
            dead = self.dead(waiting)
            if dead:
                raise PeerDied(dead, what, names)
            if self._clock() > deadline:
                raise WaitTimeout(f"{what}: not done within {timeout_s:.1f}s (waiting on ranks "
                                  f"{', '.join(f'{r} ({names(r)})' for r in waiting) or 'none'})")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)  # quick for the common case, cheap when a step is long


class Cancelled(RuntimeError):
    pass
