"""The blocking client: for trainer code without an event loop. Plain-function handlers run
in a thread; registration, heartbeats and ops work as with the asyncio client."""

from __future__ import annotations

import threading
import time

from dynaresized import wire
from dynaresized.client import BlockingWorkerClient, OpRequest
from dynaresized.domain import OpKind, StepTiming, WorkerKind

from .conftest import DEVICES, read_facts


def test_blocking_clients_register_run_ops_and_report(make_daemon) -> None:
    daemon = make_daemon()
    ran: list[tuple[str, str]] = []
    callers: set[str] = set()
    clients = []
    for i, device in enumerate(DEVICES):
        for kind, name in ((WorkerKind.ROLLOUT_ENGINE, f"engine{i}"), (WorkerKind.TRAINER_RANK, f"trainer{i}")):
            c = BlockingWorkerClient(daemon.worker_endpoint, name, kind, (device,))

            def handle(op: OpRequest, name: str = name) -> str:
                callers.add(threading.current_thread().name)
                time.sleep(0.05)  # blocking work is fine: the heartbeat runs on its own loop
                ran.append((name, op.kind.value))
                return f"{name} did {op.kind.value}"

            for k in OpKind:
                c.on(k, handle)
            welcome = c.start()
            assert isinstance(welcome, wire.Welcome) and welcome.worker_id == name
            clients.append(c)
    try:
        clients[1].report_step(StepTiming(step=0, rollout_s=3.0, train_s=2.0))
        assert daemon.control(wire.ResizeRequest(train=3, rollout=1)).ok
        deadline = time.monotonic() + 20
        while daemon.status()["resizes"]["committed"] != 1:
            assert time.monotonic() < deadline, "resize did not commit"
            time.sleep(0.05)
    finally:
        for c in clients:
            c.close()
    assert ("engine3", "drain") in ran and ("trainer3", "join") in ran
    assert all(not name.startswith("MainThread") for name in callers)
    facts = read_facts(daemon.state_dir)
    assert any(type(x).__name__ == "StepObserved" for x in facts)
