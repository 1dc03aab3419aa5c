"""Membership records of a training job in the store: change requests, epochs, recoveries.

The store is the one arbiter that outlives every trainer, so agreement goes through it:
* a rank that must enter or leave (on JOIN, DRAIN, EVICT, RESUME) posts a `Change`;
  the group's leader claims it at an optimizer-step boundary (compare-and-set
  pending -> applying) and tells the group with one broadcast, so all members apply the
  same change at the same step;
* an established epoch (`Topology`) is replaced by compare-and-set, never blindly;
* after a failure the first survivor's `Recovery` proposal wins (compare-and-set), and
  every survivor follows it.

Key layout under the job prefix: req/seq, req/<i> -> change id; chg/<id>, chg/<id>/state,
chg/<id>/ready/<rank>; topo; epoch/seq; rec/<epoch>; stop; finished; bar/<tag>/<rank>.
"""

from __future__ import annotations

import enum

import msgspec
import torch.distributed as dist

Members = tuple[int, ...]


class ChangeStatus(str, enum.Enum):
    PENDING = "pending"
    APPLYING = "applying"
    DONE = "done"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        return self not in (ChangeStatus.PENDING, ChangeStatus.APPLYING)


class Change(msgspec.Struct, frozen=True):
    """Ranks to add to and remove from the training group, at one step boundary."""

    cid: str  # "<resize id>/<op kind>": the same for every mover of one operation
    add: Members = ()
    remove: Members = ()
    expect: Members | None = None  # the membership the daemon expects afterwards (None: any)
    op_id: str = ""
    loan: bool = False  # the added ranks are lent for the rest of the RL step (a JOIN with plan LOAN)

    @property
    def movers(self) -> Members:
        return tuple(sorted(set(self.add) | set(self.remove)))

    def result(self, members: Members) -> Members:
        return tuple(sorted((set(members) | set(self.add)) - set(self.remove)))

    def moving(self, members: Members) -> Members:
        """The movers that would move from `members`: a rank it removes that has left already,
        or adds that is a member already, is not waited for. (A daemon's RETURN can reach one
        lent rank before the RL-step boundary, which posts a drain of all of them, and another
        after it, which has left by itself and posts nothing: that drain must not hold back
        every later change.)"""
        return tuple(sorted({r for r in self.add if r not in members} | {r for r in self.remove if r in members}))


class ChangeState(msgspec.Struct, frozen=True):
    status: ChangeStatus
    epoch: int = -1  # the epoch it creates (APPLYING, DONE)
    members: Members = ()  # the membership it creates (APPLYING, DONE)
    detail: str = ""
    before: Members = ()  # the membership it starts from (APPLYING, DONE)
    lent: Members = ()  # members of the new membership that are on loan, who leave at the RL-step boundary


class Topology(msgspec.Struct, frozen=True):
    """An established epoch: who trains, from which step; joiners whose optimizer state a
    donor restores lazily at the epoch's first step."""

    epoch: int
    members: Members
    step: int
    restoring: tuple[tuple[int, int], ...] = ()  # (joiner, donor)


class Recovery(msgspec.Struct, frozen=True):
    from_epoch: int
    epoch: int
    members: Members
    dead: Members
    reason: str


_enc = msgspec.msgpack.Encoder()


