"""The step boundary of a `TrainerRank`: where the group agrees on a membership change.

At every optimizer-step boundary the group's leader scans the posted changes, validates and
claims the oldest ready one by compare-and-set, and broadcasts its index with the stop step;
every member then applies it: leavers stop, the others meet the joiners in a store barrier,
take the group of the new membership, feed each joiner from its donor (see `transfer`),
compare digests and confirm the epoch in the store. A mixin of `TrainerRank`.

With several mini-batches per RL step there are boundaries inside the step: a rank lent to
training (a JOIN with plan LOAN) enters at the next one and, at the next RL-step boundary,
leaves again by itself: the leader claims a change that takes every lent member out (its id
ends in `/home`), so the group never waits for the daemon's RETURN, which then finds the rank
drained. A loan that reaches the leader at an RL-step boundary, where no boundary of the step
it was lent for is left, is refused with the reason.
"""

from __future__ import annotations

import time

import structlog
import torch

from dynaresized.backends.torch.communicators import CollectiveFailed, Group
from dynaresized.backends.torch.liveness import Cancelled, PeerDied, WaitTimeout
from dynaresized.backends.torch.membership import Change, ChangeState, ChangeStatus, Members, Topology
from dynaresized.backends.torch.rank_types import RankState, RestoreMode, SwitchRecord
from dynaresized.backends.torch.state import Digest, StateMismatch, digest
from dynaresized.backends.torch.transfer import assign_donors

log = structlog.get_logger("dynaresized.backends.torch")

