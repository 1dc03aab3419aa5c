"""Conformance checks for a worker: plays the daemon on an endpoint and drives one worker
through the protocol, rule by rule (docs/protocol.md, "Conformance").

    dynaresized conformance tcp://127.0.0.1:5599 [--json] [--timeout 10] [--round-trip]
                                      [--only CHECK ...] [-- COMMAND ARG ...]

It binds a ROUTER on the endpoint, starts COMMAND if given (each `{endpoint}` in it replaced by
the endpoint, which is also in its environment as DYNARESIZED_ENDPOINT), waits for one worker to
say hello and runs the checks of `protocol_doc.CONFORMANCE` against it, in that order: each one
sends what a daemon would and says which rule the answer broke. Exit status 0 when no check
failed, 1 when one did (2: bad arguments).
"""

from __future__ import annotations

import argparse
import enum
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq

from dynaresized import wire
from dynaresized.domain import Holding, OpKind, PlanKind, Pool, WorkerKind
from dynaresized.protocol_doc import CONFORMANCE, HOLDING_AFTER, LENT_FROM, LENT_TO, LOAN_STEPS


class Outcome(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


class CheckResult(msgspec.Struct, frozen=True):
    name: str
    outcome: Outcome
    detail: str


class Broken(Exception):
    """The worker broke the rule a check checks; the message says how."""


class Skip(Exception):
    """The check does not apply to this worker; the message says why."""


class DaemonSide:
    """The daemon's end of the worker endpoint: a ROUTER bound there, frames in and out."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.endpoint = endpoint
        self.bind(wait_s=0.0)

    def bind(self, wait_s: float = 5.0) -> None:
        """Bind a new ROUTER on the endpoint (again: the port a restarted daemon binds)."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)  # as the daemon: a held identity is not taken over
        deadline = time.monotonic() + wait_s
        while True:
            try:
                sock.bind(self.endpoint)
                break
            except zmq.ZMQError as exc:  # the old socket's port may take a moment to be free
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.05)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # a `*` port resolved, for the rebind
        self.sock = sock

    def unbind(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def recv(self, timeout_s: float) -> list[bytes] | None:
        """[identity, frame, ...] of the next message, or None after `timeout_s`."""
        if self.sock is None or not self.sock.poll(max(int(timeout_s * 1000), 0)):
            return None
        return self.sock.recv_multipart()

    def send(self, identity: bytes, data: bytes) -> None:
        if self.sock is not None:
            self.sock.send_multipart([identity, data])

    def close(self) -> None:
        self.unbind()
        self.ctx.term()


class Conversation:
    """What the daemon says to one worker, and what it heard: registrations (token, incarnation,
    boot id) and every message received. Heartbeats are answered while `acking`."""

    def __init__(self, side: DaemonSide, timeout_s: float, heartbeat_interval_s: float,
                 heartbeat_timeout_s: float, hello_timeout_s: float = 60.0) -> None:
        self.side = side
        self.timeout_s = timeout_s
        self.hello_timeout_s = hello_timeout_s  # the first hello: the worker may be starting
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.decoder = wire.worker_decoder()
        self.boot_id = uuid.uuid4().hex
        self.identity = b""
        self.first: wire.Hello | None = None
        self.hello: wire.Hello | None = None  # the latest
        self.token = ""
        self.tokens: list[str] = []  # every token handed out, oldest first
        self.incarnation = 0
        self.acking = True
        self.ops = 0

    # -- receiving ---------------------------------------------------------------------
    def receive(self, timeout_s: float) -> Any | None:
        """The next message from the worker (None after `timeout_s`), heartbeats answered. The
        conversation is with the first worker to say hello; other workers on the endpoint (a
        program that runs an engine and a trainer) are welcomed and kept alive, not checked."""
        deadline = time.monotonic() + timeout_s
        while (frames := self.side.recv(deadline - time.monotonic())) is not None:
            identity, payload = frames[0], frames[1:]
            try:
                msg = self.decoder.decode(payload[0]) if len(payload) == 1 else None
            except wire.WireError as exc:
                msg, error = None, exc
            else:
                error = None
            if self.hello is not None and identity != self.identity and not (
                    isinstance(msg, wire.Hello) and msg.worker_id == self.hello.worker_id):
                if msg is not None and msg.worker_id == self.hello.worker_id:
                    raise Broken(f"a {msg.__struct_config__.tag} of {msg.worker_id!r} from connection {identity!r}; "
                                 f"its hello came from {self.identity!r}")
                self._bystander(identity, msg)
                continue
            if len(payload) != 1:
                raise Broken(f"a message of {len(payload)} frames; every message is exactly one frame")
            if error is not None:
                raise Broken(f"a frame the daemon cannot decode ({error}); every message is one msgpack map")
            if isinstance(msg, wire.Hello):
                self.identity = identity
            elif isinstance(msg, wire.Heartbeat) and self.acking:
                self.send(wire.HeartbeatAck(seq=msg.seq, boot_id=self.boot_id))
            return msg
        return None

    def _bystander(self, identity: bytes, msg: Any) -> None:
        """Another worker on the endpoint: registered and its heartbeats answered, so that a
        program which needs all its workers registered keeps running; nothing else."""
        if isinstance(msg, wire.Hello):
            released = msg.actual is not None and msg.actual.holding is Holding.RELEASED
            self.side.send(identity, wire.encode(wire.Welcome(
                protocol=wire.PROTOCOL_VERSION, worker_id=msg.worker_id, incarnation=1, boot_id=self.boot_id,
                heartbeat_interval_s=self.heartbeat_interval_s, heartbeat_timeout_s=self.heartbeat_timeout_s,
                token=uuid.uuid4().hex, pool=msg.kind.pool.other if released else msg.kind.pool,
                desired=Holding.RELEASED if released else Holding.SERVING)))
        elif isinstance(msg, wire.Heartbeat) and self.acking:
            self.side.send(identity, wire.encode(wire.HeartbeatAck(seq=msg.seq, boot_id=self.boot_id)))

    def expect(self, what: str, match: Callable[[Any], bool], timeout_s: float | None = None) -> Any:
        """The first message for which `match` holds; Broken after the timeout, naming what came."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            msg = self.receive(left)
            if msg is None:
                break
            if match(msg):
                return msg
            seen.append(msg.__struct_config__.tag)
        got = f"; got {_count(seen)}" if seen else "; nothing came"
        raise Broken(f"no {what} within {timeout_s:g}s{got}")

    def listen(self, seconds: float) -> list[Any]:
        """Everything the worker sends for `seconds`."""
        deadline, out = time.monotonic() + seconds, []
        while (left := deadline - time.monotonic()) > 0:
            msg = self.receive(left)
            if msg is not None:
                out.append(msg)
        return out

    # -- sending -----------------------------------------------------------------------
    def send(self, msg: msgspec.Struct | bytes) -> None:
        self.side.send(self.identity, msg if isinstance(msg, bytes) else wire.encode(msg))

    def welcome(self, hello: wire.Hello) -> wire.Welcome:
        """A new registration for `hello`: the next incarnation, a new token."""
        self.hello = hello
        self.incarnation += 1
        self.token = uuid.uuid4().hex
        self.tokens.append(self.token)
        welcome = wire.Welcome(protocol=wire.PROTOCOL_VERSION, worker_id=hello.worker_id,
                               incarnation=self.incarnation, boot_id=self.boot_id,
                               heartbeat_interval_s=self.heartbeat_interval_s,
                               heartbeat_timeout_s=self.heartbeat_timeout_s, token=self.token,
                               pool=self.pool if self.holding is not Holding.RELEASED else self.pool.other,
                               desired=Holding.RELEASED if self.holding is Holding.RELEASED else Holding.SERVING)
        self.send(welcome)
        return welcome

    @property
    def kind(self) -> WorkerKind:
        assert self.hello is not None
        return self.hello.kind

    @property
    def pool(self) -> Pool:
        """The worker's home pool: where its devices are when it serves."""
        return self.kind.pool

    @property
    def holding(self) -> Holding | None:
        """What the worker said it holds in its first hello (None: it does not say)."""
        assert self.first is not None
        return self.first.actual.holding if self.first.actual is not None else None

    def op(self, kind: OpKind, from_pool: Pool, to_pool: Pool, *, landing: Pool,
           plan: PlanKind = PlanKind.RESIZE) -> wire.OpCommand:
        """An op on the worker's devices, as the daemon would send it (`landing`: where the
        devices are once the sequence ends, or once it is rolled back)."""
        assert self.hello is not None
        self.ops += 1
        devices = tuple(self.hello.devices)
        return wire.OpCommand(op_id=f"k{self.ops}/{kind.value}-{uuid.uuid4().hex[:6]}",
                              resize_id=f"k{self.ops}", kind=kind, devices=devices, from_pool=from_pool,
                              to_pool=to_pool, timeout_s=self.timeout_s,
                              training=devices if landing is Pool.TRAINING else (),
                              rollout=devices if landing is Pool.ROLLOUT else (), plan=plan)

    def result_of(self, op: wire.OpCommand, timeout_s: float | None = None) -> wire.OpResult:
        return self.expect(f"op_result for {op.op_id}",
                           lambda m: isinstance(m, wire.OpResult) and m.op_id == op.op_id, timeout_s)

    def current_token(self, msg: Any, what: str) -> None:
        if msg.token != self.token:
            earlier = " (an earlier registration's)" if msg.token in self.tokens else ""
            raise Broken(f"{what} carried token {msg.token!r}{earlier}, not the current registration's "
                         f"{self.token!r}")

    def heartbeat_with_token(self) -> wire.Heartbeat:
        """The next heartbeat carrying the current token (in-flight ones may carry the last)."""
        token = self.token
        return self.expect("heartbeat with the current token",
                           lambda m: isinstance(m, wire.Heartbeat) and m.token == token,
                           self.timeout_s + 2 * self.heartbeat_interval_s)

    def hello_again(self, why: str, timeout_s: float | None = None) -> wire.Hello:
        """The worker's next hello, which must come from the same process; welcomed."""
        hello = self.expect(f"hello after {why}", lambda m: isinstance(m, wire.Hello), timeout_s)
        self.same_process(hello)
        return hello

    def same_process(self, hello: wire.Hello) -> None:
        assert self.first is not None
        if hello.process != self.first.process:
            raise Broken(f"the hello names process {hello.process!r}; this process said {self.first.process!r} "
                         "before (a new value means a restarted worker)")
        if getattr(hello, "secret", "") != getattr(self.first, "secret", ""):
            raise Broken("the hello carries another `secret` than this process's first one")
        _check_identity(self.identity, hello)


def _count(tags: list[str]) -> str:
    counts: dict[str, int] = {}
    for t in tags:
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} {t}" for t, n in counts.items())


