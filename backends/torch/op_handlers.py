"""The daemon-facing side of a `TrainerRank`: one handler per `OpKind` for the worker client.

Handlers run on the client's event loop and never touch a process group: they post membership
changes to the store (drain, evict), or hand the loop an intent (join, release, reclaim) and
await its outcome, which the loop resolves (`_run_intent`). A mixin of `TrainerRank`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from dynaresized.backends.torch.membership import Change, ChangeState, ChangeStatus, Members
from dynaresized.backends.torch.rank_types import NotReady, RankState
from dynaresized.client import op_handlers
from dynaresized.domain import OpKind, PlanKind

log = structlog.get_logger("dynaresized.backends.torch")

OpHandler = Callable[[Any], Awaitable[str]]


class _Intent(msgspec.Struct):
    kind: str  # "join" | "release" | "reclaim" | "home" (lending.py)
    future: concurrent.futures.Future  # type: ignore[type-arg]
    change: Change | None = None
    deadline: float = 0.0


class DaemonOps:
    """The op-handler part of a `TrainerRank`, and the intents it hands the loop."""

    def _run_intent(self, intent: _Intent) -> None:
        before = self._view.state
        try:
            if intent.kind == "join":
                detail = self._join(intent)
            elif intent.kind == "release":
                detail = self._release_state()
                self._set_view(RankState.IDLE)
            elif intent.kind == "reclaim":
                detail = self._reclaim_storage()
                self._set_view(RankState.DRAINED)
            elif intent.kind == "home":
                detail = self._come_home()
            else:
                raise ValueError(f"unknown intent {intent.kind!r}")
        except Exception as exc:
            if self._view.state is RankState.JOINING:  # whatever failed, this rank is not a member
                self.group, self.members, self.epoch = None, (), -1
                self._set_view(before)
            _resolve(intent.future, exc=exc)
            return
        _resolve(intent.future, detail)

    def _release_state(self) -> str:
        if self._offload_dir is None:
            return "state kept in place (no offload_dir)"
        if self.state.released is not None:
            return f"state already parked in {self.state.released}"
        path = self._offload_dir / f"rank{self.rank}-{time.time_ns()}.state"
        t0 = time.perf_counter()
        written = self.state.release(path, self.staging)
        return (f"state parked in {path} ({written / 1e6:.1f} MB through a {self.staging.budget_bytes >> 20} MiB "
                f"staging buffer in {time.perf_counter() - t0:.2f} s) and freed")

    def _reclaim_storage(self) -> str:
        if self.state.released is None:
            return "state was in place"
        path = self.state.released
        t0 = time.perf_counter()
        read = self.state.reclaim(self.staging)
        return f"state restored in place from {path} ({read / 1e6:.1f} MB in {time.perf_counter() - t0:.2f} s)"

    def _submit(self, kind: str, change: Change | None = None, deadline: float = 0.0) -> concurrent.futures.Future:  # type: ignore[type-arg]
        future: concurrent.futures.Future = concurrent.futures.Future()  # type: ignore[type-arg]
        if self._view.state in (RankState.FINISHED, RankState.FAILED):
            raise NotReady(f"trainer rank {self.rank} has stopped ({self._view.state.value})"
                           + (f": {self.fatal}" if self.fatal else ""))
        self._intents.put(_Intent(kind=kind, future=future, change=change, deadline=deadline))
        return future

    def _waiter(self, cid: str) -> concurrent.futures.Future:  # type: ignore[type-arg]
        future: concurrent.futures.Future = concurrent.futures.Future()  # type: ignore[type-arg]
        with self._waiters_lock:
            self._waiters.setdefault(cid, []).append(future)
        return future

    def _notify(self, cid: str, detail: str) -> None:
        with self._waiters_lock:
            futures = self._waiters.pop(cid, [])
        for f in futures:
            _resolve(f, detail)

    def _fail_all(self, exc: BaseException) -> None:
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            for f in futures:
                _resolve(f, exc=exc)

    def _ranks(self, devices: tuple[str, ...]) -> Members:
        return tuple(sorted(self.config.rank_of(d) for d in devices if d in self.config.devices))

    def _expect(self, op: Any) -> Members:
        unknown = [d for d in op.training if d not in self.config.devices]
        if unknown:
            raise ValueError(f"{op.kind.value} {op.op_id}: training pool names devices without a trainer in this "
                             f"job: {unknown}")
        return self._ranks(tuple(op.training))

    def _movers(self, op: Any) -> Members:
        movers = self._ranks(tuple(op.devices))
        if self.rank not in movers:
            raise ValueError(f"{op.kind.value} {op.op_id} names devices {list(op.devices)}, not this rank's "
                             f"{self.config.device}")
        return movers

    async def _call(self, fn: Callable[[], Any]) -> Any:
        def locked() -> Any:
            with self._handler_lock:
                return fn()
        return await asyncio.to_thread(locked)

    async def join(self, op: Any) -> str:
        """JOIN: enter the training group at the members' next step boundary. With plan LOAN the
        rank is lent for the rest of the RL step: it enters at the next boundary inside the step
        (refused if none is left) and leaves by itself at the step's end. A rank lent to the
        rollout (parked) comes home instead (lending.py)."""
        if self.parked:
            return await self._unpark(op)
        movers = self._movers(op)
        expect = self._expect(op)
        if self._view.state is RankState.TRAINING and self.rank in self._view.members:
            return f"already training in epoch {self._view.epoch} {self._fmt(self._view.members)}"
        if self._view.state not in (RankState.IDLE, RankState.DRAINED):
            raise NotReady(f"join {op.op_id}: rank {self.rank} is {self._view.state.value}")
        change = Change(cid=f"{op.resize_id}/join", add=movers, expect=expect, op_id=op.op_id,
                        loan=op.plan is PlanKind.LOAN)
        future = self._submit("join", change, deadline=time.time() + op.timeout_s)
        return await asyncio.wrap_future(future)

    async def restore(self, op: Any) -> str:
        """RESTORE: optimizer state, eagerly with the join or lazily at the first step."""
        self._movers(op)
        if self._view.state is not RankState.TRAINING:
            raise NotReady(f"restore {op.op_id}: rank {self.rank} has not joined (it is {self._view.state.value})")
        return self._restore_note or "optimizer state is this rank's own"

    async def commit(self, op: Any) -> str:
        """COMMIT: confirm the group trains on the membership the daemon committed."""
        expect = self._expect(op)
        if self.rank not in expect:
            raise NotReady(f"commit {op.op_id} was sent to rank {self.rank}, which is not in the committed training "
                           f"pool {self._fmt(expect)}")
        deadline = time.monotonic() + op.timeout_s
        while True:
            v = self._view
            if v.state is RankState.FINISHED and v.members == expect:
                # The last resize of a run may commit after the final step: nothing to switch.
                return f"training finished at step {v.step} on the committed membership (epoch {v.epoch})"
            if v.state is RankState.TRAINING and v.members == expect:
                n = self.config.mini_batch_size
                split = "/".join(str(len(range(i, n, len(expect)))) for i in range(len(expect)))
                per = f"{n} micro-batches" + (" per mini-batch" if self.config.mini_batches > 1 else "")
                return f"training on {self._fmt(expect)} in epoch {v.epoch} since step {v.step}: {per} split {split}"
            if v.state in (RankState.FAILED, RankState.FINISHED) or time.monotonic() > deadline:
                raise NotReady(f"commit {op.op_id}: the daemon committed {self._fmt(expect)} but this rank is "
                               f"{v.state.value} on {self._fmt(v.members)} (epoch {v.epoch})")
            await asyncio.sleep(0.01)

    async def drain(self, op: Any) -> str:
        """DRAIN: leave the training group at the next optimizer-step boundary. With plan LOAN
        the rank is lent to the rollout between two RL steps and stays a member (lending.py)."""
        if op.plan is PlanKind.LOAN:
            return await self._park(op)
        movers = self._movers(op)
        if self._view.state is RankState.DRAINED:
            return f"already drained at step {self._view.step}"
        if self._view.state is not RankState.TRAINING:
            raise NotReady(f"drain {op.op_id}: rank {self.rank} is not training ({self._view.state.value})")
        change = Change(cid=f"{op.resize_id}/drain", remove=movers, expect=self._expect(op), op_id=op.op_id)
        return await self._leave_request(change)

    async def _leave_request(self, change: Change) -> str:
        future = self._waiter(change.cid)
        await self._call(lambda: self._handler_registry.post(change, self.rank))
        while True:
            done, _ = await asyncio.wait({asyncio.wrap_future(future)}, timeout=0.05)
            if done:
                return done.pop().result()
            st = await self._call(lambda: self._handler_registry.state(change.cid))
            if st is not None and st.status in (ChangeStatus.REJECTED, ChangeStatus.FAILED, ChangeStatus.CANCELLED):
                raise NotReady(f"{change.cid} was {st.status.value}: {st.detail}")
            if st is not None and st.status is ChangeStatus.DONE and self.rank not in st.members:
                # left by another change first (a lent rank goes home at the RL-step boundary)
                return f"not in the training group ({self._view.state.value} at step {self._view.step}): {st.detail}"
            if self._view.state is RankState.DRAINED and not future.done():
                # left by another change while this one waits (a lent rank goes home at the
                # RL-step boundary by itself): out of the group is what was asked; the leader
                # settles this change at its next boundary, with nothing left to do
                return f"left the training group at the step-{self._view.step} boundary by another change"
            if self._view.state in (RankState.FAILED, RankState.FINISHED):
                raise NotReady(f"rank {self.rank} stopped ({self._view.state.value}) before leaving")

    async def release(self, op: Any) -> str:
        """RELEASE: give the device up; the state is parked in host memory if configured."""
        self._movers(op)
        if self._view.state is RankState.IDLE:
            return "not holding the device (idle)"
        if self._view.state is not RankState.DRAINED:
            raise NotReady(f"release {op.op_id}: rank {self.rank} must be drained first (it is "
                           f"{self._view.state.value})")
        return await asyncio.wrap_future(self._submit("release"))

    async def reclaim(self, op: Any) -> str:
        """RECLAIM (undo RELEASE): take the device back and restore the parked state in place."""
        self._movers(op)
        if self._view.state is RankState.DRAINED:
            return "still holding the device (release never happened)"
        if self._view.state is not RankState.IDLE:
            raise NotReady(f"reclaim {op.op_id}: rank {self.rank} is {self._view.state.value}")
        return await asyncio.wrap_future(self._submit("reclaim"))

    async def _cancel_if_pending(self, cid: str, op: Any) -> bool:
        """Undo ops first try to cancel the change they undo: True if it had not taken effect yet."""
        st = await self._call(lambda: self._handler_registry.state(cid))
        if st is None or st.status is not ChangeStatus.PENDING:
            return False
        final = await self._call(lambda: self._handler_registry.settle(
            cid, ChangeState(ChangeStatus.CANCELLED, detail=f"cancelled by {op.op_id}")))
        return final.status is ChangeStatus.CANCELLED

    async def resume(self, op: Any) -> str:
        """RESUME (undo DRAIN): train again; a pending drain is cancelled, a done one is
        undone by re-joining with a state transfer (the others may have stepped on). A rank
        lent to the rollout comes home."""
        if self.parked:
            return await self._unpark(op)
        movers = self._movers(op)
        if self._view.state is RankState.FINISHED:
            return f"training finished at step {self._view.step}: nothing to resume"
        if await self._cancel_if_pending(f"{op.resize_id}/drain", op) and self._view.state is RankState.TRAINING:
            return "drain cancelled before it took effect; still training"
        # (a cancelled drain whose rank left by another change meanwhile, a lent rank gone
        # home at the RL-step boundary, is not training: it joins again, as below)
        if self._view.state is RankState.TRAINING:
            return f"training in epoch {self._view.epoch} {self._fmt(self._view.members)}"
        if self._view.state not in (RankState.DRAINED, RankState.IDLE):
            raise NotReady(f"resume {op.op_id}: rank {self.rank} is {self._view.state.value}")
        # one change for every rank the op resumes (each posts the same); the leader waits only
        # for those not training already
        change = Change(cid=f"{op.resize_id}/resume", add=movers, op_id=op.op_id)
        return await asyncio.wrap_future(self._submit("join", change, deadline=time.time() + op.timeout_s))

    async def evict(self, op: Any) -> str:
        """EVICT (undo JOIN): a pending join is cancelled; a done one leaves at the next boundary.
        With plan RETURN a rank home from the rollout whose step has not begun is lent again."""
        self._movers(op)
        if op.plan is PlanKind.RETURN and (again := await self._park_again(op)):
            return again
        if await self._cancel_if_pending(f"{op.resize_id}/join", op):
            return "join cancelled before it took effect"
        deadline = time.monotonic() + op.timeout_s
        while self._view.state is RankState.JOINING and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the join is being applied: let it finish, then leave
        if self._view.state is not RankState.TRAINING:
            return f"not in the training group ({self._view.state.value}); nothing to evict"
        change = Change(cid=f"{op.resize_id}/evict", remove=(self.rank,), op_id=op.op_id)
        detail = await self._leave_request(change)
        if self._view.state is RankState.DRAINED:  # a lent rank went home first: give the device back too
            detail += "; " + await asyncio.wrap_future(self._submit("release"))
        return detail

    def handlers(self) -> dict[OpKind, OpHandler]:
        return op_handlers(self)


def _resolve(future: concurrent.futures.Future, result: Any = None, *, exc: BaseException | None = None) -> None:  # type: ignore[type-arg]
    if future.done():
        # The handler gave up (its op timed out and was reported as failed); the outcome is
        # in the log line of whoever finished the work.
        log.info("op outcome arrived after its handler gave up", result=str(exc or result)[:200])
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        log.info("op outcome arrived after its handler gave up", result=str(exc or result)[:200])

