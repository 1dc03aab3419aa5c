"""The daemon keeps reading its sockets when a send of its own takes their wake-up.

A ZeroMQ socket tells its reader that messages wait through a file descriptor, and any operation
on the socket may clear it: a send (the log writer's replies) that lands between a message's
arrival and the event loop's next look at the descriptor takes the wake-up. An ingress that then
waits without a timeout never reads again: in the chaos runs, every worker of a run was declared
lost at once while the daemon went on sending. These tests make that happen on purpose, on the
daemon's own sockets, in one turn of its event loop, and expect the message to be answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import zmq

from dynaresized import wire
from dynaresized.daemon.config import config_from_dict
from dynaresized.daemon.service import Daemon
from dynaresized.domain import WorkerKind

from .conftest import DEVICES, daemon_sections


async def _running(tmp_path: Path) -> tuple[Daemon, asyncio.Task[int]]:
    sections = daemon_sections(tmp_path)
    sections["daemon"]["metrics_port"] = 0
    daemon = Daemon(config_from_dict(sections))
    task = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.wait_ready(), 20)
    return daemon, task


async def _stop(daemon: Daemon, task: asyncio.Task[int]) -> None:
    daemon.request_stop()
    assert await asyncio.wait_for(task, 20) == 0


def _take_the_wakeup(daemon: Daemon, sock: Any, peer: zmq.Socket, frames: list[bytes]) -> None:
    """In one turn of the daemon's loop: `peer` sends, libzmq queues the message and wakes the
    daemon's socket, and the log writer's send of a reply on that socket (to a peer gone since)
    clears the wake-up before the loop looks at it."""
    peer.send_multipart(frames)
    time.sleep(0.1)  # blocks the loop: the message lands and its wake-up is posted
    daemon._send_replies([[(sock, b"gone", b"")]])


async def _answer(peer: zmq.Socket, timeout_s: float = 3.0) -> bytes | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(zmq.Again):
            return peer.recv(zmq.NOBLOCK)
        await asyncio.sleep(0.02)
    return None


async def test_a_hello_is_answered_when_a_send_took_the_worker_sockets_wakeup(tmp_path: Path) -> None:
    daemon, task = await _running(tmp_path)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.IDENTITY, f"tr-0#{os.getpid()}".encode())
    try:
        peer.connect(daemon.worker_endpoint)
        await asyncio.sleep(0.5)  # connected, and the ingress waits on an empty socket
        hello = wire.Hello(protocol=wire.PROTOCOL_VERSION, worker_id="tr-0", kind=WorkerKind.TRAINER_RANK,
                           devices=(DEVICES[0],), process=str(os.getpid()))
        _take_the_wakeup(daemon, daemon.workers_sock, peer, [wire.encode(hello)])
        data = await _answer(peer)
        assert data is not None, "the daemon never read the hello"
        welcome = wire.daemon_decoder(1 << 20).decode(data)
        assert isinstance(welcome, wire.Welcome) and welcome.worker_id == "tr-0" and welcome.token
    finally:
        peer.close()
        ctx.term()
        await _stop(daemon, task)


async def test_a_status_request_is_answered_when_a_send_took_the_control_sockets_wakeup(tmp_path: Path) -> None:
    daemon, task = await _running(tmp_path)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(daemon.control_endpoint)
        await asyncio.sleep(0.5)
        _take_the_wakeup(daemon, daemon.control_sock, peer, [b"", wire.encode(wire.StatusRequest())])
        data = await _answer(peer)
        assert data is not None, "the daemon never read the status request"
        reply = wire.reply_decoder().decode(data)
        assert isinstance(reply, wire.ControlReply) and reply.ok and reply.data["split"] == {"train": 2, "rollout": 2}
    finally:
        peer.close()
        ctx.term()
        await _stop(daemon, task)