def _check_identity(identity: bytes, hello: wire.Hello) -> None:
    """The connection is named `<worker_id>#<process>` (the daemon refuses others: wrong_identity)."""
    expected = f"{hello.worker_id}#{hello.process}".encode()
    if identity != expected:
        raise Broken(f"connection identity {identity!r}; it must be <worker_id>#<process>, {expected!r}")


# -- the checks -------------------------------------------------------------------------------
Check = Callable[[Conversation], str]


def check_hello(c: Conversation) -> str:
    hello = c.expect("hello", lambda m: isinstance(m, wire.Hello), c.hello_timeout_s)
    c.first = hello
    c.hello = hello
    _check_identity(c.identity, hello)
    if hello.protocol != wire.PROTOCOL_VERSION:
        raise Broken(f"protocol {hello.protocol}; this daemon speaks {wire.PROTOCOL_VERSION} (it answers bad_version)")
    if not hello.process:
        raise Broken("no `process`: the daemon cannot tell a restarted worker from a reconnecting one")
    c.welcome(hello)
    actual = f"holding {hello.actual.holding.value}" if hello.actual else "no actual state (never reconciled)"
    return f"{hello.worker_id} ({hello.kind.value}) on {', '.join(hello.devices)}: {actual}"


def check_heartbeat(c: Conversation) -> str:
    window = max(4 * c.heartbeat_interval_s, c.timeout_s)
    beats = [c.expect("heartbeat", lambda m: isinstance(m, wire.Heartbeat), window) for _ in range(2)]
    for hb in beats:
        c.current_token(hb, "a heartbeat")
    return f"seq {beats[0].seq}, {beats[1].seq} with the welcome's token"


