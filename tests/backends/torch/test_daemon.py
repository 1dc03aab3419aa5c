"""Trainer ranks attached through the real worker client to a real daemon process: an operator's
resize requests grow and shrink the training group, the daemon records what each trainer did,
and the group leader's reports reach the daemon: `mini_batch_done` after each of the RL step's
two mini-batches, the step timing after the last.

The rollout side of each device is a minimal engine worker that accepts its ops (the real one
is the vllm backend's); every trainer op runs on real torch.distributed processes."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized import wire  # noqa: E402
from dynaresized.backends.torch import worker  # noqa: E402
from dynaresized.backends.torch.local import process_context  # noqa: E402
from dynaresized.backends.torch.membership import Registry  # noqa: E402
from dynaresized.backends.torch.store import StoreHost  # noqa: E402
from dynaresized.client import OpRequest, WorkerClient  # noqa: E402
from dynaresized.core import facts as f  # noqa: E402
from dynaresized.domain import OpKind, WorkerKind  # noqa: E402

from ...daemon.conftest import DEVICES, read_facts, until  # noqa: E402
from .cluster import JOB, JOB_OPTIONS  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


async def engine(endpoint: str, device: str) -> WorkerClient:
    async def accept(op: OpRequest) -> str:
        return f"engine on {device}: {op.kind.value}"

    client = WorkerClient(endpoint, f"engine{DEVICES.index(device)}", WorkerKind.ROLLOUT_ENGINE, (device,))
    client.on_all({kind: accept for kind in OpKind})
    await client.start()
    return client


async def test_trainer_ranks_grow_and_shrink_on_the_daemons_command(make_daemon, tmp_path) -> None:
    daemon = make_daemon(core={"heartbeat_timeout_s": 10.0, "op_timeout_s": 60.0})
    host = StoreHost()
    ctx = process_context()
    ranks = []
    for device in DEVICES:
        argv = ["--daemon", daemon.worker_endpoint, "--store", str(host.address), "--devices", ",".join(DEVICES),
                "--initial", "2", "--device", device, "--job", JOB, "--job-options", json.dumps(JOB_OPTIONS),
                "--step-delay", "0.05", "--peer-timeout", "2", "--collective-timeout", "20",
                "--micro-batches", "8", "--mini-batches", "2",
                "--log-level", "warning"]
        p = ctx.Process(target=worker.main, args=(argv,), name=f"trainer-{device}")
        p.start()
        ranks.append(p)
    engines = [await engine(daemon.worker_endpoint, d) for d in DEVICES]
    try:
        await until(lambda: sum(w["status"] == "live" for w in daemon.status()["workers"]) == 8
                    and daemon.status()["last_step"] >= 2, timeout=120, what="8 live workers and trainer steps")
        assert daemon.status()["split"] == {"train": 2, "rollout": 2}

        reply = daemon.control(wire.ResizeRequest(train=3, rollout=1, reason="test: grow"))
        assert reply.ok, reply.message
        await until(lambda: daemon.status()["resizes"]["committed"] == 1 and daemon.status()["phase"] == "steady",
                    timeout=120, what="the grow committed")
        step = daemon.status()["last_step"]
        await until(lambda: daemon.status()["last_step"] >= step + 2, timeout=60, what="steps on three trainers")

        reply = daemon.control(wire.ResizeRequest(train=2, rollout=2, reason="test: shrink"))
        assert reply.ok, reply.message
        await until(lambda: daemon.status()["resizes"]["committed"] == 2 and daemon.status()["phase"] == "steady",
                    timeout=120, what="the shrink committed")
        assert daemon.status()["split"] == {"train": 2, "rollout": 2}
        Registry(host.store, host.address.prefix).request_stop(0)
        for p in ranks:
            await asyncio.get_running_loop().run_in_executor(None, p.join, 60)
            assert p.exitcode == 0, p.name
    finally:
        for c in engines:
            await c.close()
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join(10)
        host.close()

    facts = read_facts(daemon.state_dir)
    assert [type(x) for x in facts if isinstance(x, f.ResizeCommitted | f.ResizeAborted)] == [f.ResizeCommitted] * 2
    assert not [x for x in facts if isinstance(x, f.OpFailed)]
    acks = {(x.op_id.split("/", 1)[1].split("-", 1)[1], x.worker_id): x.detail
            for x in facts if isinstance(x, f.OpAcked)}
    # the device that moved in (highest rollout id: node0:cpu3) was joined, with a verified transfer
    assert "joined epoch" in acks[("join", "trainer3")] and "verified" in acks[("join", "trainer3")]
    assert "training on" in acks[("commit", "trainer0")]
    assert "left the training group" in acks[("drain", "trainer3")]
    steps = [x for x in facts if isinstance(x, f.StepObserved)]
    assert {s.timing.train_devices for s in steps} >= {2, 3}  # reported by the leader of each group
    numbers = [s.timing.step for s in steps]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # one report per RL step, not per mini-batch
    minis = [(x.step, x.done, x.total) for x in facts if isinstance(x, f.MiniBatchObserved)]
    assert {total for _, _, total in minis} == {2}
    for step in numbers:  # each reported RL step was preceded by its two mini-batches
        assert (step, 1, 2) in minis and (step, 2, 2) in minis, (step, minis)


def test_worker_arguments_are_checked():
    args = worker.parse_args(["--daemon", "tcp://x:1", "--devices", "a,b", "--initial", "3"])
    with pytest.raises(ValueError, match="pass --device, or run under torchrun"):
        worker.config_from_args(args, environ={})
    with pytest.raises(ValueError, match="--initial must be between 1 and 2"):
        worker.config_from_args(args, environ={"RANK": "1"})
    ok = worker.parse_args(["--daemon", "tcp://x:1", "--devices", "a,b,c", "--initial", "1"])
    config = worker.config_from_args(ok, environ={"RANK": "2"})
    assert config.device == "c" and config.candidates == (("a",), ("a", "b"), ("a", "c"), ("a", "b", "c"))
    prefixes = worker.parse_args(["--daemon", "tcp://x:1", "--devices", "a,b,c", "--initial", "1", "--candidates",
                                  "prefixes"])
    assert worker.config_from_args(prefixes, environ={"RANK": "0"}).candidates == (("a",), ("a", "b"), ("a", "b", "c"))
