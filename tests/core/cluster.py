"""A small cluster for driving the core in tests: an inventory where every device has both a
rollout engine and a trainer rank (roles change in place), and a `Driver` that steps the core,
keeps the fact log and can check that the log replays to the live state."""

from __future__ import annotations

import msgspec

from dynaresized.core import ClusterState, Command, Core, CoreConfig, fold
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import Policy, load_policy
from dynaresized.domain import DeviceId, Pool, Split, WorkerKind

_state_encoder = msgspec.msgpack.Encoder()

# Guards that let a resize happen on the first imbalanced step: tests that are not about
# hysteresis use these so that a resize is one step away.
EAGER = GuardConfig(min_dwell_s=0.0, cooldown_steps=0, signal_run=1, payback_safety=0.0)


def device(i: int) -> DeviceId:
    return f"n0:gpu{i}"


def engine(i: int) -> str:
    return f"eng{i}"


def trainer(i: int) -> str:
    return f"tr{i}"


def snapshot(state: ClusterState) -> bytes:
    """Every field of the state, soft ones included: equal bytes mean nothing changed."""
    return _state_encoder.encode(state)


class Driver:
    """Steps a Core and records what it said."""

    def __init__(self, core: Core, state: ClusterState | None = None, now: float = 0.0) -> None:
        self.core = core
        self.state = state if state is not None else ClusterState()
        self.log: list[f.Fact] = []
        self.now = now

    def send(self, event: ev.Event) -> tuple[list[f.Fact], list[Command]]:
        self.state, facts, commands = self.core.step(self.state, event)
        self.log.extend(facts)
        return facts, commands

    def at(self, dt: float = 1.0) -> float:
        """Advance the test's clock and return the new time."""
        self.now += dt
        return self.now

    def replayed(self) -> ClusterState:
        return fold(self.log)

    def ack(self, worker_id: str, ok: bool = True, detail: str = "") -> tuple[list[f.Fact], list[Command]]:
        fl = self.state.inflight
        assert fl is not None, "no resize in flight"
        return self.send(ev.OpReported(at=self.at(), worker_id=worker_id, op_id=fl.op.op_id, ok=ok, detail=detail))

    def ack_current(self) -> list[Command]:
        """Every pending target acknowledges the current operation; returns the commands sent."""
        fl = self.state.inflight
        assert fl is not None, "no resize in flight"
        op_id = fl.op.op_id
        commands: list[Command] = []
        for w in fl.op.targets:
            if self.state.inflight is None or self.state.inflight.op.op_id != op_id:
                break
            if w in self.state.inflight.acked or not self.state.is_live(w):
                continue
            _, cmds = self.ack(w)
            commands.extend(cmds)
        return commands

    def finish(self, limit: int = 20) -> None:
        """Acknowledge operations until no resize is in flight."""
        for _ in range(limit):
            if self.state.inflight is None:
                return
            self.ack_current()
        raise AssertionError("resize did not finish")

    def heartbeat_all(self, at: float) -> None:
        for w in sorted(self.state.workers):
            if self.state.is_live(w):
                self.send(ev.Heartbeat(at=at, worker_id=w))

    def force(self, train: int, rollout: int) -> tuple[list[f.Fact], list[Command]]:
        return self.send(ev.ResizeRequested(at=self.at(), target=Split(train=train, rollout=rollout)))


def make_core(
    guards: GuardConfig = EAGER,
    policy: Policy | str = "static",
    *,
    heartbeat_timeout_s: float = 10.0,
    op_timeout_s: float = 120.0,
    steps_total: int | None = None,
) -> Core:
    pol = load_policy(policy) if isinstance(policy, str) else policy
    cfg = CoreConfig(guards=guards, heartbeat_timeout_s=heartbeat_timeout_s, op_timeout_s=op_timeout_s,
                     steps_total=steps_total)
    return Core(cfg, pol)


def boot(core: Core, train: int, rollout: int, *, candidates: tuple = (), at: float = 0.0) -> Driver:
    """Configure `train` training devices (the low ids) and `rollout` rollout devices, and register
    an engine and a trainer on every device."""
    d = Driver(core, now=at)
    n = train + rollout
    devices = tuple(device(i) for i in range(n))
    pools = tuple([Pool.TRAINING] * train + [Pool.ROLLOUT] * rollout)
    d.send(ev.Configure(at=at, devices=devices, pools=pools, candidates=candidates))
    for i in range(n):
        d.send(ev.WorkerHello(at=at, worker_id=engine(i), kind=WorkerKind.ROLLOUT_ENGINE, devices=(device(i),)))
        d.send(ev.WorkerHello(at=at, worker_id=trainer(i), kind=WorkerKind.TRAINER_RANK, devices=(device(i),)))
    return d