def reachable_memberships(devices: tuple[str, ...], initial: tuple[str, ...],
                          train_sizes: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    """Every training membership the daemon can reach from `initial` by resizing between
    `train_sizes`: the groups worth pre-warming. It follows the core's choice of devices
    (`plan_resize`: the highest device ids of the source pool move first, in string order),
    so a switch finds its group cached; a membership left out is built on demand."""
    unknown = set(initial) - set(devices)
    if unknown:
        raise ValueError(f"initial names devices not in devices: {sorted(unknown)}")
    sizes = sorted({k for k in train_sizes if 1 <= k <= len(devices)} | {len(initial)})
    start = frozenset(initial)
    seen = {start}
    todo = [start]
    while todo:
        training = todo.pop()
        rollout = sorted(set(devices) - training, reverse=True)
        for k in sizes:
            if k > len(training):
                nxt = training | set(rollout[: k - len(training)])
            elif k < len(training):
                nxt = training - set(sorted(training, reverse=True)[: len(training) - k])
            else:
                continue
            frozen = frozenset(nxt)
            if frozen not in seen:
                seen.add(frozen)
                todo.append(frozen)
    order = {d: i for i, d in enumerate(devices)}
    return tuple(sorted((tuple(sorted(m, key=order.__getitem__)) for m in seen), key=lambda m: (len(m), m)))


class Registry:
    """Reads and writes the records above. One instance per store connection (per thread)."""

    def __init__(self, store: dist.Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def _k(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def _get(self, key: str) -> bytes | None:
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key))

    def _cas(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Compare-and-set; returns the value now stored (ours if we won)."""
        return bytes(self.store.compare_set(key, expected, desired))

    # -- change requests ---------------------------------------------------------------
    def post(self, change: Change, by: int) -> bool:
        """Post `change` (idempotent across its movers) and mark `by` ready. True if this
        call created it."""
        record = _enc.encode(change)
        stored = self._cas(self._k("chg", change.cid), b"", record)
        if stored != record:
            raise ValueError(f"change {change.cid} was already posted with different content: "
                             f"{msgspec.msgpack.decode(stored, type=Change)} vs {change}")
        created = self.store.add(self._k("chg", change.cid, "posts"), 1) == 1  # exactly one mover publishes
        if created:
            self.store.set(self._k("chg", change.cid, "state"), _enc.encode(ChangeState(ChangeStatus.PENDING)))
            index = self.store.add(self._k("req", "seq"), 1)
            self.store.set(self._k("req", index), change.cid.encode())
        self.store.set(self._k("chg", change.cid, "ready", by), b"1")
        return created

    def change(self, cid: str) -> Change:
        data = self._get(self._k("chg", cid))
        if data is None:
            raise KeyError(f"no change {cid!r} in the store")
        return msgspec.msgpack.decode(data, type=Change)

    def state(self, cid: str) -> ChangeState | None:
        data = self._get(self._k("chg", cid, "state"))
        return None if data is None else msgspec.msgpack.decode(data, type=ChangeState)

    def ready(self, change: Change, members: Members) -> bool:
        """Every mover that would move from `members` has posted `change`."""
        return self.store.check([self._k("chg", change.cid, "ready", r) for r in change.moving(members)])

    def transition(self, cid: str, expected: ChangeState, new: ChangeState) -> bool:
        return self._cas(self._k("chg", cid, "state"), _enc.encode(expected), _enc.encode(new)) == _enc.encode(new)

    def settle(self, cid: str, new: ChangeState) -> ChangeState:
        """Move a change that is not final yet to `new` (keeping the epoch and memberships of
        a claim, for whoever reads it later); returns the state it ends in."""
        while True:
            current = self.state(cid)
            if current is None or current.status.final:
                return current or new
            final = new
            if new.epoch < 0 and current.epoch >= 0:
                final = msgspec.structs.replace(new, epoch=current.epoch, members=current.members,
                                                before=current.before)
            if self.transition(cid, current, final):
                return final

    def seq(self) -> int:
        return int(self.store.add(self._k("req", "seq"), 0))

    def indexed(self, index: int) -> str | None:
        data = self._get(self._k("req", index))
        return None if data is None else data.decode()

    # -- epochs ------------------------------------------------------------------------
    def new_epoch(self) -> int:
        return int(self.store.add(self._k("epoch", "seq"), 1))

    def topology(self) -> Topology | None:
        data = self._get(self._k("topo"))
        return None if data is None else msgspec.msgpack.decode(data, type=Topology)

    def establish(self, old: Topology | None, new: Topology) -> Topology:
        """Replace `old` by `new` unless someone already moved on; returns what is stored."""
        expected = b"" if old is None else _enc.encode(old)
        stored = self._cas(self._k("topo"), expected, _enc.encode(new))
        return msgspec.msgpack.decode(stored, type=Topology)

    def recovery(self, from_epoch: int) -> Recovery | None:
        data = self._get(self._k("rec", from_epoch))
        return None if data is None else msgspec.msgpack.decode(data, type=Recovery)

    def decide_recovery(self, proposal: Recovery) -> Recovery:
        stored = self._cas(self._k("rec", proposal.from_epoch), b"", _enc.encode(proposal))
        return msgspec.msgpack.decode(stored, type=Recovery)

    # -- trainers lent to the rollout (lending.py) ----------------------------------------
    def set_lent_out(self, rank: int, lent: bool) -> None:
        self.store.set(self._k("lentout", rank), b"1" if lent else b"0")

    def lent_out(self, ranks: Members) -> list[int]:
        """The ranks of `ranks` whose device serves the rollout now (parked between RL steps)."""
        return [r for r in ranks if self._get(self._k("lentout", r)) == b"1"]

    # -- barriers, stop, end -----------------------------------------------------------
    def arrive(self, tag: str, rank: int) -> None:
        self.store.set(self._k("bar", tag, rank), b"1")

    def arrived(self, tag: str, ranks: Members) -> bool:
        return self.store.check([self._k("bar", tag, r) for r in ranks])

    def missing(self, tag: str, ranks: Members) -> list[int]:
        return [r for r in ranks if not self.store.check([self._k("bar", tag, r)])]

    def request_stop(self, step: int) -> None:
        self.store.set(self._k("stop"), str(step).encode())

    def stop_step(self) -> int:
        data = self._get(self._k("stop"))
        return -1 if data is None else int(data)

    def finish(self, step: int) -> None:
        self.store.set(self._k("finished"), str(step).encode())

    def finished(self) -> int | None:
        data = self._get(self._k("finished"))
        return None if data is None else int(data)
