"""The `sim` backend: simulated workers on a virtual cluster, over the real client and daemon.

One process per device, as on a real node: it hosts the device's rollout engine and its
trainer rank (both processes kept; the device's role changes in place). Each resize operation
takes the time the simulator's cost model gives it (`VirtualCluster.op_seconds`), divided by
`speedup`. The trainer on the lowest device also drives the RL loop, one-step off as
`dynaresized simulate` runs it: window w generates step w beside the training of step w - 1
(window 0 has nothing to train, the last window no rollout), sleeps for the longer of the two
plus the weight sync (from the model, divided by `speedup`) and reports step w - 1 (its rollout
from the window before, its training from this one) in simulated seconds. Inside a window the
trainer reports every mini-batch (mini-batch 0 when its step begins), the engine that pulls the
step's last request says the queue is empty (with what it still decodes), and every engine says
when it has nothing left to do, as the vLLM backend's router does; so the daemon lends idle
engines to the training (a lent trainer speeds up the mini-batches after it joins; its engine
starts the next rollout late by the way home, the router holding its share) and trainers with
nothing to train to the rollout (from when they land, their engines pull queued requests; they
come home before the next training step). The leader publishes each window's start, and the
engines lent in, on a loopback PUB socket (`--clock-endpoint`) so that every device's engine
knows when its rollout began, and reads which devices are lent from the daemon's status
(`--control-endpoint`; a refused status request stops the run: a world that cannot see loans
would only pretend to lend). Run the daemon with
`daemon.time_scale = speedup` so that its clock is simulated time too: it then sees what it
would see on a real cluster, only faster. Pools change when a COMMIT op arrives (it carries
the new membership), at the next window.

    python -m dynaresized.backends.sim --endpoint tcp://127.0.0.1:5555 --device node0:gpu3 \
        --scenario longtail-drift --profile qwen3-8b-h20x8 --speedup 3600 \
        --clock-endpoint tcp://127.0.0.1:5557 [--leader --control-endpoint tcp://127.0.0.1:5556]

Several devices in one process, with no RL loop, only serving ops (what `dynaresized
toy-cluster` runs: devices to try the operator's commands on):

    python -m dynaresized.backends.sim --endpoint tcp://127.0.0.1:5555 --device node0:gpu0,node0:gpu1 \
        --speedup 100 --leave-with ipc:///tmp/toy/state/control.sock
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import zmq
import zmq.asyncio

from dynaresized import wire
from dynaresized.client import OpRequest, WorkerClient
from dynaresized.domain import ActualState, Holding, OpKind, PlanKind, Pool, StepTiming, WorkerKind
from dynaresized.sim.cluster import VirtualCluster

HOLDING_AFTER: dict[OpKind, Holding] = {
    OpKind.DRAIN: Holding.DRAINED,
    OpKind.RELEASE: Holding.RELEASED,
    OpKind.JOIN: Holding.SERVING,
    OpKind.RESTORE: Holding.SERVING,
    OpKind.RESUME: Holding.SERVING,
    OpKind.RECLAIM: Holding.DRAINED,
    OpKind.EVICT: Holding.RELEASED,
}
"""What a simulated worker holds after each op on its device (commit changes nothing on it)."""


def after_op(op: OpRequest, device: str, kind: WorkerKind, holding: Holding,
             engine: tuple[str, ...]) -> tuple[Holding, tuple[str, ...]]:
    """What a simulated worker on `device` holds, and the engine it runs (empty: its own
    device's), after `op`: an engine whose `op.engine` another device leads holds nothing."""
    if device not in op.devices or op.kind not in HOLDING_AFTER:
        return holding, engine
    after = HOLDING_AFTER[op.kind]
    if kind is WorkerKind.ROLLOUT_ENGINE and op.kind in (OpKind.JOIN, OpKind.RESTORE, OpKind.RECLAIM, OpKind.RESUME):
        engine = tuple(op.engine)
        if engine and engine[0] != device:
            after = Holding.RELEASED
    return after, engine


def engine_name(device: str) -> str:
    return "engine-" + device.replace(":", "-")


def trainer_name(device: str) -> str:
    return "trainer-" + device.replace(":", "-")


class SimDevice:
    """The two workers of one simulated device, and (on the leader) the RL loop."""

    def __init__(self, cluster: VirtualCluster, endpoint: str, device: str, speedup: float, *,
                 leader: bool = False, steps: int | None = None, clock_endpoint: str = "",
                 control_endpoint: str = "") -> None:
        self.cluster = cluster
        self.clock_endpoint = clock_endpoint
        self.control_endpoint = control_endpoint
        self.status_timeout_s = 5.0  # the leader's wait for the daemon's status, every mini-batch
        self._said_empty = -1  # the last step this device's engine said its queue was empty in
        self.loan_poll_s = 0.002  # the leader's status poll for trainers lent to the rollout (wall seconds)
        self._ctx = zmq.asyncio.Context.instance()
        self._replies = wire.reply_decoder()
        self.device = device
        self.speedup = speedup
        self.leader = leader
        self.steps = min(steps or cluster.steps, cluster.steps)
        pools = dict(zip(cluster.devices, cluster.initial_pools, strict=True))
        self.training = tuple(d for d, p in pools.items() if p is Pool.TRAINING)
        self.rollout = tuple(d for d, p in pools.items() if p is Pool.ROLLOUT)
        self._pending: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self.role = pools[device]
        # What each worker holds, as a fresh process on its launch pool would (after a restart,
        # the daemon converges it with the log: reconciliation).
        self.holding = {kind: Holding.SERVING if kind.pool is self.role else Holding.RELEASED for kind in WorkerKind}
        self.last_op = {kind: "" for kind in WorkerKind}
        self.runs: tuple[str, ...] = ()  # the engine of several devices this device's engine runs in
        self.engine = self._client(endpoint, WorkerKind.ROLLOUT_ENGINE, engine_name(device))
        self.trainer = self._client(endpoint, WorkerKind.TRAINER_RANK, trainer_name(device))
        self.ops: list[str] = []

    def _client(self, endpoint: str, kind: WorkerKind, name: str) -> WorkerClient:
        def actual() -> ActualState:
            engine = self.runs if kind is WorkerKind.ROLLOUT_ENGINE else ()
            return ActualState(holding=self.holding[kind], last_op=self.last_op[kind], engine=engine)

        client = WorkerClient(endpoint, name, kind, (self.device,), actual=actual)

        async def run(op: OpRequest) -> str:
            detail = await self._op(op)
            self.holding[kind], runs = after_op(op, self.device, kind, self.holding[kind], self.runs)
            if kind is WorkerKind.ROLLOUT_ENGINE:
                self.runs = runs
            self.last_op[kind] = op.op_id
            return detail

        client.on_all({op_kind: run for op_kind in OpKind})
        return client

    async def _op(self, op: OpRequest) -> str:
        if op.plan is PlanKind.REGROUP:
            seconds = self.cluster.profile.resize.regroup.op_s(op.kind)
        elif op.plan in (PlanKind.RESIZE, PlanKind.RECONCILE):
            seconds = self.cluster.op_seconds(op.kind, op.to_pool)
        else:
            seconds = self.cluster.loan_op_seconds(op.kind, op.to_pool)
        await asyncio.sleep(seconds / self.speedup)
        self.ops.append(op.op_id)
        if op.kind is OpKind.COMMIT:
            self._pending = (op.training, op.rollout)  # takes effect at the next step boundary
        if op.kind is OpKind.JOIN and self.device in op.devices:
            self.role = op.to_pool
        if op.kind is OpKind.EVICT and self.device in op.devices:
            self.role = op.from_pool
        return f"{op.kind.value} on {self.device} took {seconds:.1f}s (simulated)"

    async def run(self) -> int:
        await self.engine.start()
        await self.trainer.start()
        clock = asyncio.create_task(self._engine_clock()) if self.clock_endpoint else None
        try:
            if self.leader:
                await self._drive()
            else:
                await asyncio.Event().wait()  # serve ops until killed
        finally:
            if clock is not None:
                clock.cancel()
            await self.engine.close(reason="simulation over")
            await self.trainer.close(reason="simulation over")
        return 0

    async def _engine_clock(self) -> None:
        """This device's engine: at every step start (from the leader's clock), if the device
        is in the rollout pool, say when its engine has nothing left to do."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.clock_endpoint)
        report: asyncio.Task[None] | None = None
        try:
            while True:
                msg = json.loads(await sub.recv())
                if report is not None:
                    report.cancel()
                report = asyncio.create_task(self._report_idle(msg))
        finally:
            if report is not None:
                report.cancel()
            sub.close()

    async def _report_idle(self, msg: dict) -> None:
        rollout = msg["rollout"]
        if self.device not in rollout:
            return
        gpe = self.cluster.profile.rollout.gpus_per_engine
        engines = len(rollout) // gpe
        index = rollout.index(self.device) // gpe
        if index >= engines:
            return
        late = [msg["late"].get(d, 0.0) for d in rollout[::gpe][:engines]]
        lent_in = msg.get("lent_in", [])  # [device, seconds into the step it serves from] per lent engine
        offsets = late + [ready for _, ready in lent_in]
        step = msg["step"]
        finishes, empty = self.cluster.rollout_reports(step, engines + len(lent_in), offsets, home=engines)
        finish = float(finishes[index])
        if empty is not None and empty[1] == index and self._said_empty < step and empty[0] < finish:
            # this engine pulls the step's last request: its router says the queue is empty,
            # with what it still decodes (the vLLM router's `on_dry`)
            await asyncio.sleep(max(msg["start"] + empty[0] / self.speedup - time.time(), 0.0))
            self._said_empty = step
            await self.engine.report_queue_empty(step=step, running=empty[2], tokens_left=empty[3])
        await asyncio.sleep(max(msg["start"] + finish / self.speedup - time.time(), 0.0))
        self._said_empty = step
        await self.engine.report_queue_empty(step=step, running=0)

    async def _lent_to(self, pool: Pool, control: zmq.asyncio.Socket | None) -> set[str]:
        """Devices in `pool` now that are not in it for the step: lent ones."""
        if control is None:
            return set()
        while await control.poll(0):  # a reply that came after its wait timed out: stale now
            await control.recv()
        await control.send_multipart([b"", wire.encode(wire.StatusRequest())])  # status needs no secret
        if not await control.poll(int(self.status_timeout_s * 1000)):  # a stalled daemon: no loan seen now
            print(f"no status from the daemon at {self.control_endpoint} within {self.status_timeout_s:g}s; "
                  "going on", file=sys.stderr)
            return set()
        reply = self._replies.decode(await control.recv())
        if not (isinstance(reply, wire.ControlReply) and reply.ok):
            raise RuntimeError(f"the daemon refused the leader's status request: {reply!r}")  # not a world without loans
        pools = reply.data.get("devices", {})
        home = self.training if pool is Pool.TRAINING else self.rollout
        return {d for d, p in pools.items() if p == pool.value and d not in home}

    async def _lent_to_rollout(self, step: int, start: float, rollout: list[str], late: dict[str, float],
                               rollout_s: float, control: zmq.asyncio.Socket | None,
                               pub: zmq.asyncio.Socket) -> tuple[float, float, bool]:
        """After the training's last mini-batch, until the rollout ends: trainers the daemon lends
        to the rollout pull its queued requests as engines from when they land (the pull
        router's; the home engines keep their share, `hold_share`). Every device's engine hears
        when (a clock message with `lent_in`) and says when it runs dry. Returns the rollout's
        seconds, the device-seconds lent engines served, and whether any were lent."""
        c = self.cluster
        gpe = c.profile.rollout.gpus_per_engine
        engines = len(rollout) // gpe
        if control is None or c.stages.router != "pull":
            return rollout_s, 0.0, False
        home_late = [late.get(d, 0.0) for d in rollout[::gpe][:engines]]
        lent_in: list[tuple[str, float]] = []
        served = 0.0
        while time.time() < start + rollout_s / self.speedup:
            new = await self._lent_to(Pool.ROLLOUT, control) - {d for d, _ in lent_in}
            whole = sorted(new, key=c.devices.index)[:len(new) // gpe * gpe]  # whole engines join
            if whole:
                ready = (time.time() - start) * self.speedup
                lent_in += [(d, ready) for d in whole[::gpe]]
                finish = c.engine_finish(step, engines + len(lent_in), home_late + [r for _, r in lent_in],
                                         home=engines)
                rollout_s = float(finish.max())
                served = sum(max(float(finish[engines + i]) - r, 0.0) * gpe for i, (_, r) in enumerate(lent_in))
                await pub.send(json.dumps({"step": step, "start": start, "rollout": rollout, "late": late,
                                           "lent_in": lent_in}).encode())
            await asyncio.sleep(self.loan_poll_s)
        return rollout_s, served, bool(lent_in)

    async def _drive(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        if self.clock_endpoint:
            pub.bind(self.clock_endpoint)
        control = None
        if self.control_endpoint:  # one socket for the whole run: a status every mini-batch
            control = self._ctx.socket(zmq.DEALER)
            control.setsockopt(zmq.LINGER, 0)
            control.connect(self.control_endpoint)
        await asyncio.sleep(1.0 if self.clock_endpoint else 0.0)  # let every engine subscribe
        c, loan = self.cluster, self.cluster.profile.loan
        mbs = c.profile.training.mini_batches_per_step
        sync = c.weight_sync_seconds()
        late: dict[str, float] = {}
        train_late = 0.0  # trainers lent to the rollout in the last window come home this late
        last = (0.0, 0, 0.0)  # the last window's rollout: seconds, devices, device-seconds served
        try:
            # One-step off: window w generates step w and trains step w - 1 (window 0 has nothing
            # to train, the last window no rollout); step w - 1 is reported at the window's end.
            for w in range(self.steps + 1):
                if self._pending is not None:
                    self.training, self.rollout = self._pending
                    self._pending = None
                rollout = sorted(self.rollout, key=c.devices.index)
                start = time.time()
                rollout_s = 0.0
                gpe = c.profile.rollout.gpus_per_engine
                engines = len(rollout) // gpe
                if w < self.steps:
                    if self.clock_endpoint:
                        await pub.send(json.dumps({"step": w, "start": start, "rollout": rollout,
                                                   "late": late}).encode())
                    finish = c.engine_finish(w, engines, [late.get(d, 0.0) for d in rollout[::gpe][:engines]],
                                             home=engines)
                    rollout_s = float(finish.max())
                # the training step begins (window 0: nothing to train until the first rollout is done)
                await self.trainer.report_mini_batch(step=max(w - 1, 0), done=0, total=mbs if w else 0)
                n, t, lent = len(self.training), 0.0, set()
                if w >= 1:
                    t = c.profile.training.step_overhead_s + train_late
                    for done in range(1, mbs + 1):
                        t += c.mini_batch_seconds(w - 1, n)
                        await asyncio.sleep(max(start + t / self.speedup - time.time(), 0.0))
                        await self.trainer.report_mini_batch(step=w - 1, done=done, total=mbs)
                        joined = await self._lent_to(Pool.TRAINING, control) - lent if done < mbs else set()
                        if joined:  # they joined at this boundary: the next mini-batch has them
                            lent |= joined
                            n += len(joined)
                            t += loan.group_change_s + loan.trainer_first_step_s
                served, lent_out = rollout_s * len(rollout), False
                if w < self.steps:
                    rollout_s, extra, lent_out = await self._lent_to_rollout(w, start, rollout, late, rollout_s,
                                                                             control, pub)
                    served = rollout_s * len(rollout) + extra
                train_late = loan.engine_release_s + loan.trainer_join_s if lent_out else 0.0
                window_s = max(rollout_s, t) + (sync if w >= 1 else 0.0)
                await asyncio.sleep(max(start + window_s / self.speedup - time.time(), 0.0))
                if w >= 1:
                    step = w - 1
                    await self.trainer.report_step(StepTiming(
                        step=step, rollout_s=last[0], train_s=t, weight_sync_s=sync, rollout_devices=last[1],
                        train_devices=len(self.training), rollout_device_s=last[2], samples=int(c.stages.samples[step]),
                        response_tokens=int(c.stages.response_tokens[step]), lengths=c.stages.lengths(step)))
                last = (rollout_s, len(rollout), served)
                late = {d: loan.trainer_leave_s + loan.engine_wake_s for d in lent}  # the way home
                print(json.dumps({"window": w, "window_s": window_s, "train": len(self.training),
                                  "rollout": len(self.rollout), "lent": sorted(lent), "at": time.time()}), flush=True)
        finally:
            pub.close()
            if control is not None:
                control.close()


async def host(devices: list[SimDevice], leave_with: str = "", poll_s: float = 1.0) -> int:
    """Several simulated devices in one process (`dynaresized toy-cluster`): each serves its ops
    until killed or, with `leave_with` (the daemon's control endpoint), until nothing has listened
    there for three polls in a row: the daemon was drained or stopped."""
    runs = [asyncio.create_task(d.run()) for d in devices]
    try:
        if not leave_with:
            await asyncio.gather(*runs)
            return 0
        from dynaresized.control import ensure_listening

        gone = 0
        while gone < 3 and not all(r.done() for r in runs):
            await asyncio.sleep(poll_s)
            try:
                ensure_listening(leave_with, poll_s)
                gone = 0
            except ConnectionRefusedError:
                gone += 1
        for d in devices:  # nobody to say goodbye to
            await d.engine.close(say_bye=False)
            await d.trainer.close(say_bye=False)
        return 0
    finally:
        for r in runs:
            r.cancel()
        await asyncio.gather(*runs, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="simulated devices: each one's engine and trainer workers")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--device", required=True, help="a device id, or several separated by commas")
    parser.add_argument("--leave-with", default="", metavar="CONTROL_ENDPOINT",
                        help="exit once the daemon's control endpoint stops listening (it was drained)")
    parser.add_argument("--scenario", default="longtail-drift")
    parser.add_argument("--profile", default="qwen3-8b-h20x8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--speedup", type=float, default=3600.0)
    parser.add_argument("--leader", action="store_true", help="also drive the RL loop and report steps")
    parser.add_argument("--clock-endpoint", default="", help="loopback PUB/SUB address of the step clock")
    parser.add_argument("--control-endpoint", default="", help="the daemon's control endpoint (leader: loans)")
    args = parser.parse_args(argv)
    cluster = VirtualCluster.builtin(args.scenario, args.profile, seed=args.seed, steps=args.steps)
    names = [d for d in args.device.split(",") if d]
    if unknown := [d for d in names if d not in cluster.devices]:
        parser.error(f"--device {', '.join(unknown)}: not one of {', '.join(cluster.devices)}")
    if args.leader and len(names) > 1:
        parser.error("--leader drives the RL loop from one device: name one --device")
    sims = [SimDevice(cluster, args.endpoint, d, args.speedup, leader=args.leader, steps=args.steps,
                      clock_endpoint=args.clock_endpoint, control_endpoint=args.control_endpoint) for d in names]
    try:
        import uvloop

        return uvloop.run(sims[0].run() if len(sims) == 1 and not args.leave_with else host(sims, args.leave_with))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