def check_state_query(c: Conversation) -> str:
    if c.holding is None:
        raise Skip("the worker's hello carries no `actual`: it does not report its state")
    c.send(wire.StateQuery(boot_id=c.boot_id))
    report = c.expect("state_report", lambda m: isinstance(m, wire.StateReport))
    c.current_token(report, "the state_report")
    return f"holding {report.actual.holding.value}"


def _undo_op(c: Conversation) -> wire.OpCommand:
    """An undo with nothing to undo: `resume` to a serving worker (undo of a drain that would
    move its devices out), `evict` to a released one (undo of a join that would bring them in)."""
    if c.holding in (None, Holding.SERVING, Holding.DRAINED):
        return c.op(OpKind.RESUME, c.pool, c.pool.other, landing=c.pool)
    if c.holding is Holding.RELEASED:
        return c.op(OpKind.EVICT, c.pool.other, c.pool, landing=c.pool.other)
    raise Skip(f"the worker holds {c.holding.value}: it takes no ops")


def _check_result(c: Conversation, op: wire.OpCommand, result: wire.OpResult) -> None:
    c.current_token(result, f"the op_result for {op.op_id}")
    if not result.ok:
        raise Broken(f"{op.kind.value} failed ({result.detail!r}); an undo with nothing to undo succeeds")
    if c.holding is not None:
        if result.actual is None:
            raise Broken(f"the op_result for {op.op_id} carries no `actual`, though the hello did")
        _check_holding(op.kind, result.actual.holding)


