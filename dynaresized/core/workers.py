"""Workers: who is live. Hellos, heartbeats, goodbyes and state reports, and the tick that
declares silent workers lost and times out, re-sends and audits ops. Emits WorkerRegistered,
WorkerLost, WorkerLeft, WorkerReported, DaemonStalled, OpFailed (a timeout)."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.resizes import acked_set, after_worker_gone, op_failed, pending, send, target_set
from dynaresized.core.state import seen_at
from dynaresized.core.tx import CoreLike, QueryState, Refused, Tx, require_worker
from dynaresized.domain import Worker, WorkerStatus


def on_hello(core: CoreLike, tx: Tx, e: ev.WorkerHello) -> None:
    s = tx.state
    if not e.devices or len(set(e.devices)) != len(e.devices):
        raise Refused("bad_request", "hello must name one or more distinct devices")
    unknown = [d for d in e.devices if d not in s.devices]
    if unknown:
        raise Refused(
            "unknown_device",
            f"device(s) {', '.join(unknown)} are not in this cluster's inventory "
            f"({len(s.devices)} devices configured)",
        )
    for d in e.devices:
        others = sorted(w for w in s.live_owners(d, e.kind) if w != e.worker_id)
        if others:
            raise Refused("device_owned", f"device {d} already has live {e.kind.value} worker {others[0]!r}")
    old = s.workers.get(e.worker_id)
    if old is not None and old.status is WorkerStatus.LIVE and (old.kind, old.devices) != (e.kind, e.devices):
        raise Refused(
            "conflict",
            f"worker {e.worker_id!r} is live as {old.kind.value} on {', '.join(old.devices)}; "
            "use another worker id or stop the old worker",
        )
    if (old is not None and old.status is WorkerStatus.LIVE and old.process and e.process == old.process
            and old.secret_sha256 and e.secret_sha256 != old.secret_sha256):
        # The process value is in the log; the secret is not. Whoever names the live process
        # without its secret is not that process: it gets neither the registration nor a new one.
        raise Refused("not_the_process",
                      f"this hello names worker {e.worker_id!r}'s live process but not its secret; a process "
                      "sends the same secret in every hello (a new process uses a new `process` value)")
    if (e.registered_here and old is not None and old.status is WorkerStatus.LIVE and old.process
            and e.process == old.process):
        _hello_again(core, tx, e)
        return
    if old is not None and old.status is WorkerStatus.LIVE and old.process and e.process != old.process:
        if e.previous_connected:
            raise Refused("duplicate_worker",
                          f"worker {e.worker_id!r} is live in another process whose connection is still open; "
                          "stop that process first, or give this one another worker id")
        # A new process under a live worker's name, the old one's connection gone: the old one
        # died, with whatever it had done for a resize in flight. That is a loss.
        tx.emit(f.WorkerLost(at=e.at, worker_id=e.worker_id, reason="restarted: a new process registered"))
        after_worker_gone(core, tx, e.worker_id, "restarted", e.at)
        old = tx.state.workers[e.worker_id]
    incarnation = 1 if old is None else old.incarnation + 1
    worker = Worker(e.worker_id, e.kind, e.devices, WorkerStatus.LIVE, e.at, incarnation, e.process, e.actual,
                    e.secret_sha256)
    tx.emit(f.WorkerRegistered(at=e.at, worker=worker))
    _resend_pending_to(tx, e.worker_id)


def _resend_pending_to(tx: Tx, worker_id: str) -> None:
    """A worker that says hello gets the op in flight again if it has not answered it: its
    answer may have been lost, and it answers from its record (or re-runs it after a restart)."""
    fl = tx.state.inflight
    if fl is not None and worker_id in target_set(fl) and worker_id not in acked_set(fl):
        send(tx, [worker_id])


def _hello_again(core: CoreLike, tx: Tx, e: ev.WorkerHello) -> None:
    """The registered process says hello again (no heartbeat answer reached it, or its hellos
    crossed on a slow link): its registration stands. A new one per hello would make the
    token it holds stale, its next message would be refused, and it would say hello again."""
    on_heartbeat(core, tx, ev.Heartbeat(at=e.at, worker_id=e.worker_id))
    if e.actual is not None:
        on_state_reported(core, tx, ev.StateReported(at=e.at, worker_id=e.worker_id, actual=e.actual))
    _resend_pending_to(tx, e.worker_id)


def on_heartbeat(core: CoreLike, tx: Tx, e: ev.Heartbeat) -> None:
    require_worker(tx.state, e.worker_id)
    tx.state = seen_at(tx.state, e.worker_id, e.at)


def on_bye(core: CoreLike, tx: Tx, e: ev.WorkerBye) -> None:
    require_worker(tx.state, e.worker_id)
    tx.emit(f.WorkerLeft(at=e.at, worker_id=e.worker_id))
    after_worker_gone(core, tx, e.worker_id, "said goodbye", e.at)


def on_state_reported(core: CoreLike, tx: Tx, e: ev.StateReported) -> None:
    w = require_worker(tx.state, e.worker_id)
    # A worker left out as unconverged that now reports what the log says is recorded even when
    # the report repeats the last one (e.g. its converging op "failed" after it had acted).
    agrees_now = e.worker_id in tx.state.unconverged and tx.state.desired(w) == e.actual.holding
    if e.actual != w.actual or agrees_now:
        tx.emit(f.WorkerReported(at=e.at, worker_id=e.worker_id, actual=e.actual))


# -- the tick --------------------------------------------------------------------------


def on_tick(core: CoreLike, tx: Tx, e: ev.Tick) -> None:
    timeout = core.config.heartbeat_timeout_s
    _credit_stall(core, tx, e.at)
    # Only the silent ones are sorted (into worker id order, for determinism): the rest, nearly
    # every worker at every tick, cost one comparison each.
    late = sorted((w, seen) for w, seen in tx.state.last_seen.items() if e.at - seen > timeout)
    for worker_id, seen in late:
        silent = e.at - seen
        if tx.state.is_live(worker_id):
            tx.emit(f.WorkerLost(at=e.at, worker_id=worker_id,
                                 reason=f"no heartbeat for {silent:.1f}s (heartbeat_timeout_s={timeout:g})"))
            after_worker_gone(core, tx, worker_id, "lost", e.at)
    fl = tx.state.inflight
    if fl is not None and e.at > fl.op_deadline:
        waiting = pending(tx.state)
        reason = (f"{fl.op.kind.value} timed out after {e.at - fl.op_started_at:.1f}s "
                  f"(op_timeout_s={core.config.op_timeout_s:g}); waiting for {', '.join(waiting) or 'nobody'}")
        tx.emit(f.OpFailed(at=e.at, op_id=fl.op.op_id, worker_id=None, reason=reason))
        op_failed(core, tx, reason, e.at)
    _resend_pending(core, tx, e.at)
    _audit(core, tx, e.at)


def _credit_stall(core: CoreLike, tx: Tx, at: float) -> None:
    """After a stall of the daemon, its heartbeat clocks move forward by the time it could not
    watch: messages that waited in its socket meanwhile are read after this tick, and would
    otherwise find every worker already declared lost."""
    s = tx.state
    gap = at - s.last_tick
    if core.config.stall_s is not None and s.last_tick and gap > core.config.stall_s:
        tx.state = replace(s, last_tick=at, seen_base={w: min(at, seen + gap) for w, seen in s.last_seen.items()},
                           seen_recent={})
        fl = tx.state.inflight
        if fl is not None and fl.op_deadline >= s.last_tick:  # the op was still in time when the stall began
            tx.emit(f.DaemonStalled(at=at, seconds=gap, op_deadline=fl.op_deadline + gap))
    else:
        tx.state = replace(s, last_tick=at)


def _resend_pending(core: CoreLike, tx: Tx, at: float) -> None:
    """A lost command or answer costs one re-send interval, not the resize: the pending op
    goes again to its live targets that have not answered (they answer a repeat from their
    record, or keep running the first copy)."""
    fl, every = tx.state.inflight, core.config.op_resend_s
    if fl is None or every is None or fl.index >= len(fl.ops):
        return
    if at - max(tx.state.last_sent, fl.op_started_at) >= every:
        tx.state = replace(tx.state, last_sent=at)
        send(tx, None)


def _audit(core: CoreLike, tx: Tx, at: float) -> None:
    """Now and then, ask every live worker that reports its state what it holds."""
    every = core.config.audit_interval_s
    if every is None or at - tx.state.last_audit < every:
        return
    tx.state = replace(tx.state, last_audit=at)
    for w in sorted(tx.state.workers.values(), key=lambda w: w.worker_id):
        if w.status is WorkerStatus.LIVE and w.actual is not None:
            tx.commands.append(QueryState(worker_id=w.worker_id))
