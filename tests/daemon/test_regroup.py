"""Regroups over real sockets: `dynaresized regroup` on a real daemon process makes two
one-device engines one engine of two and back, op by op to real worker clients; a failed op
rolls it back; the daemon killed mid-regroup finishes it from its log; an engine worker that
comes back running the wrong engine is converged."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from dynaresized import wire
from dynaresized.backends.sim import after_op
from dynaresized.cli import render_status
from dynaresized.client import OpRequest, WorkerClient
from dynaresized.core import facts as f
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, WorkerKind

from .conftest import DEVICES, read_facts, until

PAIR = (DEVICES[2], DEVICES[3])


class Engine:
    """A rollout engine worker on one device that runs the engine its ops name."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.holding = Holding.SERVING
        self.runs: tuple[str, ...] = ()
        self.fail: OpKind | None = None
        self.plans: list[PlanKind] = []

    def actual(self) -> ActualState:
        return ActualState(holding=self.holding, engine=self.runs)

    async def handle(self, op: OpRequest) -> str:
        self.plans.append(op.plan)
        if op.kind is self.fail:
            raise RuntimeError(f"cannot {op.kind.value}")
        self.holding, self.runs = after_op(op, self.device, WorkerKind.ROLLOUT_ENGINE, self.holding, self.runs)
        return f"{op.kind.value}: {self.holding.value}, engine {list(self.runs) or 'own'}"

    def client(self, endpoint: str) -> WorkerClient:
        c = WorkerClient(endpoint, "eng-" + self.device.replace(":", "-"), WorkerKind.ROLLOUT_ENGINE,
                         (self.device,), actual=self.actual)
        c.on_all({k: self.handle for k in OpKind})
        return c


@contextlib.asynccontextmanager
async def attached(daemon: Any) -> AsyncIterator[tuple[dict[str, Engine], list[WorkerClient]]]:
    """An engine worker on each device of PAIR, attached; closed at the end (a test may swap
    in a restarted one's client)."""
    engines = {d: Engine(d) for d in PAIR}
    clients = [e.client(daemon.worker_endpoint) for e in engines.values()]
    try:
        for c in clients:
            await c.start()
        yield engines, clients
    finally:
        for c in clients:
            await c.close()


def facts_of(daemon: Any, kind: type) -> list[Any]:
    return [x for x in read_facts(daemon.state_dir) if isinstance(x, kind)]


async def test_regroup_two_engines_into_one_and_back(make_daemon) -> None:
    daemon = make_daemon()
    async with attached(daemon) as (engines, clients):
        reply = daemon.control(wire.RegroupRequest(devices=PAIR, tp=2, reason="tail"))
        assert reply.ok and "TP-2 engine" in reply.message, reply.message
        await until(lambda: facts_of(daemon, f.RegroupCommitted), timeout=15, what="the regroup")
        lead, follow = engines[PAIR[0]], engines[PAIR[1]]
        assert (lead.holding, lead.runs) == (Holding.SERVING, PAIR)
        assert follow.holding is Holding.RELEASED
        assert set(lead.plans) == {PlanKind.REGROUP}
        status = daemon.status()
        assert status["engines"] == [list(PAIR)] and status["regroups"] == {"started": 1, "committed": 1}
        assert status["split"] == {"train": 2, "rollout": 2} and status["phase"] == "steady"
        assert f"engines     TP-2 [{PAIR[0]}, {PAIR[1]}]" in render_status(status)
        metrics = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
        assert "dynaresized_wide_engines 1.0" in metrics and 'dynaresized_regroups{state="committed"} 1.0' in metrics
        desired = {w["id"]: (w["actual"], w["desired"]) for w in status["workers"]}
        assert set(desired.values()) == {("serving", "serving"), ("released", "released")}
        # A resize that cannot be planned (no trainers here) starts nothing and leaves the engine.
        refused = daemon.control(wire.ResizeRequest(train=3, rollout=1))
        assert not refused.ok and "guard capacity" in refused.message
        assert daemon.status()["engines"] == [list(PAIR)]
        # And back: two one-device engines.
        assert daemon.control(wire.RegroupRequest(devices=PAIR, tp=1)).ok
        await until(lambda: len(facts_of(daemon, f.RegroupCommitted)) == 2, timeout=15, what="the way back")
        assert all((e.holding, e.runs) == (Holding.SERVING, ()) for e in engines.values())
        assert daemon.status()["engines"] == []
        # A regroup that cannot be says why, and starts nothing.
        bad = daemon.control(wire.RegroupRequest(devices=(DEVICES[0], DEVICES[1]), tp=2))
        assert not bad.ok and "only devices at home in the rollout pool" in bad.message


async def test_a_failed_regroup_rolls_back_and_a_killed_daemon_finishes_one_from_its_log(make_daemon) -> None:
    daemon = make_daemon()
    async with attached(daemon) as (engines, clients):
        engines[PAIR[1]].fail = OpKind.JOIN
        assert daemon.control(wire.RegroupRequest(devices=PAIR, tp=2)).ok
        await until(lambda: facts_of(daemon, f.ResizeRolledBack), timeout=15, what="the rollback")
        assert all((e.holding, e.runs) == (Holding.SERVING, ()) for e in engines.values())
        assert daemon.status()["engines"] == [] and not facts_of(daemon, f.RegroupCommitted)

        engines[PAIR[1]].fail = None
        gate = asyncio.Event()
        lead = engines[PAIR[0]]
        real = lead.handle

        async def slow(op: OpRequest) -> str:
            if op.kind is OpKind.RESTORE:
                await gate.wait()
            return await real(op)

        clients[0].on(OpKind.RESTORE, slow)
        assert daemon.control(wire.RegroupRequest(devices=PAIR, tp=2)).ok
        await until(lambda: daemon.status()["phase"] == "restoring", timeout=15, what="restore")
        daemon.kill()
        daemon.start()
        gate.set()
        await until(lambda: len(facts_of(daemon, f.RegroupCommitted)) == 1, timeout=20, what="the regroup after restart")
        assert daemon.status()["engines"] == [list(PAIR)]
        assert (lead.holding, lead.runs) == (Holding.SERVING, PAIR) and engines[PAIR[1]].holding is Holding.RELEASED


async def test_an_engine_back_with_the_wrong_engine_is_converged(make_daemon) -> None:
    daemon = make_daemon()
    async with attached(daemon) as (engines, clients):
        assert daemon.control(wire.RegroupRequest(devices=PAIR, tp=2)).ok
        await until(lambda: facts_of(daemon, f.RegroupCommitted), timeout=15, what="the regroup")
        # The leader's process restarts: a fresh one runs its own device's engine only.
        await clients[0].close(say_bye=False)
        lead = engines[PAIR[0]] = Engine(PAIR[0])
        clients[0] = lead.client(daemon.worker_endpoint)
        welcome = await clients[0].start()
        assert welcome.pool is Pool.ROLLOUT and welcome.desired is Holding.SERVING
        done = await until(lambda: facts_of(daemon, f.ReconcileFinished), timeout=15, what="the reconcile")
        assert done[0].ok
        assert [op.kind for op in facts_of(daemon, f.ReconcileStarted)[0].plan.ops] == [
            OpKind.DRAIN, OpKind.RELEASE, OpKind.RECLAIM, OpKind.RESUME]
        assert (lead.holding, lead.runs) == (Holding.SERVING, PAIR)