def _check_holding(kind: OpKind, holding: Holding) -> None:
    if holding not in HOLDING_AFTER[kind]:
        expected = " or ".join(h.value for h in HOLDING_AFTER[kind])
        raise Broken(f"after {kind.value} the worker reports holding {holding.value}; it should be {expected}")


def _loan_role(c: Conversation) -> str:
    """The worker's part in a loan of its devices: a serving one lends them to the other pool
    (lent-from), a released one serves on devices lent to its pool (lent-to)."""
    if c.holding in (None, Holding.SERVING):
        return LENT_FROM
    if c.holding is Holding.RELEASED:
        return LENT_TO
    raise Skip(f"the worker holds {c.holding.value}: it takes no ops")


def _loan_sequence(c: Conversation, plan: PlanKind) -> list[str]:
    """Send the worker its ops of a loan (or of its return) as protocol_doc.LOAN_STEPS lists
    them; Broken when an op fails or the worker reports another holding than the table, after
    an op or in a `state_report` once the sequence is over."""
    role = _loan_role(c)
    home = c.pool if role == LENT_FROM else c.pool.other  # the devices' home pool
    from_pool, to_pool = (home, home.other) if plan is PlanKind.LOAN else (home.other, home)
    end = "once the loan landed" if plan is PlanKind.LOAN else "once the loan is home"
    seen = []
    for step in LOAN_STEPS[plan]:
        if step.to != role:
            continue
        op = c.op(step.op, from_pool, to_pool, landing=to_pool, plan=plan)
        c.send(op)
        result = c.result_of(op)
        c.current_token(result, f"the op_result for {op.op_id}")
        if not result.ok:
            raise Broken(f"the {plan.value}'s {step.op.value} failed: {result.detail!r}")
        if c.holding is not None and result.actual is None:
            raise Broken(f"the op_result for {op.op_id} carries no `actual`, though the hello did")
        if result.actual is not None:
            _check_loan_holding(plan, step.op, role, step.reports(role), result.actual.holding,
                                f"after the {plan.value}'s {step.op.value} the worker reports")
        seen.append(f"{step.op.value} -> {result.actual.holding.value if result.actual else '?'}")
    if c.holding is not None:
        c.send(wire.StateQuery(boot_id=c.boot_id))
        report = c.expect(f"state_report {end}", lambda m: isinstance(m, wire.StateReport))
        _check_loan_holding(plan, None, role, LOAN_STEPS[plan][-1].reports(role), report.actual.holding,
                            f"{end}, its state_report says")
        seen.append(f"state_report {report.actual.holding.value}")
    return seen


