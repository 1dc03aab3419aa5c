"""A worker written from docs/protocol.md alone, as an outside author would: a ZeroMQ DEALER
whose identity is `<worker_id>#<process>`, MessagePack maps in and out, and nothing imported
from dynaresized. It registers with a `process` and a `secret` of its own, heartbeats, keeps a
record of every op it ran and answers a re-sent op from that record with the current token, and
says hello again when the docs say to. Given a `holding` it reports what it holds (`actual`) in
its hello, in every answer and when asked, after each op as the docs' tables say (`after`: a test
may make it say otherwise). Tests steer it: `withhold` op kinds whose first answer is kept back
(as if lost on the way), `pause()` it (its connection stays; it reads and sends nothing), and
`report()` steps, mini-batches and empty queues."""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq

_REHELLO = {"stale_token", "missing_token", "not_registered", "unknown_worker"}

AFTER = {"drain": "drained", "release": "released", "join": "serving", "restore": "serving", "commit": "serving",
         "resume": "serving", "reclaim": "drained", "evict": "released"}
"""The holding after each op, from docs/protocol.md: the first of the resize table's, which the
loan tables repeat (a loan's and a return's `join`: `serving`)."""


class LiteralWorker:
    def __init__(self, endpoint: str, worker_id: str, kind: str, devices: list[str], *, holding: str = "",
                 after: dict[str, str] | None = None) -> None:
        self.worker_id, self.kind, self.devices = worker_id, kind, devices
        self.holding = holding  # "": it does not say what it holds (never reconciled)
        self.after = {**AFTER, **(after or {})}
        self.last_op = ""
        self.process = uuid.uuid4().hex  # unique to this process run
        self.secret = secrets.token_hex(16)  # chosen here, sent only in hello, never shown
        self.token = ""
        self.incarnation = 0
        self.boot_id = ""
        self.heartbeat_interval_s = 0.5
        self.records: dict[str, dict[str, Any]] = {}  # op_id -> the op_result it sent (or would have)
        self.withhold: set[str] = set()  # op kinds whose first answer is not sent
        self.ops: list[dict[str, Any]] = []  # every op received, repeats included
        self.errors: list[dict[str, Any]] = []
        self.welcomes: list[dict[str, Any]] = []
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{worker_id}#{self.process}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name=f"literal-{worker_id}", daemon=True)

    # -- steering -------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Say hello until a welcome comes (the docs: retry, a lost hello is not an error)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self.welcomes:
                    return self.welcomes[-1]
            time.sleep(0.05)
        raise AssertionError(f"{self.worker_id}: no welcome in {timeout_s}s; errors {self.errors}")

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self._send(self._hello())  # back from a pause, as after any silence: hello again

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sock.close(0)
        self.ctx.term()

    def report(self, kind: str, **fields: Any) -> None:
        """Send a report of type `kind` (`step_report`, `mini_batch_done`, `queue_empty`, ...)."""
        self._send({"type": kind, "worker_id": self.worker_id, "token": self.token, "sent_at": time.time(), **fields})

    # -- the protocol ----------------------------------------------------------------
    def _actual(self) -> dict[str, Any]:
        return {"actual": {"holding": self.holding, "last_op": self.last_op}} if self.holding else {}

    def _hello(self) -> dict[str, Any]:
        return {"type": "hello", "protocol": 2, "worker_id": self.worker_id, "kind": self.kind,
                "devices": self.devices, "process": self.process, "secret": self.secret, "sent_at": time.time(),
                **self._actual()}

    def _send(self, msg: dict[str, Any]) -> None:
        with self._lock:
            self.sock.send(msgspec.msgpack.encode(msg))

    def _run(self) -> None:
        self._send(self._hello())
        next_hello = time.monotonic() + 1.0
        next_beat = time.monotonic() + self.heartbeat_interval_s
        seq = 0
        while not self._stop.is_set():
            if self._paused.is_set():
                time.sleep(0.05)
                continue
            now = time.monotonic()
            if not self.token and now >= next_hello:  # before the first welcome: retry every second
                self._send(self._hello())
                next_hello = now + 1.0
            if self.token and now >= next_beat:
                seq += 1
                self._send({"type": "heartbeat", "worker_id": self.worker_id, "seq": seq, "token": self.token})
                next_beat = now + self.heartbeat_interval_s
            with self._lock:
                ready = self.sock.poll(50)
                data = self.sock.recv() if ready else None
            if data is not None:
                self._on(msgspec.msgpack.decode(data))

    def _on(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "welcome":
            if msg["incarnation"] >= self.incarnation:  # the highest incarnation is current
                self.incarnation, self.token, self.boot_id = msg["incarnation"], msg["token"], msg["boot_id"]
                self.heartbeat_interval_s = msg["heartbeat_interval_s"]
            with self._lock:
                self.welcomes.append(msg)
        elif kind == "heartbeat_ack":
            if self.boot_id and msg["boot_id"] != self.boot_id:
                self._send(self._hello())
        elif kind == "op":
            self.ops.append(msg)
            self._op(msg)
        elif kind == "state_query" and self.holding:
            self._send({"type": "state_report", "worker_id": self.worker_id, "token": self.token,
                        "sent_at": time.time(), **self._actual()})
        elif kind == "error":
            self.errors.append(msg)
            if msg.get("reason") in _REHELLO and msg.get("token", "") in ("", self.token):
                self._send(self._hello())

    def _op(self, op: dict[str, Any]) -> None:
        record = self.records.get(op["op_id"])
        if record is not None:  # a repeat: answer from the record, with the current token and holding
            self._send({**record, "token": self.token, **self._actual()})
            return
        if self.holding:
            self.holding, self.last_op = self.after[op["kind"]], op["op_id"]
        record = {"type": "op_result", "worker_id": self.worker_id, "op_id": op["op_id"], "ok": True,
                  "detail": f"{op['kind']} done", "token": self.token, **self._actual()}
        self.records[op["op_id"]] = record
        if op["kind"] in self.withhold:
            self.withhold.discard(op["kind"])  # this answer is lost on the way
            return
        self._send(record)