class StepBoundary:
    """The membership part of a `TrainerRank`: the boundary, the switch, barriers and checks."""

    def _boundary(self) -> bool:
        """Agree on what happens before the next step. False when training is over."""
        assert self.group is not None
        claimed = 0
        try:
            decision = torch.zeros(2, dtype=torch.int64)
            if self.rank == self.members[0]:
                stop = self._stop_step()
                if stop < 0 or self.step < stop:  # no change is claimed at the last boundary
                    claimed = self._leader_scan()
                decision = torch.tensor([claimed, stop], dtype=torch.int64)
            self.group.broadcast(decision, self.members[0])
        except (CollectiveFailed, PeerDied, WaitTimeout) as exc:
            if claimed:
                cid = self.registry.indexed(claimed)
                assert cid is not None
                self.registry.settle(cid, ChangeState(ChangeStatus.FAILED, detail=f"the group failed: {exc}"))
            self._recover(exc)
            return True
        index, stop = int(decision[0]), int(decision[1])
        if stop >= 0 and self.step >= stop:
            if self.rank == self.members[0]:
                self.registry.finish(self.step)
            log.info("training finished", rank=self.rank, step=self.step)
            return False
        if index > 0:
            self._apply(index)
        return True

    def _stop_step(self) -> int:
        """The optimizer step to stop at (-1: none); stop requests and `steps_total` count RL steps."""
        stop = self.registry.stop_step()
        if self.config.steps_total is not None:
            stop = self.config.steps_total if stop < 0 else min(stop, self.config.steps_total)
        return stop * self.config.mini_batches if stop >= 0 else stop

    def _leader_scan(self) -> int:
        """The index of the next change to apply (claimed), or 0. Changes are taken in the
        order posted; one that is not ready yet (movers missing) holds back those after it.
        At an RL-step boundary, late loans are refused and lent members go home first."""
        if self.step % self.config.mini_batches == 0:
            self._refuse_late_loans()
            if self.lent:
                return self._claim_home()
        seq = self.registry.seq()
        i = self.cursor + 1
        while i <= seq:
            cid = self.registry.indexed(i)
            if cid is None:
                return 0  # posted but not published yet: next boundary
            st = self.registry.state(cid)
            if st is not None and st.status is ChangeStatus.PENDING:
                change = self.registry.change(cid)
                if not self.registry.ready(change, self.members):
                    return 0
                members, problem = self._validate(change)
                if problem:
                    self.registry.transition(cid, st, ChangeState(ChangeStatus.REJECTED, detail=problem))
                elif members == self.members:
                    self.registry.transition(cid, st, ChangeState(ChangeStatus.DONE, self.epoch, members,
                                                                  "no change needed"))
                else:
                    epoch = self.registry.new_epoch()
                    lent = tuple(sorted({r for r in self.lent if r in members} | set(change.add if change.loan else ())))
                    claim = ChangeState(ChangeStatus.APPLYING, epoch, members, before=self.members, lent=lent)
                    if self.registry.transition(cid, st, claim):
                        return i
                    continue  # cancelled meanwhile: look again
            elif st is not None and st.status is ChangeStatus.APPLYING:
                # claimed by a leader whose group then failed; recovery settles it as failed
                self.registry.settle(cid, ChangeState(ChangeStatus.FAILED, detail="the group failed while applying it"))
            self.cursor = i
            i += 1
        return 0

    def _refuse_late_loans(self) -> None:
        """Refuse every pending loan: this boundary starts a new RL step, and a loan is for the
        rest of the step it was lent in (it would go home right here)."""
        rl_step = self.step // self.config.mini_batches
        why = (f"no boundary left inside the training step: RL step {rl_step - 1} has ended (optimizer step "
               f"{self.step}); a loan joins only between two of a step's {self.config.mini_batches} mini-batches"
               if self.config.mini_batches > 1 else
               "the training step has no boundary inside it (mini_batches=1): a loan cannot join a step in progress")
        for i in range(self.cursor + 1, self.registry.seq() + 1):
            cid = self.registry.indexed(i)
            st = self.registry.state(cid) if cid is not None else None
            if st is not None and st.status is ChangeStatus.PENDING and self.registry.change(cid).loan:
                self.registry.transition(cid, st, ChangeState(ChangeStatus.REJECTED, detail=why))

    def _claim_home(self) -> int:
        """Post and claim the change that takes the lent members out at this RL-step boundary.
        It jumps the queue (changes posted before it wait for the next boundary), so `_apply`
        leaves the cursor where it is and the leader's next scan still finds them."""
        # the epoch in the id: a step redone after a recovery reaches this boundary again
        change = Change(cid=f"loans@{self.epoch}.{self.step}/home", remove=self.lent)
        for r in self.lent:
            self.registry.post(change, r)
        index = self._index_of(change.cid)
        st = self.registry.state(change.cid)
        members = change.result(self.members)
        claim = ChangeState(ChangeStatus.APPLYING, self.registry.new_epoch(), members, before=self.members)
        assert st is not None and self.registry.transition(change.cid, st, claim), f"{change.cid} changed under us"
        return index

    def _validate(self, change: Change) -> tuple[Members, str]:
        after = change.result(self.members)
        if not after:
            return after, "the training pool would have no trainer left"
        if len(after) > self.config.mini_batch_size:
            batch = (f"the global batch of {self.config.micro_batches}" if self.config.mini_batches == 1 else
                     f"a mini-batch of {self.config.mini_batch_size}")
            return after, f"{batch} micro-batches cannot be split over {len(after)} ranks"
        if change.expect is not None and after != change.expect:
            missing = tuple(sorted(set(change.expect) - set(after)))
            extra = tuple(sorted(set(after) - set(change.expect)))
            return after, (f"the daemon expects training on {self._fmt(change.expect)} but the trainers would be "
                           f"on {self._fmt(after)}" + (f"; not training: {self._fmt(missing)}" if missing else "")
                           + (f"; unexpected: {self._fmt(extra)}" if extra else ""))
        return after, ""

    def _apply(self, index: int) -> None:
        cid = self.registry.indexed(index)
        assert cid is not None
        change = self.registry.change(cid)
        st = self.registry.state(cid)
        if not cid.endswith("/home"):
            self.cursor = index
        # The others may already have finished (DONE) or failed (FAILED) it: a leaver does
        # not meet them, and a failure is settled by whoever sees it first.
        if st is None or st.epoch < 0:
            raise RuntimeError(f"change {cid} was broadcast for applying but its state is {st}")
        before = self.members
        if self.rank in change.remove:
            self._leave(change, st)
            return
        if st.status is ChangeStatus.FAILED:
            self._recover(RuntimeError(f"{cid} failed: {st.detail}"),
                          Topology(epoch=self.epoch, members=tuple(r for r in before if r in st.members),
                                   step=self.step))
            return
        joiners = tuple(r for r in st.members if r not in before)
        sources = tuple(r for r in before if r in st.members)
        try:
            report = self._switch(st.members, st.epoch, joiners, sources, cid, lent=st.lent)
        except Cancelled as exc:
            # A mover gave up before everyone met (its join failed): no group of the new
            # membership was touched, so the old one goes on as it was, unless the change
            # also took ranks out (they have left already) or the failure was a member's.
            log.warning("membership change abandoned before the switch", rank=self.rank, change=cid, error=str(exc))
            if set(before) - set(st.members):
                self._recover(exc, Topology(epoch=self.epoch, members=sources, step=self.step))
            else:
                self._set_view(RankState.TRAINING)
            return
        except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch) as exc:
            established = self.registry.arrived(f"est{st.epoch}", st.members)
            if not established:
                self.registry.settle(cid, ChangeState(ChangeStatus.FAILED, detail=str(exc)))
                base = Topology(epoch=self.epoch, members=sources, step=self.step)
            else:  # everyone had confirmed it: the new epoch stands, the failure came after
                self._adopt_epoch(st.members, st.epoch, joiners, sources, lent=st.lent)
                base = None
            self._recover(exc, base)
            return
        self.registry.settle(cid, ChangeState(ChangeStatus.DONE, st.epoch, st.members, report, before=before,
                                              lent=st.lent))
        log.info("membership changed", rank=self.rank, change=cid, epoch=st.epoch, before=list(before),
                 after=list(st.members), step=self.step, detail=report)

    def _leave(self, change: Change, st: ChangeState) -> None:
        detail = (f"left the training group at the step-{self.step} boundary; {self._fmt(st.members)} continue "
                  f"at epoch {st.epoch}")
        self.group, self.members, self.epoch, self.lent = None, (), -1, ()
        # A drained rank keeps its device and state (a rollback may resume it); an evicted
        # one gives the device back at once.
        evicted = change.cid.endswith("/evict")
        if evicted:
            detail += "; " + self._release_state()
        self._set_view(RankState.IDLE if evicted else RankState.DRAINED)
        log.info("left training group", rank=self.rank, change=change.cid, step=self.step)
        self._notify(change.cid, detail)

    def _switch(self, members: Members, epoch: int, joiners: Members, sources: Members, cid: str, *,
                lent: Members = ()) -> str:
        """Members' side of a change: meet, take the group, feed joiners, check, move on."""
        t0 = time.perf_counter()
        self._barrier(members, f"e{epoch}", f"the switch to epoch {epoch} ({cid})", self.config.collective_timeout_s,
                      cid=cid)
        t1 = time.perf_counter()
        builds = self.comms.stats.builds
        group = self.comms.group(members)
        t2 = time.perf_counter()
        donors = assign_donors(sources, joiners, self.config.node_of) if joiners else {}
        eager = self.config.restore is RestoreMode.EAGER
        sent = 0
        for joiner, donor in donors.items():
            if donor == self.rank:
                sent += self._feed(group, joiner, epoch, members, with_optimizer=eager)
        t3 = time.perf_counter()
        if joiners:  # a leave moves nothing: the remaining states were equal and still are
            tensors = self.state.all_tensors() if eager else self.state.param_tensors()
            self._verify(group, tensors, f"states after joining {self._fmt(joiners)}")
        self._confirm(members, epoch)
        t4 = time.perf_counter()
        self._adopt_epoch(members, epoch, joiners, sources, group, lent=lent)
        self.switches.append(SwitchRecord(epoch, members, joiners, "donor" if sent else "member", t1 - t0, t2 - t1,
                                          t3 - t2, t4 - t3, sent, self.comms.stats.builds > builds))
        report = (f"epoch {epoch}: {self._fmt(members)} from step {self.step}; barrier {1e3 * (t1 - t0):.1f} ms, "
                  f"group {1e3 * (t2 - t1):.1f} ms, transfer {1e3 * (t3 - t2):.1f} ms"
                  + (f" ({sent / 1e6:.1f} MB sent)" if sent else "") + f", verify {1e3 * (t4 - t3):.1f} ms")
        return report

    def _confirm(self, members: Members, epoch: int, cid: str | None = None) -> None:
        """The new epoch stands once every member has checked the states and said so in the
        store. Marks are never withdrawn, so a rank that later finds a member dead can still
        tell whether the epoch had been confirmed by all (see `_apply`)."""
        self._barrier(members, f"est{epoch}", f"confirming epoch {epoch}", self.config.collective_timeout_s, cid=cid)

    def _adopt_epoch(self, members: Members, epoch: int, joiners: Members, sources: Members,
                     group: Group | None = None, *, lent: Members = ()) -> None:
        eager = self.config.restore is RestoreMode.EAGER
        has_state = self.state.has_optimizer_state or bool(self._restoring)
        restoring = () if eager or not joiners or not has_state else tuple(
            sorted(assign_donors(sources, joiners, self.config.node_of).items()))
        old = self.registry.topology()
        self.group, self.members, self.epoch, self._restoring, self.lent = group, members, epoch, restoring, lent
        if self.rank == members[0]:
            self.registry.establish(old, Topology(epoch=epoch, members=members, step=self.step, restoring=restoring))
        self._set_view(RankState.TRAINING)

    def _verify(self, group: Group, tensors: list[torch.Tensor], what: str, *, step_too: bool = True) -> Digest:
        mine = digest(tensors, staging=self.staging)
        rows = group.all_gather(mine.as_tensor(self.step if step_too else 0))
        values = [tuple(int(x) for x in r.tolist()) for r in rows]
        if len(set(values)) != 1:
            desc = "; ".join(f"rank {m}: crc32 {v[0] & 0xffffffff:08x}, {v[1]} bytes, step {v[2]}"
                             for m, v in zip(group.members, values, strict=True))
            raise StateMismatch(f"{what} differ across the group: {desc}")
        return mine

    def _barrier(self, members: Members, tag: str, what: str, timeout_s: float, *, cid: str | None = None) -> None:
        self.registry.arrive(tag, self.rank)

        def cancelled() -> str | None:
            if cid is None:
                return None
            st = self.registry.state(cid)
            return f"the change was {st.status.value}: {st.detail}" if st is not None and st.status in (
                ChangeStatus.FAILED, ChangeStatus.CANCELLED) else None

        self.watch.wait_until(lambda: self.registry.arrived(tag, members),
                              watch=lambda: self.registry.missing(tag, members), timeout_s=timeout_s,
                              what=what, names=self._names, cancelled=cancelled)
