"""Recovery of a `TrainerRank` from a failed group: agree on the survivors (first proposal in
the store wins), rebuild or reuse their group, copy the most advanced complete state to any
survivor that differs, and carry on from a step boundary. A mixin of `TrainerRank`.
"""

from __future__ import annotations

import time

import structlog

from dynaresized.backends.torch.communicators import CollectiveFailed, Group
from dynaresized.backends.torch.liveness import PeerDied, WaitTimeout
from dynaresized.backends.torch.membership import Recovery, Topology
from dynaresized.backends.torch.rank_types import RankState, TrainingLost
from dynaresized.backends.torch.state import StateMismatch, digest

log = structlog.get_logger("dynaresized.backends.torch")

class GroupRecovery:
    """The failure part of a `TrainerRank`."""

    def _recover(self, exc: BaseException, base: Topology | None = None) -> None:
        """Survive a failed collective: agree on the survivors, rebuild, re-synchronise."""
        log.warning("training group failed; recovering", rank=self.rank, epoch=self.epoch, error=str(exc))
        self._recovered = True
        if self.group is not None:
            self.comms.taint(self.group.members, str(exc))
        self.group = None
        for attempt in range(len(self.config.devices) + 1):
            # The epoch this rank was in (not the store's latest): a survivor that notices
            # late must still meet the others at the same recovery record.
            topo = base or Topology(epoch=self.epoch, members=self.members, step=self.step)
            if self.rank not in topo.members:
                self._become_idle(f"not in the established membership after a failure ({exc})")
                return
            decision = self._decide_survivors(topo, exc)
            if decision.dead:
                self.comms.discard_containing(decision.dead, f"rank(s) {list(decision.dead)} died")
            if self.rank not in decision.members:
                self._become_idle(f"the survivors' decision left this rank out: {decision.reason}")
                return
            try:
                self._barrier(decision.members, f"r{decision.epoch}", f"recovery to epoch {decision.epoch}",
                              self.config.collective_timeout_s * 2 + self.config.peer_timeout_s)
                group = self.comms.group(decision.members)
                source = self._resync(group, decision)
            except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch) as again:
                log.warning("recovery failed; trying again", rank=self.rank, attempt=attempt, error=str(again))
                self.comms.taint(decision.members, str(again))
                exc = again
                base = Topology(epoch=decision.epoch, members=decision.members, step=self.step)
                continue
            self.group, self.members, self.epoch, self._restoring = group, decision.members, decision.epoch, ()
            self.lent = tuple(r for r in self.lent if r in decision.members)  # they still go home at the RL boundary
            if self.rank == decision.members[0]:
                self.registry.establish(self.registry.topology(),
                                        Topology(epoch=decision.epoch, members=decision.members, step=self.step))
            self._set_view(RankState.TRAINING)
            log.info("recovered", rank=self.rank, epoch=decision.epoch, members=list(decision.members),
                     dead=list(decision.dead), step=self.step, state_from=source)
            return
        raise TrainingLost(f"rank {self.rank} could not recover the training group: {exc}")

    def _decide_survivors(self, topo: Topology, exc: BaseException) -> Recovery:
        """Check in for the recovery of `topo.epoch`; the first rank to see every member
        either checked in or silent (dead, or gone: a drained rank never checks in) for the
        observation window proposes the ones that checked in. First proposal wins."""
        tag = f"rec{topo.epoch}"
        self.registry.arrive(tag, self.rank)
        window = self.config.peer_timeout_s * 2
        deadline = time.monotonic() + window
        self.watch.forget(topo.members)
        while True:
            decided = self.registry.recovery(topo.epoch)
            if decided is not None:
                return decided
            missing = self.registry.missing(tag, topo.members)
            self.watch.sample(missing)
            if not missing or set(self.watch.dead(missing)) == set(missing) or time.monotonic() > deadline:
                checked = tuple(r for r in topo.members if r not in missing)
                return self.registry.decide_recovery(Recovery(
                    from_epoch=topo.epoch, epoch=self.registry.new_epoch(), members=checked,
                    dead=tuple(missing), reason=str(exc)))
            time.sleep(0.02)

    def _resync(self, group: Group, decision: Recovery) -> int:
        """Make every survivor's state equal to the most advanced complete one."""
        complete = not any(j == self.rank for j, _ in self._restoring)
        mine = digest(self.state.all_tensors(), staging=self.staging)
        rows = [tuple(int(x) for x in r.tolist()) for r in group.all_gather(mine.as_tensor(self.step, complete))]
        candidates = [(row[2], -m) for m, row in zip(group.members, rows, strict=True) if row[3]]
        if not candidates:
            raise TrainingLost(f"no survivor of {self._fmt(group.members)} holds a complete state")
        source = -max(candidates)[1]
        src_row = rows[group.members.index(source)]
        behind = tuple(m for m, row in zip(group.members, rows, strict=True) if row[:3] != src_row[:3])
        for m in behind:
            if self.rank == source:
                self._feed(group, m, decision.epoch, decision.members, with_optimizer=True, everything=True)
            elif self.rank == m:
                self._receive(group, source)
        if behind:
            self._verify(group, self.state.all_tensors(), "states after the recovery re-sync")
        return source

    def _become_idle(self, why: str) -> None:
        log.warning("rank leaves training", rank=self.rank, why=why)
        self.group, self.members, self.epoch, self._restoring, self.lent = None, (), -1, (), ()
        self._set_view(RankState.IDLE)
