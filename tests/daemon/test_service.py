"""The daemon over real sockets: registration, heartbeats, timings, resizes op by op, worker and
daemon crashes mid-resize, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import pytest

from dynaresized import wire
from dynaresized.client import OpRequest, WorkerClient
from dynaresized.core import facts as f
from dynaresized.explain import explain
from dynaresized.domain import OpKind, StepTiming, WorkerKind

from .conftest import DEVICES, read_facts, until, write_config


class Recorder:
    """Op handlers that record what they ran; `gate` lets a test hold an op open."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, str]] = []
        self.gates: dict[OpKind, asyncio.Event] = {}
        self.fail: set[OpKind] = set()

    def handlers(self, name: str) -> dict[OpKind, object]:
        async def run(op: OpRequest) -> str:
            self.ran.append((name, op.op_id))
            gate = self.gates.get(op.kind)
            if gate is not None:
                await gate.wait()
            if op.kind in self.fail:
                raise RuntimeError(f"{op.kind.value} broke on purpose")
            return f"{name} did {op.kind.value}"

        return {kind: run for kind in OpKind}


async def attach_all(endpoint: str, rec: Recorder) -> list[WorkerClient]:
    """One engine and one trainer per device: both roles' processes are kept on every device."""
    clients = []
    for i, device in enumerate(DEVICES):
        for kind, prefix in ((WorkerKind.ROLLOUT_ENGINE, "engine"), (WorkerKind.TRAINER_RANK, "trainer")):
            c = WorkerClient(endpoint, f"{prefix}{i}", kind, (device,))
            c.on_all(rec.handlers(c.worker_id))  # type: ignore[arg-type]
            await c.start()
            clients.append(c)
    return clients