def _check_loan_holding(plan: PlanKind, op: OpKind | None, role: str, want: Holding, got: Holding,
                        said: str) -> None:
    """Broken unless `got` is the holding `want` of the `plan`'s table (`op`: after that op; None:
    once the sequence is over); `said` begins the message."""
    if got is want:
        return
    why = f"the protocol's {plan.value} table says {want.value} for the {role} worker"
    if op is OpKind.JOIN and got is Holding.DRAINED:
        why += (": no restore or commit follows this join, so the worker takes work from it; one that stays "
                "drained takes none, and the daemon reconciles it with a resume after every loan and return")
    elif op is None:
        why += " (the daemon would reconcile it)"
    raise Broken(f"{said} holding {got.value}; {why}")


class Checker:
    """Runs the checks in order on one conversation, keeping what later checks reuse."""

    def __init__(self, c: Conversation, round_trip: bool) -> None:
        self.c = c
        self.round_trip = round_trip
        self.answered: tuple[wire.OpCommand, wire.OpResult] | None = None  # an op and its first answer
        self.lent: bool | None = None  # the loan check lent the worker's devices (None: it did not run)

    def checks(self) -> dict[str, Check]:
        return {
            "hello": check_hello,
            "heartbeat": check_heartbeat,
            "state-query": check_state_query,
            "op": self.check_op,
            "op-resent": self.check_op_resent,
            "op-resent-at-once": self.check_op_resent_at_once,
            "unknown-fields": self.check_unknown_fields,
            "bad-frames": self.check_bad_frames,
            "stale-token-of-earlier-registration": self.check_stale_token_of_earlier_registration,
            "new-boot-id": self.check_new_boot_id,
            "op-resent-after-reregistration": self.check_op_resent_after_reregistration,
            "stale-token": self.check_stale_token,
            "not-registered": self.check_not_registered,
            "welcomes-crossing": self.check_welcomes_crossing,
            "daemon-restart": self.check_daemon_restart,
            "round-trip": self.check_round_trip,
            "loan": self.check_loan,
            "loan-return": self.check_loan_return,
        }

    def _answered(self) -> tuple[wire.OpCommand, wire.OpResult]:
        if self.answered is None:
            op = _undo_op(self.c)
            self.c.send(op)
            self.answered = (op, self.c.result_of(op))
        return self.answered

    def check_op(self, c: Conversation) -> str:
        op, result = self._answered()
        _check_result(c, op, result)
        held = f", holding {result.actual.holding.value}" if result.actual else ""
        return f"{op.kind.value} {op.op_id}: ok{held} ({result.detail!r})"

    def _same_answer(self, first: wire.OpResult, again: wire.OpResult) -> None:
        for field in ("ok", "detail", "duration_s"):
            if getattr(first, field) != getattr(again, field):
                raise Broken(f"the re-sent {first.op_id} was answered with another {field} "
                             f"({getattr(first, field)!r}, then {getattr(again, field)!r}): it ran again, "
                             "instead of answering from the record of its first run")

    def check_op_resent(self, c: Conversation) -> str:
        op, first = self._answered()
        c.send(op)
        again = c.result_of(op)
        c.current_token(again, "the answer to the re-sent op")
        self._same_answer(first, again)
        return f"{op.op_id} answered from the record"

    def check_op_resent_at_once(self, c: Conversation) -> str:
        op = _undo_op(c)
        c.send(op)
        c.send(op)
        first = c.result_of(op)
        answers = [first] + [m for m in c.listen(max(1.0, 4 * c.heartbeat_interval_s))
                             if isinstance(m, wire.OpResult) and m.op_id == op.op_id]
        for again in answers[1:]:
            self._same_answer(first, again)
        return f"{len(answers)} answer(s), all the same"

    def check_unknown_fields(self, c: Conversation) -> str:
        op = _undo_op(c)
        c.send(msgspec.msgpack.encode({**msgspec.to_builtins(op), "added_in_a_later_version": [1, "x"]}))
        result = c.result_of(op)
        c.current_token(result, f"the op_result for {op.op_id}")
        c.acking = False
        try:
            hb = c.expect("heartbeat", lambda m: isinstance(m, wire.Heartbeat), c.timeout_s)
            c.send(msgspec.msgpack.encode({**msgspec.to_builtins(wire.HeartbeatAck(seq=hb.seq, boot_id=c.boot_id)),
                                           "added_in_a_later_version": {"a": 1}}))
        finally:
            c.acking = True
        later = c.listen(2 * c.heartbeat_interval_s)
        if any(isinstance(m, wire.Hello) for m in later):
            raise Broken("a heartbeat_ack with an extra field made the worker say hello again")
        return "an op and a heartbeat_ack with an extra field were acted on"

    def check_bad_frames(self, c: Conversation) -> str:
        for frame in (b"\xc1", b"", msgspec.msgpack.encode({"type": "no_such_message"}),
                      msgspec.msgpack.encode({"type": "op", "op_id": "half"}), msgspec.msgpack.encode([1, 2])):
            c.send(frame)
        if c.holding is not None:
            c.send(wire.StateQuery(boot_id=c.boot_id))
            c.expect("state_report after the bad frames", lambda m: isinstance(m, wire.StateReport))
        else:
            op = _undo_op(c)
            c.send(op)
            c.result_of(op)
        c.heartbeat_with_token()
        return "five bad frames ignored; the worker still answers"

    def check_stale_token_of_earlier_registration(self, c: Conversation) -> str:
        old = uuid.uuid4().hex  # a token this worker may have held: not the current one
        c.send(wire.Error(code=wire.ErrorCode.REFUSED, message="token of an earlier registration",
                          reason="stale_token", ref_type="heartbeat", token=old))
        said = [m for m in c.listen(max(1.0, 3 * c.heartbeat_interval_s)) if isinstance(m, wire.Hello)]
        if said:
            raise Broken("a stale_token refusal of another token made the worker say hello again; it is about an "
                         "earlier registration and is ignored")
        c.heartbeat_with_token()
        return "ignored"

    def _reregistered(self, c: Conversation, why: str) -> str:
        hello = c.hello_again(why)
        c.welcome(hello)
        c.heartbeat_with_token()
        return f"hello again; incarnation {c.incarnation} and its token carried"

    def check_new_boot_id(self, c: Conversation) -> str:
        c.boot_id = uuid.uuid4().hex  # the next acks say the daemon restarted
        return self._reregistered(c, "a heartbeat_ack with a new boot_id")

    def check_op_resent_after_reregistration(self, c: Conversation) -> str:
        op, first = self._answered()
        if first.token == c.token:  # answered under this registration: the daemon restarts first
            c.boot_id = uuid.uuid4().hex
            self._reregistered(c, "a heartbeat_ack with a new boot_id")
        c.send(op)
        again = c.result_of(op)
        c.current_token(again, "the answer to an op re-sent after the re-registration")
        self._same_answer(first, again)
        return f"{op.op_id} answered from the record under the new token"

    def _refused(self, c: Conversation, reason: str) -> str:
        c.send(wire.Error(code=wire.ErrorCode.REFUSED, message=f"refused: {reason}", reason=reason,
                          ref_type="heartbeat", token=c.token))
        return self._reregistered(c, f"a {reason} refusal")

    def check_stale_token(self, c: Conversation) -> str:
        return self._refused(c, "stale_token")

    def check_not_registered(self, c: Conversation) -> str:
        return self._refused(c, "not_registered")

    def check_welcomes_crossing(self, c: Conversation) -> str:
        c.boot_id = uuid.uuid4().hex
        hello = c.hello_again("a heartbeat_ack with a new boot_id")
        older = c.welcome(hello)  # two answers back to back, as to two hellos a daemon read together
        newer = c.welcome(hello)
        c.heartbeat_with_token()
        return f"incarnation {newer.incarnation}'s token carried, not {older.incarnation}'s"

    def check_daemon_restart(self, c: Conversation) -> str:
        c.side.unbind()
        time.sleep(min(0.5, c.heartbeat_interval_s))
        c.side.bind()
        c.boot_id = uuid.uuid4().hex
        c.acking = False  # a daemon that does not know this registration: nothing but a hello is answered
        try:
            hello = c.hello_again("the daemon's socket was replaced", c.heartbeat_timeout_s + c.timeout_s)
        finally:
            c.acking = True
        c.welcome(hello)
        c.heartbeat_with_token()
        return f"hello again on the new socket; incarnation {c.incarnation}'s token carried"

    def check_round_trip(self, c: Conversation) -> str:
        if not self.round_trip:
            raise Skip("run with --round-trip: it moves the worker's devices out and back")
        home, other = c.pool, c.pool.other
        if c.holding in (None, Holding.SERVING):  # a move out of its pool, rolled back
            steps = [(OpKind.DRAIN, home, other, other), (OpKind.RELEASE, home, other, other),
                     (OpKind.RECLAIM, home, other, home), (OpKind.RESUME, home, other, home)]
        elif c.holding is Holding.RELEASED:  # a move into its pool, rolled back
            steps = [(OpKind.JOIN, other, home, home), (OpKind.RESTORE, other, home, home),
                     (OpKind.EVICT, other, home, other)]
        else:
            raise Skip(f"the worker holds {c.holding.value}: it takes no ops")
        seen = []
        for kind, from_pool, to_pool, landing in steps:
            op = c.op(kind, from_pool, to_pool, landing=landing)
            c.send(op)
            result = c.result_of(op)
            c.current_token(result, f"the op_result for {op.op_id}")
            if not result.ok:
                raise Broken(f"{kind.value} failed: {result.detail!r}")
            if result.actual is not None:
                _check_holding(kind, result.actual.holding)
            seen.append(f"{kind.value} -> {result.actual.holding.value if result.actual else '?'}")
        return ", ".join(seen)

    def check_loan(self, c: Conversation) -> str:
        if not self.round_trip:
            raise Skip("run with --round-trip: it lends the worker's devices to the other pool")
        role = _loan_role(c)
        self.lent = False
        seen = _loan_sequence(c, PlanKind.LOAN)
        self.lent = True
        return f"as the {role} worker: " + ", ".join(seen)

    def check_loan_return(self, c: Conversation) -> str:
        if not self.round_trip:
            raise Skip("run with --round-trip: it brings the worker's lent devices home")
        if self.lent is False:
            raise Skip("the loan check failed: nothing is lent to bring home")
        if self.lent is None:  # the loan check did not run: lend first
            try:
                _loan_sequence(c, PlanKind.LOAN)
            except Broken as exc:
                raise Broken(f"the loan before the return: {exc}") from None
        seen = _loan_sequence(c, PlanKind.RETURN)
        self.lent = None
        return f"as the {_loan_role(c)} worker: " + ", ".join(seen)


