"""State transfer between trainer ranks: the donor's side (`_feed`), the joiner's side
(`_receive`, `_join`: post, wait for the claim, receive, check, confirm) and the lazy optimizer
restore at the first step of a new epoch. A mixin of `TrainerRank`; `assign_donors` is the
pure rule every member applies to pick each joiner's donor.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from dynaresized.backends.torch.communicators import CollectiveFailed, Group
from dynaresized.backends.torch.liveness import Cancelled, PeerDied, WaitTimeout
from dynaresized.backends.torch.membership import Change, ChangeState, ChangeStatus, Members
from dynaresized.backends.torch.op_handlers import _Intent
from dynaresized.backends.torch.rank_types import JoinFailed, RankState, SwitchRecord, TransferPath
from dynaresized.backends.torch.staging import StagingBuffer
from dynaresized.backends.torch.state import (
    Outline,
    StateMismatch,
    recv_outline,
    recv_tensors,
    send_outline,
    send_tensors,
)

log = structlog.get_logger("dynaresized.backends.torch")

_TAG_OUTLINE = 1000
_TAG_PARAMS = 1100
_TAG_OPTIMIZER = 1200


def assign_donors(sources: Members, joiners: Members, node_of: Callable[[int], str]) -> dict[int, int]:
    """A donor for each joiner: a source on the joiner's node if any, the least loaded first,
    then the lowest rank. Deterministic, so every member computes the same map."""
    if not sources:
        raise ValueError("no member holds the state a joiner needs")
    load = dict.fromkeys(sources, 0)
    donors = {}
    for j in sorted(joiners):
        local = [s for s in sources if node_of(s) == node_of(j)]
        donor = min(local or sources, key=lambda s: (load[s], s))
        donors[j] = donor
        load[donor] += 1
    return donors


class StateTransfer:
    """The donor/joiner part of a `TrainerRank`."""

    def _transfer_staging(self) -> StagingBuffer | None:
        path = self.config.transfer
        if path is TransferPath.AUTO:
            path = TransferPath.STAGED if (self.device.type == "cuda" and self.config.backend == "gloo") \
                else TransferPath.DIRECT
        return self.staging if path is TransferPath.STAGED else None

    def _feed(self, group: Group, joiner: int, epoch: int, members: Members, *, with_optimizer: bool,
              everything: bool = False) -> int:
        """Donor side: the outline, then parameters (and optimizer state) in the fixed order."""
        staging = self._transfer_staging()
        outline = self.state.outline(epoch=epoch, step=self.step, members=members,
                                     with_optimizer=with_optimizer or everything,
                                     transfer="staged" if staging else "direct", chunk_bytes=self.staging.budget_bytes)
        send_outline(group, joiner, outline, _TAG_OUTLINE)
        sent = send_tensors(group, joiner, self.state.param_tensors(), _TAG_PARAMS, staging)
        if outline.with_optimizer:
            sent += send_tensors(group, joiner, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
        return sent

    def _receive(self, group: Group, donor: int) -> Outline:
        """Joiner side: check the outline against our model, then receive in place."""
        outline = recv_outline(group, donor, _TAG_OUTLINE)
        self.state.check_outline(outline)
        if outline.transfer == "staged" and outline.chunk_bytes != self.staging.budget_bytes:
            raise StateMismatch(f"donor stages in chunks of {outline.chunk_bytes} bytes, this rank in "
                                f"{self.staging.budget_bytes}: staging_bytes must be equal on all ranks")
        self._reclaim_storage()
        self.state.adopt_optimizer_layout(outline)
        staging = self.staging if outline.transfer == "staged" else None
        recv_tensors(group, donor, self.state.param_tensors(), _TAG_PARAMS, staging)
        if outline.with_optimizer:
            recv_tensors(group, donor, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
        self.step = outline.step
        return outline

    def _join(self, intent: _Intent) -> str:
        """An idle (or drained) rank enters the training group: post, wait for the members
        to reach a boundary and claim the change, then receive and check the state."""
        change = intent.change
        assert change is not None
        self._set_view(RankState.JOINING)
        reg = self.registry
        reg.post(change, self.rank)
        t0 = time.perf_counter()
        st = self._await_claim(change, intent.deadline)
        if st.status is ChangeStatus.DONE:  # nothing to change (already a member)
            self._set_view(RankState.TRAINING)
            return st.detail
        if st.status is not ChangeStatus.APPLYING:
            self._set_view(RankState.IDLE)
            raise JoinFailed(f"join of {self._fmt((self.rank,))} {st.status.value}: {st.detail}")
        members, epoch = st.members, st.epoch
        sources = tuple(r for r in st.before if r in members)
        joiners = tuple(r for r in members if r not in st.before)
        try:
            t1 = time.perf_counter()
            self._barrier(members, f"e{epoch}", f"the join of epoch {epoch} ({change.cid})",
                          max(1.0, intent.deadline - time.time()), cid=change.cid)
            t2 = time.perf_counter()
            builds = self.comms.stats.builds
            group = self.comms.group(members)
            t3 = time.perf_counter()
            donor = assign_donors(sources, joiners, self.config.node_of)[self.rank]
            outline = self._receive(group, donor)
            t4 = time.perf_counter()
            tensors = self.state.all_tensors() if outline.with_optimizer else self.state.param_tensors()
            self._verify(group, tensors, f"states after joining {self._fmt(joiners)}")
            self._confirm(members, epoch, change.cid)
            t5 = time.perf_counter()
        except (CollectiveFailed, PeerDied, WaitTimeout, StateMismatch, Cancelled) as exc:
            if not (isinstance(exc, (PeerDied, WaitTimeout)) and self.registry.arrived(f"est{epoch}", members)):
                self.registry.settle(change.cid, ChangeState(ChangeStatus.FAILED, detail=str(exc)))
                self.comms.taint(members, f"join failed: {exc}")
                self.group, self.members, self.epoch = None, (), -1
                self._set_view(RankState.IDLE)
                raise JoinFailed(f"join of {self._fmt((self.rank,))} into epoch {epoch} {self._fmt(members)} "
                                 f"failed: {exc}") from exc
            # every member had confirmed the epoch: this rank is in, and the failure is the
            # group's to recover from, which it does at its next collective
            t5 = time.perf_counter()
            log.warning("a member failed right after the join was confirmed", rank=self.rank, error=str(exc))
        self.step = outline.step
        self._restoring = ()
        self._adopt_epoch(members, epoch, joiners, sources, group, lent=st.lent)
        self.switches.append(SwitchRecord(epoch, members, joiners, "joiner", t2 - t1, t3 - t2, t4 - t3, t5 - t4,
                                          outline.param_bytes + (outline.optimizer_bytes if outline.with_optimizer
                                                                 else 0), self.comms.stats.builds > builds))
        self._joined_at_boundary = True
        self.cursor = max(self.cursor, self._index_of(change.cid))
        opt_mb = outline.optimizer_bytes / 1e6
        self._restore_note = (f"optimizer state ({opt_mb:.1f} MB) restored with the parameters, verified"
                              if outline.with_optimizer else
                              f"optimizer state ({opt_mb:.1f} MB) from rank {donor} at the first step of epoch {epoch}"
                              if outline.optimizer else "no optimizer state yet (no step taken)")
        return (f"joined epoch {epoch} as rank {self.rank} of {self._fmt(members)} at step {self.step}: "
                f"{outline.param_bytes / 1e6:.1f} MB of parameters"
                + (f" + {opt_mb:.1f} MB optimizer state" if outline.with_optimizer else "")
                + f" from rank {donor} ({self._names(donor)}), verified; waited {t1 - t0:.2f} s for a step boundary, "
                f"barrier {1e3 * (t2 - t1):.1f} ms, group {1e3 * (t3 - t2):.1f} ms, transfer {1e3 * (t4 - t3):.1f} ms, "
                f"verify {1e3 * (t5 - t4):.1f} ms")

    def _index_of(self, cid: str) -> int:
        for i in range(self.registry.seq(), 0, -1):
            if self.registry.indexed(i) == cid:
                return i
        return 0

    def _await_claim(self, change: Change, deadline: float) -> ChangeState:
        holder: list[ChangeState] = []

        def settled() -> bool:
            st = self.registry.state(change.cid)
            if st is not None and st.status is not ChangeStatus.PENDING:
                holder.append(st)
                return True
            return False

        def finished() -> str | None:
            return "training has finished" if self.registry.finished() is not None else None

        try:
            self.watch.wait_until(settled, watch=lambda: (), timeout_s=max(0.0, deadline - time.time()),
                                  what=f"waiting for the members to take {change.cid} at a step boundary",
                                  names=self._names, cancelled=finished)
        except (WaitTimeout, Cancelled) as exc:
            why = "training finished" if isinstance(exc, Cancelled) else "the join timed out before a step boundary"
            cancelled = ChangeState(ChangeStatus.CANCELLED, detail=why)
            final = self.registry.settle(change.cid, cancelled)
            if final.status is not ChangeStatus.APPLYING:
                self._set_view(RankState.IDLE)
                raise JoinFailed(str(exc)) from exc
            holder.append(final)
        return holder[-1]

    def _lazy_restore(self) -> None:
        """At the first step of an epoch that took in joiners: donors send their optimizer
        state (which this step's update has not touched yet), then everyone checks it."""
        assert self.group is not None
        restoring, self._restoring = self._restoring, ()
        staging = self._transfer_staging()
        t0 = time.perf_counter()
        moved = 0
        for joiner, donor in restoring:
            if donor == self.rank:
                moved += send_tensors(self.group, joiner, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
            elif joiner == self.rank:
                moved += recv_tensors(self.group, donor, self.state.optimizer_tensors(), _TAG_OPTIMIZER, staging)
        t1 = time.perf_counter()
        self._verify(self.group, self.state.optimizer_tensors(), "optimizer states after the lazy restore")
        if moved:
            self.switches.append(SwitchRecord(self.epoch, self.members, tuple(j for j, _ in restoring), "restore",
                                              0.0, 0.0, t1 - t0, time.perf_counter() - t1, moved, False))
        if any(j == self.rank for j, _ in restoring):
            self._restore_note = (f"optimizer state ({moved / 1e6:.1f} MB) restored lazily at step {self.step} "
                                  f"in {1e3 * (time.perf_counter() - t0):.1f} ms, verified")