async def close_all(clients: list[WorkerClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def test_a_worker_that_reports_needs_no_heartbeat_beside(make_daemon) -> None:
    """Any message counts as a beat (docs/protocol.md, "Stay registered"): an engine reporting
    progress every 50 ms sends a heartbeat only to ask for an answer, once the last answer is a
    quarter of the heartbeat timeout old; a silent trainer beats every interval. Both stay live,
    and both hear from the daemon within its timeout."""
    daemon = make_daemon(daemon={"heartbeat_interval_s": 0.2}, core={"heartbeat_timeout_s": 3.0})
    busy = WorkerClient(daemon.worker_endpoint, "engine2", WorkerKind.ROLLOUT_ENGINE, (DEVICES[2],))
    quiet = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    try:
        for c in (busy, quiet):
            await c.start()
        loop = asyncio.get_running_loop()
        start = loop.time()
        done = 0
        while loop.time() - start < 3.0:  # longer than the heartbeat timeout
            done += 1
            await busy.report_progress(step=0, done=done, total=10_000)
            await asyncio.sleep(0.05)
        assert all(w["status"] == "live" for w in daemon.status()["workers"])
        assert quiet.heartbeats_sent >= 10  # ~15 intervals of 0.2 s
        assert busy.heartbeats_sent <= 6  # an answer asked for every 0.75 s at most: ~4
        assert busy.registered and quiet.registered  # neither went without an answer for 3 s
    finally:
        await close_all([busy, quiet])


async def test_register_heartbeat_and_report(make_daemon) -> None:
    daemon = make_daemon()
    rec = Recorder()
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        await clients[1].report_step(StepTiming(step=0, rollout_s=10.0, train_s=9.0))
        await clients[1].report_progress(step=1, done=3, total=8, tokens=120)
        status = await until(lambda: (s := daemon.status())["last_step"] == 0 and s["samples"] and s,
                             what="step and progress observed")
        assert status["samples"] == {"1": {"done": 3, "total": 8}}  # soft state: no fact, but the core has it
        assert {w["id"] for w in status["workers"]} == {c.worker_id for c in clients}
        assert all(w["status"] == "live" for w in status["workers"])
        await asyncio.sleep(0.5)  # several heartbeat periods
        assert all(w["status"] == "live" for w in daemon.status()["workers"])
        metrics = urllib.request.urlopen(daemon.metrics_url, timeout=5).read().decode()
        # counted once per batch with the other message counts: several heartbeats by now
        heartbeats = [line for line in metrics.splitlines() if line.startswith("dynaresized_heartbeats_total ")]
        assert heartbeats and float(heartbeats[0].split()[1]) >= 1
        assert 'dynaresized_pool_devices{pool="training"} 2.0' in metrics
    finally:
        await close_all(clients)
    await until(lambda: all(w["status"] == "gone" for w in daemon.status()["workers"]), what="goodbyes recorded")
    facts = read_facts(daemon.state_dir)
    kinds = [type(x) for x in facts]
    assert kinds.count(f.WorkerRegistered) == 8
    assert f.StepObserved in kinds and f.ProgressObserved not in kinds  # progress is soft state
    assert kinds.count(f.WorkerLeft) == 8  # close() says goodbye


async def test_forced_resize_runs_op_by_op_and_commits(make_daemon) -> None:
    daemon = make_daemon()
    rec = Recorder()
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        reply = daemon.control(wire.ResizeRequest(train=3, rollout=1, reason="test"))
        assert reply.ok, reply.message
        status = await until(lambda: (s := daemon.status())["phase"] == "steady" and s["resizes"]["committed"] == 1
                             and s, what="resize committed")
        assert status["split"] == {"train": 3, "rollout": 1}
    finally:
        await close_all(clients)
    kinds_run = [op_id.split("-", 1)[1] for _, op_id in rec.ran]
    # node0:cpu3 moves: its engine drains and releases, its trainer joins and restores, all commit.
    assert kinds_run[:4] == ["drain", "release", "join", "restore"]
    assert ("engine3", "r1/0-drain") in rec.ran
    assert ("trainer3", "r1/2-join") in rec.ran
    committers = {name for name, op in rec.ran if op.endswith("commit")}
    assert committers == {"trainer0", "trainer1", "trainer3", "engine2"}
    facts = read_facts(daemon.state_dir)
    assert [type(x) for x in facts if isinstance(x, f.ResizeStarted | f.ResizeCommitted)] == \
        [f.ResizeStarted, f.ResizeCommitted]


async def test_policy_moves_devices_toward_the_slower_stage(make_daemon) -> None:
    daemon = make_daemon(policy={"name": "hysteresis"})
    rec = Recorder()
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        for step in range(3):
            await clients[1].report_step(StepTiming(step=step, rollout_s=30.0, train_s=10.0,
                                                    rollout_devices=2, train_devices=2))
            await asyncio.sleep(0.05)
        status = await until(lambda: (s := daemon.status())["resizes"]["committed"] >= 1 and s,
                             what="policy-driven resize")
        assert status["split"]["rollout"] > 2
    finally:
        await close_all(clients)
    started = [x for x in read_facts(daemon.state_dir) if isinstance(x, f.ResizeStarted)]
    assert started[0].source == "hysteresis" and "rollout is the slower stage" in started[0].reason


async def test_worker_dying_mid_resize_rolls_back(make_daemon) -> None:
    daemon = make_daemon()
    rec = Recorder()
    rec.gates[OpKind.JOIN] = asyncio.Event()  # the join never finishes: its worker "dies" during it
    clients = await attach_all(daemon.worker_endpoint, rec)
    joiner = next(c for c in clients if c.worker_id == "trainer3")
    try:
        assert daemon.control(wire.ResizeRequest(train=3, rollout=1)).ok
        await until(lambda: daemon.status()["phase"] == "joining", what="joining")
        await joiner.close(say_bye=False)  # silence: no bye, no heartbeats, like a SIGKILL
        status = await until(lambda: (s := daemon.status())["resizes"]["rolled_back"] == 1 and s,
                             what="rollback", timeout=15)
        assert status["split"] == {"train": 2, "rollout": 2}
        assert status["devices"]["node0:cpu3"] == "rollout"
    finally:
        rec.gates[OpKind.JOIN].set()
        await close_all(clients)
    facts = read_facts(daemon.state_dir)
    lost = [x for x in facts if isinstance(x, f.WorkerLost)]
    assert [x.worker_id for x in lost] == ["trainer3"]
    aborted = next(x for x in facts if isinstance(x, f.ResizeAborted))
    assert [op.kind for op in aborted.undo] == [OpKind.EVICT, OpKind.RECLAIM, OpKind.RESUME]
    assert ("engine3", "r1/undo1-reclaim") in rec.ran and ("engine3", "r1/undo2-resume") in rec.ran


async def test_daemon_sigkilled_mid_resize_is_reconciled_after_restart(make_daemon) -> None:
    daemon = make_daemon()
    rec = Recorder()
    rec.gates[OpKind.JOIN] = asyncio.Event()
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        assert daemon.control(wire.ResizeRequest(train=3, rollout=1)).ok
        await until(lambda: daemon.status()["phase"] == "joining", what="joining")
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
        daemon.start()  # replays the log: the resize is still in flight, in phase joining
        assert daemon.status()["phase"] == "joining"
        rec.gates[OpKind.JOIN].set()  # the join finishes while/after the workers re-register
        try:
            status = await until(lambda: (s := daemon.status())["resizes"]["committed"] == 1 and s,
                                 what="commit after restart", timeout=20)
        except AssertionError:
            raise AssertionError(f"{daemon.status()}\n{daemon.output()[-6000:]}") from None
        assert status["split"] == {"train": 3, "rollout": 1}
        assert all(w["status"] == "live" for w in status["workers"])
        assert all(c.incarnation == 2 for c in clients)  # every worker registered again
    finally:
        await close_all(clients)
    joins = [op for name, op in rec.ran if op == "r1/2-join"]
    assert joins == ["r1/2-join"], "the join was re-sent but must run once"
    facts = read_facts(daemon.state_dir)
    assert sum(isinstance(x, f.DaemonRestarted) for x in facts) == 1
    assert sum(isinstance(x, f.ResizeCommitted) for x in facts) == 1


async def test_failed_op_rolls_back_and_is_explained(make_daemon) -> None:
    daemon = make_daemon()
    rec = Recorder()
    rec.fail.add(OpKind.RELEASE)
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        assert daemon.control(wire.ResizeRequest(train=1, rollout=3)).ok
        status = await until(lambda: (s := daemon.status())["resizes"]["rolled_back"] == 1 and s,
                             what="rollback")
        assert status["split"] == {"train": 2, "rollout": 2} and status["phase"] == "steady"
    finally:
        await close_all(clients)
    failed = next(x for x in read_facts(daemon.state_dir) if isinstance(x, f.OpFailed))
    assert "release broke on purpose" in failed.reason and failed.worker_id == "trainer1"


async def test_sigterm_drains_a_resize_in_flight_then_exits_cleanly(make_daemon) -> None:
    daemon = make_daemon(daemon={"drain_timeout_s": 0.5})
    rec = Recorder()
    rec.gates[OpKind.JOIN] = asyncio.Event()  # never released: the drain timeout must roll back
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        assert daemon.control(wire.ResizeRequest(train=3, rollout=1)).ok
        await until(lambda: daemon.status()["phase"] == "joining", what="joining")
        assert daemon.control(wire.ResizeRequest(train=1, rollout=3)).ok is False  # one at a time
        daemon.proc.send_signal(signal.SIGTERM)
        # The join hangs, so after drain_timeout_s the daemon aborts; undo ops are acked at once.
        code = await asyncio.to_thread(daemon.proc.wait, 30)
        assert code == 0, daemon.output()
    finally:
        rec.gates[OpKind.JOIN].set()
        await close_all(clients)
    facts = read_facts(daemon.state_dir)
    assert any(isinstance(x, f.ShutdownStarted) for x in facts)
    ended = [x for x in facts if isinstance(x, f.ResizeCommitted | f.ResizeRolledBack)]
    assert [type(x) for x in ended] == [f.ResizeRolledBack], "the hung resize was rolled back before exit"
    assert "drain_timeout_s" in ended[0].reason
    rejected = [x for x in facts if isinstance(x, f.ProposalRejected)]
    assert rejected and rejected[0].guard == "in_flight"


async def test_sighup_reloads_policy_and_guards_and_the_resize_in_flight_runs_on(make_daemon) -> None:
    """What `systemctl reload` sends: the daemon keeps running (same process), takes the new
    [policy] and [guards], and the resize it is in the middle of finishes as planned."""
    daemon = make_daemon()
    rec = Recorder()
    rec.gates[OpKind.JOIN] = asyncio.Event()
    clients = await attach_all(daemon.worker_endpoint, rec)
    try:
        assert daemon.control(wire.ResizeRequest(train=3, rollout=1, reason="before reload")).ok
        await until(lambda: daemon.status()["phase"] == "joining", what="joining")
        daemon.sections["policy"] = {"name": "hysteresis", "options": {"window": 3}}
        daemon.sections["guards"]["min_rollout"] = 2  # would forbid 3:1, but r1 was decided already
        write_config(daemon.config_path, daemon.sections)
        daemon.proc.send_signal(signal.SIGHUP)
        status = await until(lambda: (s := daemon.status())["policy"] == "hysteresis" and s, what="reloaded")
        assert daemon.proc.poll() is None
        assert status["phase"] == "joining" and status["in_flight"]["resize_id"] == "r1"
        rec.gates[OpKind.JOIN].set()
        status = await until(lambda: (s := daemon.status())["resizes"]["committed"] == 1 and s, what="r1 commits")
        assert status["split"] == {"train": 3, "rollout": 1}
        back = daemon.control(wire.ResizeRequest(train=2, rollout=2))  # rollout 2 >= min_rollout: allowed
        assert back.ok, back.message
        await until(lambda: daemon.status()["resizes"]["committed"] == 2, what="r2 commits")
        refused = daemon.control(wire.ResizeRequest(train=3, rollout=1))
        assert not refused.ok and "min_rollout=2" in refused.message  # the reloaded guard speaks

        # A configuration that does not load changes nothing and stops nothing.
        daemon.sections["policy"] = {"name": "hysterisis"}
        write_config(daemon.config_path, daemon.sections)
        daemon.proc.send_signal(signal.SIGHUP)
        await until(lambda: "reload refused" in daemon.output(), what="reload refused")
        assert daemon.proc.poll() is None and daemon.status()["policy"] == "hysteresis"
    finally:
        rec.gates[OpKind.JOIN].set()
        await close_all(clients)
    assert "unknown policy 'hysterisis'" in daemon.output()
    # Both reloads are facts in the log: what changed, and why the second was refused.
    reloads = [x for x in read_facts(daemon.state_dir) if isinstance(x, f.ConfigReloaded | f.ReloadRefused)]
    assert [type(x) for x in reloads] == [f.ConfigReloaded, f.ReloadRefused]
    applied, refused_fact = reloads
    assert applied.policy == "hysteresis" and applied.options == {"window": 3}
    assert applied.guards_changed == {"min_rollout": (1, 2)} and applied.restart_only == ()
    assert "unknown policy 'hysterisis'" in refused_fact.reason


@pytest.mark.parametrize("bad", ["unknown_device", "device_owned", "bad_version"])
async def test_client_gets_a_clear_exception_when_refused(make_daemon, monkeypatch, bad: str) -> None:
    from dynaresized.client import DaemonRejected

    daemon = make_daemon()
    owner = WorkerClient(daemon.worker_endpoint, "owner", WorkerKind.TRAINER_RANK, ("node0:cpu0",))
    await owner.start()
    try:
        devices = {"unknown_device": ("node9:gpu0",), "device_owned": ("node0:cpu0",),
                   "bad_version": ("node0:cpu1",)}[bad]
        if bad == "bad_version":
            monkeypatch.setattr(wire, "PROTOCOL_VERSION", 99)  # this client speaks a future protocol
        c = WorkerClient(daemon.worker_endpoint, "w-bad", WorkerKind.TRAINER_RANK, devices)
        with pytest.raises(DaemonRejected) as info:
            await c.start()
        expected = {"unknown_device": "node9:gpu0", "device_owned": "owner", "bad_version": "protocol 99"}[bad]
        assert expected in str(info.value)
    finally:
        await owner.close()
    assert [w["id"] for w in daemon.status()["workers"]] == ["owner"]


async def test_idle_engine_is_lent_to_training_and_returns_at_the_step_boundary(make_daemon) -> None:
    daemon = make_daemon(policy={"name": "hysteresis"},
                         loan_costs={"to_training_s": 0.0, "return_s": 0.0, "lead_s": 0.0})
    rec = Recorder()
    clients = await attach_all(daemon.worker_endpoint, rec)
    by_id = {c.worker_id: c for c in clients}
    try:
        for done in (1, 2):
            await by_id["trainer0"].report_mini_batch(step=0, done=done, total=8)
            await asyncio.sleep(0.2)
        await by_id["engine3"].report_queue_empty(step=1, running=2, tokens_left=900)
        await by_id["engine3"].report_queue_empty(step=1, running=0)
        await until(lambda: daemon.status()["phase"] == "steady" and ("trainer3", "l1/2-join") in rec.ran,
                    what="loan landed")
        assert daemon.status()["lent"] == {"node0:cpu3": "rollout"}
        await by_id["trainer0"].report_step(StepTiming(step=0, rollout_s=10.0, train_s=10.0,
                                                       rollout_devices=2, train_devices=2))
        await until(lambda: any(n == "engine3" and "home" in op and op.endswith("join") for n, op in rec.ran),
                    what="loan returned")
        status = await until(lambda: (s := daemon.status())["phase"] == "steady" and s, what="steady")
        assert status["split"] == {"train": 2, "rollout": 2} and status["lent"] == {}
    finally:
        await close_all(clients)
    facts = read_facts(daemon.state_dir)
    kinds = [type(x) for x in facts]
    assert kinds.count(f.LoanStarted) == 1 and kinds.count(f.LoanLanded) == 1
    assert kinds.count(f.LoanReturnStarted) == 1 and kinds.count(f.LoanReturned) == 1
    started = next(x for x in facts if isinstance(x, f.LoanStarted))
    assert started.plan.devices == ("node0:cpu3",)
    assert explain(started).startswith("loan l1 started (by hysteresis): lent node0:cpu3 to training at "
                                       "mini-batch 2/8: rollout queue empty")
    queue = [x for x in facts if isinstance(x, f.EngineQueueEmptyObserved)]
    assert [(x.running, x.tokens_left) for x in queue] == [(2, 900), (0, 0)]


@pytest.mark.slow
async def test_a_worker_that_waited_out_a_long_outage_re_registers_within_the_restart_grace(make_daemon) -> None:
    # After a restart the daemon gives each worker heartbeat_timeout_s to say hello again. A
    # client that has been retrying for a while must not sleep longer than that between hellos,
    # or a live worker is declared lost because the daemon was down long.
    daemon = make_daemon(core={"heartbeat_timeout_s": 2.0})
    client = WorkerClient(daemon.worker_endpoint, "trainer0", WorkerKind.TRAINER_RANK, (DEVICES[0],))
    await client.start()
    try:
        assert daemon.kill(signal.SIGKILL) == -signal.SIGKILL
        await asyncio.sleep(12)  # the client's retries have backed off (up to max_backoff_s, 5 s)
        await asyncio.to_thread(daemon.start)
        await until(lambda: client.incarnation == 2, timeout=10, what="the hello after the restart")
        await asyncio.sleep(3)  # past the grace: the daemon heard the worker in time, or lost it
        status = daemon.status()
        assert [w["status"] for w in status["workers"]] == ["live"], status["workers"]
    finally:
        await client.close()
    assert not any(isinstance(x, f.WorkerLost) for x in read_facts(daemon.state_dir)), daemon.output()[-3000:]


def test_a_second_serve_on_a_held_state_directory_touches_nothing(make_daemon) -> None:
    """A second `serve` on the state directory a running daemon holds (another worker port, the
    same default ipc:// control socket) is refused before it binds or unlinks anything: the
    running daemon still answers `status` and `drain` on its socket afterwards."""
    import subprocess
    import sys

    from .conftest import free_port, write_config

    first = make_daemon(daemon={"control_endpoint": ""})  # ipc://<state_dir>/control.sock
    sock_file = first.state_dir / "control.sock"
    inode = sock_file.stat().st_ino
    sections = {k: dict(v) for k, v in first.sections.items()}
    sections["daemon"].update(worker_endpoint=f"tcp://127.0.0.1:{free_port()}", metrics_port=free_port())
    second = write_config(first.config_path.with_name("second.toml"), sections)
    done = subprocess.run([sys.executable, "-m", "dynaresized.cli", "serve", "--config", str(second)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "already open for writing" in done.stdout + done.stderr
    assert sock_file.stat().st_ino == inode, "the running daemon's control socket is untouched"
    assert first.status()["phase"] == "steady"
    check = subprocess.run([sys.executable, "-m", "dynaresized.cli", "check-config", "--config", str(second)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and f"pid {first.proc.pid}" in check.stderr  # valid, but held: said beside "ok"
    assert first.control(wire.DrainRequest()).ok
    assert first.proc.wait(timeout=30) == 0