def run_checks(c: Conversation, *, only: Sequence[str] = (), round_trip: bool = False) -> list[CheckResult]:
    """Every check (or `hello` and those in `only`) in order; after a failed `hello` the others
    are skipped."""
    checker = Checker(c, round_trip)
    results: list[CheckResult] = []
    for name, check in checker.checks().items():
        if only and name != "hello" and name not in only:
            continue
        if results and results[0].outcome is not Outcome.PASSED:
            results.append(CheckResult(name, Outcome.SKIPPED, "needs a registered worker (hello failed)"))
            continue
        try:
            results.append(CheckResult(name, Outcome.PASSED, check(c)))
        except Broken as exc:
            results.append(CheckResult(name, Outcome.FAILED, str(exc)))
        except Skip as exc:
            results.append(CheckResult(name, Outcome.SKIPPED, str(exc)))
    return results


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog,
                                usage="%(prog)s ENDPOINT [options] [-- COMMAND ARG ...]",
                                description=__doc__.split("\n\n")[0],
                                epilog="After --: the worker to start ({endpoint} in it is replaced); without it, "
                                       "start the worker yourself. Checks: "
                                       + ", ".join(name for name, _ in CONFORMANCE))
    p.add_argument("endpoint", help="where to bind the daemon's worker endpoint, e.g. tcp://127.0.0.1:5599 "
                                    "(tcp://127.0.0.1:* picks a free port)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each answer (default 10)")
    p.add_argument("--hello-timeout", type=float, default=60.0,
                   help="seconds to wait for the worker's first hello, its start included (default 60)")
    p.add_argument("--heartbeat-interval", type=float, default=0.5, help="announced in welcome (default 0.5)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="announced in welcome (default 5)")
    p.add_argument("--only", action="append", default=[], metavar="CHECK", help="run only these checks (repeatable)")
    p.add_argument("--round-trip", action="store_true",
                   help="also move the worker's devices out and back through its ops (round-trip), and lend "
                        "them and bring them home (loan, loan-return)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None, prog: str = "dynaresized conformance") -> int:
    """Run the checks as the command line `argv` says (`prog` names the command in usage and help)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = _parser(prog).parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    names = {name for name, _ in CONFORMANCE}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        print(f"conformance: no check named {', '.join(unknown)}; the checks: {', '.join(sorted(names))}",
              file=sys.stderr)
        return 2
    try:
        side = DaemonSide(args.endpoint)
    except zmq.ZMQError as exc:
        print(f"conformance: cannot bind {args.endpoint}: {exc} (is a daemon running there?)", file=sys.stderr)
        return 2
    worker: subprocess.Popen[bytes] | None = None
    try:
        if command:
            cmd = [part.replace("{endpoint}", side.endpoint) for part in command]
            # the worker's own output goes to stderr: stdout carries only the report
            worker = subprocess.Popen(cmd, env={**os.environ, "DYNARESIZED_ENDPOINT": side.endpoint},
                                      stdout=2)
        elif not args.json:
            print(f"conformance: waiting for a worker on {side.endpoint}", file=sys.stderr, flush=True)
        c = Conversation(side, args.timeout, args.heartbeat_interval, args.heartbeat_timeout, args.hello_timeout)
        results = run_checks(c, only=args.only, round_trip=args.round_trip)
    finally:
        side.close()
        if worker is not None:
            _stop(worker)
    failed = [r for r in results if r.outcome is Outcome.FAILED]
    if args.json:
        print(msgspec.json.encode({"endpoint": side.endpoint, "passed": not failed, "checks": results}).decode())
    else:
        for r in results:
            print(f"{r.outcome.value.upper():7} {r.name}: {r.detail}")
        print(f"{len(results) - len(failed)} of {len(results)} checks did not fail" + (
            f"; failed: {', '.join(r.name for r in failed)}" if failed else ""))
    return 1 if failed else 0


def _stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.terminate()
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


if __name__ == "__main__":
    raise SystemExit(main())
