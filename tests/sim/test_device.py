"""The simulated device's leader asks the daemon's status every mini-batch (to see loans): a
daemon that does not answer in time (a stalled daemon on a loaded machine) costs it one look,
not the run, and the late answer is not taken for the next one."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from dynaresized import wire
from dynaresized.backends.sim import SimDevice
from dynaresized.domain import Pool
from dynaresized.sim.cluster import VirtualCluster


def status_reply(pools: dict[str, str]) -> bytes:
    return wire.encode(wire.ControlReply(ok=True, message="", data={"devices": pools}))


async def test_a_status_that_comes_late_is_skipped_not_fatal_and_not_taken_for_the_next() -> None:
    cluster = VirtualCluster.builtin(steps=4)
    ctx = zmq.asyncio.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    sim = SimDevice(cluster, "tcp://127.0.0.1:1", cluster.devices[0], 1000.0, leader=True, control_endpoint=endpoint)
    sim.status_timeout_s = 0.3
    control = ctx.socket(zmq.DEALER)
    control.setsockopt(zmq.LINGER, 0)
    control.connect(endpoint)
    lent_device = sim.rollout[0]
    try:
        asked = asyncio.ensure_future(sim._lent_to(Pool.TRAINING, control))
        ident, secret, _ = await router.recv_multipart()  # the daemon got it (two frames, as control requests are) and stalls
        assert await asked == set()
        # the late answer (nothing lent) arrives, then the next question's (one device lent)
        await router.send_multipart([ident, status_reply({})])
        assert await control.poll(5000), "the late answer reached the leader's socket"  # not taken
        asked = asyncio.ensure_future(sim._lent_to(Pool.TRAINING, control))
        ident, secret, _ = await router.recv_multipart()
        await router.send_multipart([ident, status_reply({lent_device: "training"})])
        assert await asked == {lent_device}
    finally:
        control.close()
        router.close()
