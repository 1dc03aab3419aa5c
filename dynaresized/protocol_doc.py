"""Renders docs/protocol.md from the wire protocol's JSON schema, so the document cannot drift.

    python -m dynaresized.protocol_doc > docs/protocol.md

tests/test_wire.py fails when the committed file differs from what this renders.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from dynaresized import wire
from dynaresized.domain import Holding, OpKind, PlanKind

HOLDING_AFTER: dict[OpKind, tuple[Holding, ...]] = {
    OpKind.DRAIN: (Holding.DRAINED,),
    OpKind.RELEASE: (Holding.RELEASED,),
    OpKind.JOIN: (Holding.SERVING, Holding.DRAINED),
    OpKind.RESTORE: (Holding.SERVING, Holding.DRAINED),
    OpKind.COMMIT: (Holding.SERVING,),
    OpKind.RESUME: (Holding.SERVING,),
    OpKind.RECLAIM: (Holding.DRAINED, Holding.SERVING),
    OpKind.EVICT: (Holding.RELEASED,),
}
"""The `holding` a worker reports once it performed an op on its devices: what the op leads to,
then what is accepted as well. The conformance round trip checks workers against it."""

FOLLOWS_AFTER: frozenset[OpKind] = frozenset({OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT, OpKind.RECLAIM,
                                              OpKind.RESUME})
"""The ops after which an engine worker whose `op.engine` another device leads (a member of a
wider engine) reports `released` instead of what `HOLDING_AFTER` says: it holds nothing while
the worker of the engine's first device runs it."""

LENT_FROM, LENT_TO = "lent-from", "lent-to"
"""The two workers on a lent device: the one of its home pool's kind, and the one of the other kind."""


class LoanStep(msgspec.Struct, frozen=True):
    """One op of a loan or of its return: who gets it, what it does there, and the `holding`
    each of the device's two workers reports once it is done (the one that got no op reports
    what it reported last)."""

    op: OpKind
    to: str  # LENT_FROM or LENT_TO
    does: str
    lent_from: Holding
    lent_to: Holding

    def reports(self, role: str) -> Holding:
        return self.lent_from if role == LENT_FROM else self.lent_to


LOAN_STEPS: dict[PlanKind, tuple[LoanStep, ...]] = {
    PlanKind.LOAN: (
        LoanStep(OpKind.DRAIN, LENT_FROM, "stops taking work, as in a resize", Holding.DRAINED, Holding.RELEASED),
        LoanStep(OpKind.RELEASE, LENT_FROM, "gives the device up (a lent engine may stay loaded, asleep)",
                 Holding.RELEASED, Holding.RELEASED),
        LoanStep(OpKind.JOIN, LENT_TO, "takes the device and works from the join on: no `restore` or `commit` "
                 "follows", Holding.RELEASED, Holding.SERVING),
    ),
    PlanKind.RETURN: (
        LoanStep(OpKind.DRAIN, LENT_TO, "stops taking work", Holding.RELEASED, Holding.DRAINED),
        LoanStep(OpKind.RELEASE, LENT_TO, "gives the device up", Holding.RELEASED, Holding.RELEASED),
        LoanStep(OpKind.JOIN, LENT_FROM, "takes its device back and works from the join on: no `restore` or "
                 "`commit` follows", Holding.SERVING, Holding.RELEASED),
    ),
}
"""The op sequences of a loan and of its return, and what each worker reports after each op.
Once the last op is done (the loan landed, or is home) the daemon expects the last row: what
the log says each worker should hold (`ClusterState.desired`)."""

HOLDING_NOTES: dict[OpKind, str] = {
    OpKind.DRAIN: "it holds its device but takes no new work",
    OpKind.RELEASE: "it holds nothing: engine asleep, paused or stopped; trainer out of its group, state parked",
    OpKind.JOIN: "`serving` if it works from the join on (a trainer in the group from the join's boundary; "
                 "every worker in a loan and its return, where no `commit` follows); `drained` if it holds the "
                 "device but takes work only from `commit` (an engine loaded, not admitting yet)",
    OpKind.RESTORE: "as after `join`",
    OpKind.COMMIT: "every receiver's devices are in its kind's pool now (a regroup's member: `released`, "
                   "below)",
    OpKind.RESUME: "from `drained` and from `released` alike: a released worker takes its device back first",
    OpKind.RECLAIM: "it holds its device again and works only after the `resume` that follows (`serving` if it "
                    "never stopped: nothing to undo)",
    OpKind.EVICT: "it gave the device back",
}

CONFORMANCE: tuple[tuple[str, str], ...] = (
    ("hello", "The first message is a `hello` of this protocol version with a non-empty `process`, from a "
              "connection whose ZeroMQ identity is `<worker_id>#<process>`."),
    ("heartbeat", "Heartbeats follow the welcome, each carrying its `token` (two within four "
                  "`heartbeat_interval_s` and the checker's timeout)."),
    ("state-query", "A `state_query` is answered with a `state_report` carrying the token and `actual` (skipped "
                    "for a worker whose hello carries no `actual`: it is never reconciled)."),
    ("op", "An op is answered with an `op_result` carrying its `op_id`, the token and `actual`; an undo with "
           "nothing to undo (`resume` to a serving worker, `evict` to a released one) succeeds, and `holding` "
           "is then what the resize table (*What a worker reports between the steps of a resize*) says."),
    ("op-resent", "The same `op_id` sent again is answered from the record of its first run (the same `ok`, "
                  "`detail` and `duration_s`), not run again."),
    ("op-resent-at-once", "An op sent twice back to back runs once: every answer to it is the same."),
    ("unknown-fields", "Fields the worker does not know (a newer daemon's) are ignored: an `op` and a "
                       "`heartbeat_ack` with an extra field are acted on."),
    ("bad-frames", "Frames that are no message (not msgpack, an unknown `type`, missing fields, empty) are "
                   "ignored: the worker keeps answering."),
    ("stale-token-of-earlier-registration", "A `stale_token` refusal whose `error.token` is not the current "
                                            "token is ignored: no new hello."),
    ("new-boot-id", "A `heartbeat_ack` with a new `boot_id` (the daemon restarted) makes the worker say hello "
                    "again from the same `process` (and `secret`), then carry the new token."),
    ("op-resent-after-reregistration", "After a re-registration a re-sent op is answered from the record, "
                                       "under the new registration's token."),
    ("stale-token", "A `stale_token` refusal carrying the current token makes the worker say hello again and "
                    "carry the new token."),
    ("not-registered", "A `not_registered` refusal makes the worker say hello again."),
    ("welcomes-crossing", "When two welcomes answer one hello, the one with the higher `incarnation` is "
                          "current: its token is carried."),
    ("daemon-restart", "The daemon's socket closes and a new one is bound on the same endpoint, answering "
                       "nothing but a hello: the worker says hello again (same `process`) within "
                       "`heartbeat_timeout_s` and the checker's timeout, and carries the new token."),
    ("round-trip", "(with `--round-trip`) The ops of a move and its rollback succeed, and after each the "
                   "worker reports the `holding` of the resize table: `drain`, `release`, `reclaim`, `resume` "
                   "for a serving worker; `join`, `restore`, `evict` for a released one. It ends where it "
                   "began."),
    ("loan", "(with `--round-trip`) The worker's ops of a loan (`op.plan` `loan`) succeed, and after each it "
             "reports the `holding` of the loan table: a serving worker, the lent-from one, gets `drain` "
             "and `release`; a released one, the lent-to one, gets `join` and then says `serving`, not "
             "`drained`. A `state_query` then gets the table's *landed* row."),
    ("loan-return", "(with `--round-trip`) The worker's ops of the loan's return (`op.plan` `return`) succeed "
                    "and after each it reports the `holding` of the return table: the lent-from worker gets "
                    "`join` and says `serving`; the lent-to one gets `drain` and `release`. A `state_query` "
                    "then gets the *home* row: the worker ends where it began."),
)
"""The checks `dynaresized conformance` runs against a worker, in order: (name, rule)."""


def _holding_table() -> str:
    rows = [f"| `{kind.value}` | {' or '.join(f'`{h.value}`' for h in held)} | {HOLDING_NOTES[kind]} |"
            for kind, held in HOLDING_AFTER.items()]
    return "\n".join(["| after | `holding` | why |", "|---|---|---|", *rows])


def _loan_table(plan: PlanKind, end: str) -> str:
    source = LENT_FROM if plan is PlanKind.LOAN else LENT_TO  # the worker of the source pool's kind
    rows = [f"| `{step.op.value}` | {step.to} ({'source' if step.to == source else 'destination'} pool's kind) "
            f"| {step.does} | `{step.lent_from.value}` | `{step.lent_to.value}` |" for step in LOAN_STEPS[plan]]
    last = LOAN_STEPS[plan][-1]
    return "\n".join([f"| {plan.value} | sent to | the worker it is sent to | lent-from reports | lent-to reports |",
                      "|---|---|---|---|---|", *rows,
                      f"| {end}: the daemon expects | | | `{last.lent_from.value}` | `{last.lent_to.value}` |"])


def _conformance_list() -> str:
    return "\n".join(f"{i}. **`{name}`**: {rule}" for i, (name, rule) in enumerate(CONFORMANCE, start=1))


INTRO = f"""# Wire protocol (version {wire.PROTOCOL_VERSION})

<!-- Generated by `python -m dynaresized.protocol_doc > docs/protocol.md`; do not edit by hand. -->

Workers talk to the daemon over ZeroMQ: the daemon binds a **ROUTER** socket
(`daemon.worker_endpoint`), each worker connects a **DEALER** socket whose ZeroMQ identity
(`ZMQ_IDENTITY`) is `<worker_id>#<process>`: its worker id, `#` and the `process` value of its
`hello` (below), so that two processes under one id never share a routing slot. The daemon
checks it: a `hello` from any other identity is refused (`unauthorized`, reason
`wrong_identity`); only a worker whose hellos carry no `process` may use its bare worker id.
A ZeroMQ identity is at most 255 bytes, so `len(worker_id) + 1 + len(process)` must be at most
255 bytes (UTF-8): a `hello` over it is refused `invalid`, reason `bad_request`, and our client
raises `ValueError` before it connects. "An identity that names the worker", for every message
after `hello`, is the worker id alone or the worker id followed by `#` and anything: the daemon
compares what comes before the first `#` with the message's `worker_id`. Keep the identity for the life of the process, on every connection it opens (see
*Reconnecting*). A second connection with the identity of a connected one is not routed
(`ROUTER_HANDOVER` is off). Operators talk to a second ROUTER (`daemon.control_endpoint`) with
a DEALER of any identity, sending exactly two frames, the control secret (empty for `status`)
and the request; any other number of frames is refused `malformed` (reason `frames`), and a
request other than `status` without the right secret `unauthorized` (reason `missing_secret`
or `wrong_secret`). The secret's format and where to read it: docs/configuration.md (*The
control secret*) and docs/security.md.

**Frames.** Every message is exactly one frame holding one [MessagePack](https://msgpack.org)
map. (The ROUTER sees `[identity, payload]`; the DEALER sends and receives just `[payload]`.)
The map's `"type"` key names the message; the other keys are its fields. Enums are strings.
`StepTiming`, `ResponseLengths`, `Split` and `ActualState` are nested maps. Every `sent_at` is the sender's wall
clock in seconds since the Unix epoch (a float); the daemon treats it as data, never as time.

**Versioning.** `Hello.protocol` must equal {wire.PROTOCOL_VERSION}; otherwise the daemon answers
`error` with code `bad_version`. Fields are only ever appended, always with a default, so a peer
ignores fields it does not know. Unknown message types, wrong field types and missing required
fields are errors. Version 2 added the registration token and reconciliation (below).

**Errors.** Anything the daemon cannot accept is answered with an `error` message (`code`,
human `message`, finer `reason`, `ref_type`, the type of the offending message, and `token`,
the token it carried) and is counted in `dynaresized_decode_errors_total{{kind}}` or
`dynaresized_refusals_total{{reason}}`. Frames over `daemon.max_message_bytes` (default
{wire.MAX_MESSAGE_BYTES} bytes) are cut off by the socket (`ZMQ_MAXMSGSIZE`), which drops the
connection; ZeroMQ reconnects it. The daemon never dies of a bad message. Messages *from* the
daemon grow with the cluster: an `op` names the devices of both pools and those it moves, about
14 bytes each (up to 72 KB at 4,096 devices), so a worker accepts frames of up to {wire.DAEMON_MESSAGE_MAX_BYTES}
bytes from the daemon (`wire.DAEMON_MESSAGE_MAX_BYTES`: our client and `wire.daemon_decoder()`).

## A worker's life

```
            hello(actual) ──► welcome(token, incarnation, boot_id, pool, desired)
                 │                   or error: bad_version, unknown_device, device_owned,
                 │                             conflict, not_the_process, duplicate_worker
                 │                             (all final); wrong_identity: fix the identity
                 ▼
   ┌──── registered ◄────────────────────────────────────────────────────┐
   │  every heartbeat_interval_s: heartbeat(token, ack) ─► heartbeat_ack  │
   │    (answered when ack is true; any other message counts as a beat)   │
   │  op ──► perform (or answer from the record of op_id) ──► op_result   │
   │         (ok, detail, actual)        re-sent every core.op_resend_s   │
   │         until answered                                               │
   │  state_query ──► state_report(actual)                                │
   │  step_report, progress                                               │
   │                                                                      │
   │  error stale_token / missing_token / unknown_worker / not_registered,│
   │  or a heartbeat_ack with a new boot_id, or no ack for                │
   │  heartbeat_timeout_s ──► hello again (same process, same actual) ────┘
   └──► bye (leaving on purpose)
```

1. **Register.** `hello` names the worker, its kind, its devices, a `process` value unique to
   this process run, a `secret`, and (optionally) `actual`, what it holds now. `process` is an
   identifier, written to the event log (`worker_registered`); `secret` proves the process: 32
   to 128 random hex characters (128 bits or more; anything else is refused `invalid`, reason
   `bad_request`, before any other check), chosen once per process run, the same in every
   hello of the process, sent in nothing but `hello` and shown to no one. The log keeps only its
   SHA-256. A `hello` that names the `process` of a live registration without that
   registration's secret is refused `not_the_process`: whoever reads `process` in the log cannot
   say hello in that process's place. (A worker that sends no secret has only its connection to
   prove it: see docs/security.md.) Until the first `welcome` you know neither heartbeat
   setting: if none comes, send the same `hello` again every second or so, as long as you
   like (our client waits `hello_timeout_s`, 5 s, for its first welcome); the repeats of one
   process on one connection are one registration. The answer is `welcome`:
   `token` (carry it in every later message of this registration), `incarnation` (the number
   of times this worker id has registered in this log: it grows with every new registration,
   after a restart of either side or a loss), `boot_id` (changes with every daemon start), the
   heartbeat settings, and what the log says this worker should be: `pool` (where its devices
   are) and `desired` (`serving` or `released`; null while its devices move or straddle the
   pools). A `hello` from the process that is registered and live in this daemon start (same
   worker id, same `process`) repeats that registration: the `welcome` carries the same
   `incarnation` and `token`, the `actual` it carries is recorded as a `state_report` would
   be, and a pending op it has not answered is sent again. So hellos that cross on a slow
   link, or one sent because no heartbeat answer came, change nothing. After a daemon restart
   or once the worker was declared lost, the same process's `hello` is a new registration
   (new `incarnation`, new token); if several welcomes arrive, the one with the highest
   `incarnation` is current: take its token.
2. **Stay registered.** Send something every `welcome.heartbeat_interval_s`: any accepted
   message (`progress`, `op_result`, a report) proves you alive as a `heartbeat` does, so a
   `heartbeat` is needed only in an interval in which you sent nothing else. The daemon answers
   a `heartbeat` with `heartbeat_ack` only when its `ack` is true (the default): ask for one
   whenever the last answer, and your last ask, came `welcome.heartbeat_timeout_s / 4` ago or
   more (our client does), so that the daemon need not answer every beat of every worker, nor
   more of them when it answers late. A worker silent
   for `welcome.heartbeat_timeout_s` is declared lost (a resize it takes part in is rolled
   back); only time the daemon was running counts, so a daemon that stalled (no CPU, a slow
   disk) does not declare everyone lost when it wakes, nor time out the op in flight whose
   answers wait unread in its socket (a `daemon_stalled` fact moves the op's deadline on). A lost worker is refused with `not_registered`; it then, and whenever an ack shows a
   new `boot_id`, or any message is refused with `stale_token` or `missing_token`, sends
   `hello` again. A message refused with `stale_token` whose `error.token` is not the current
   token is about an earlier registration and is ignored. A restarted daemon gives every
   worker `heartbeat_timeout_s` from its start to say `hello`: while the daemon is down, retry
   with pauses of at most a quarter of that (our client does), however long the outage.
3. **One process per worker id.** A `hello` from a new `process` while the registered one is
   live and its connection still open is refused (`duplicate_worker`): a duplicate started by
   mistake never takes over. The daemon looks for that connection under the old process's
   identity, also after a daemon restart before the old process has said hello again (its
   DEALER has reconnected by itself). When the old connection is gone (the process died), the
   new process registers at once and the old registration counts as lost. A connection
   registers one process: a `hello` naming another `process` on it is refused
   (`wrong_identity`), never made a new registration.

   **Reconnecting.** A process keeps its identity `<worker_id>#<process>` on every connection it
   opens; a new process has a new `process` and so a new identity. A new connection whose
   identity the ROUTER still holds for an earlier one (a drop only your side saw, a link that
   flapped) is not routed, silently: nothing sent on it arrives, nothing comes back, until
   the daemon drops the old one (at once when its TCP connection closes, within
   `heartbeat_timeout_s` through TCP keepalives and `TCP_USER_TIMEOUT` when the peer vanished). So when a `hello` on a
   new connection goes unanswered (for `max(2 × heartbeat_interval_s, 1 s)`, say), close that
   connection and open another, with the same identity, and say hello again; our client does.
4. **Operations.** `op` asks for one operation of a resize, or of a reconcile (below). Perform
   it and answer `op_result` with the same `op_id`, `ok`, a `detail` for operators and your
   `actual` state after it. The daemon re-sends a pending op every `core.op_resend_s` to the
   targets that have not answered, and again after it restarts or you re-register: keep a
   record by `op_id` and answer a repeat from it, never run it twice (a repeat that arrives
   while the first copy still runs is ignored; its answer goes out when it ends). **The answer
   to a repeat** is the recorded `ok`, `detail` and `duration_s` under the *current*
   registration's `token` (and your `actual` as it is now), like every other message: after a
   re-registration (a daemon restart) the old token is refused `stale_token`, and the op would
   time out and roll back. `op.plan` says what the op belongs to (`PlanKind`, below).
   `op.timeout_s` is the time *remaining* before the daemon gives up on the op, in seconds.
   An answer that arrives after the op completed is refused with `stale_op` (or
   `illegal_transition` when nothing is in flight): it changes nothing, and can be ignored.
5. **Undo ops are idempotent.** A rollback sends `resume`, `reclaim` and `evict` for every op
   of the resize that was *sent*, also to a worker that failed it or never answered it: the
   op may or may not have taken effect. Undo from wherever you are; an undo with nothing to
   undo succeeds (e.g. `reclaim` on a device you still hold).
6. **Report.** `step_report`: the stage timings of one RL step, sent by exactly one worker of
   the job (trainer rank 0, or the driver's engine worker). The daemon designates the first
   worker whose `step_report` it accepts, for as long as that worker is live (its restarts
   under the same worker id included): a `step_report` from any other worker is refused
   `not_the_reporter` (the error names the reporter); once the reporter is lost or gone, the
   next worker to report takes over. A second report of a step is refused as `stale_step`.
   `timing.lengths` (optional, `ResponseLengths` below) is the step's response-length
   distribution as the router saw it: the response tokens at quantiles 0.5, 0.9, 0.99 and 1.0
   (the longest), and the seconds per token the longest response took on its engine, from
   admission to its last token. The policy predicts the rollout on another pool with a latency
   floor from them (the longest response cannot be generated sooner, however many engines;
   docs/simulator.md, "The cost model"); a report without them is accepted as before, and the
   daemon predicts with the linear model (`dynaresized status` says which). Quantiles that are
   not four non-negative, non-decreasing integers, or a per-token time that is not a finite
   number >= 0, are refused `bad_value`. `progress`: per-sample completion on this worker. `bye` when
   leaving on purpose (your devices stay in their pools).
7. **Cut off from the daemon** (a network partition, a one-way link, the daemon down): keep
   doing what you hold. An engine keeps serving its requests and a trainer keeps training:
   the job's own traffic (NCCL, gloo, vLLM) does not go through the daemon, and a device moves
   only when an `op` says so, never because the daemon went quiet. An op you were running
   finishes and its answer stays in your record. Keep heartbeating; once no `heartbeat_ack`
   came for `welcome.heartbeat_timeout_s`, say `hello` again (on a new connection, with pauses
   of at most a quarter of that timeout) for as long as the cut lasts; our client does all of
   this. On its side, the daemon declares you lost after `heartbeat_timeout_s` of silence: a
   resize or loan that still needs you rolls back (past its commit it finishes without you),
   and your devices stay in the pool the log has them in, unless a later resize moves them
   without you (a device moves only if the worker that takes it over is live). A cut shorter
   than both timeouts costs nothing: re-sent ops and heartbeats make up for what was lost. When
   the link heals, your `hello` carries your `actual` state and the daemon converges you with
   the log (reconciliation, below): if it rolled back a resize you had acted on, it sends the
   undo or converging ops then. `benchmarks/chaos.py --partitions` cuts worker hosts off
   (network namespaces, CURVE over TCP) and checks that a cut-off worker's holding does not
   change until the link heals.

## Reconciliation

The event log holds the desired state; each worker reports its actual state (`ActualState`)
in `hello`, in every `op_result` and in `state_report` (the answer to `state_query`, which the
daemon sends every `core.audit_interval_s`, or unasked when the worker's state changed by
itself). `holding` is one of:

| `holding` | meaning |
|---|---|
| `serving` | holds its device(s) and works: an engine admitting samples, a trainer in the group |
| `drained` | holds them but takes no new work (after `drain`, before `release`) |
| `released` | holds nothing: engine asleep, stopped or dead; trainer outside the group |
| `done` | its job ended (training finished): nothing to converge |
| `failed` | it cannot act (its loop died): reported, its devices are left out of resizes and loans |

The other fields of `ActualState` are for operators and tools: the daemon records them (in
`worker_reported` and `op_acked` facts; `dynaresized events` shows them) but decides on
`holding` alone. `last_op`: the `op_id` of the last op this process performed (`""` before its
first). `epoch`: a trainer's membership epoch of its group, which grows with each change of the
group (the torch backend counts from 0, and says -1 before its first group); 0 for an engine.
`members`: the devices of the trainer's current group (empty for an engine and outside a group).
`detail`: free text, e.g. why `failed`. A report that differs from the last one in any field is
a new `worker_reported` fact: keep counters that change at every report out of `detail`.

The log says a worker should be `serving` when all its devices are in its kind's pool and
`released` when they are all in the other pool. Whenever a live worker reports something else
(and no resize is in flight), the daemon records `reconcile_started` and sends it the ops that
converge it, serialized like a resize and from the worker's home pool (`op.from_pool`):

| the log says | the worker says | ops, in order |
|---|---|---|
| `serving` | `released` | `reclaim`, `resume` |
| `serving` | `drained` | `resume` |
| `released` | `serving` | `drain`, `release` |
| `released` | `drained` | `release` |

A worker that fails a converging op, times out, or still reports the old state after them is
recorded as `worker_unconverged`: its devices are left out of resize and loan plans, and it is tried
again `core.reconcile_retry_s` later or when it registers again. A worker that never sends
`actual` is never reconciled.

## Who receives which op

A resize moves devices from one pool to the other. `drain` and `release` go to the moving
devices' workers of the *source* pool's kind; `join` and `restore` to their workers of the
*destination* kind; `commit` to every live worker of the new topology (each device's worker of
its new pool's kind). Undo ops go to the targets of the ops they undo, reconcile ops to the one
worker being reconciled. One live worker of each kind may share a device (an engine and a
trainer on one GPU, as verl's hybrid replicas do); two live workers of the same kind may not
(`device_owned`).

## Guards on forced resizes

`dynaresized resize T:R` (a `resize` control request) skips the hysteresis guards (threshold,
signal run, dwell, cooldown, payback) but not the safety ones: the split must be a configured
candidate and keep at least `guards.min_train` / `guards.min_rollout` devices, no other resize
or reconcile may be in flight, the daemon must not be degraded or stopping, and enough devices
must have a live worker of the destination kind (and none that has not converged).

## Refusal reasons (`error.reason` with `code: refused`)

| `reason` | what it means | what to do |
|---|---|---|
| `unknown_worker` | this worker id never registered | send `hello` |
| `not_registered` | the worker was declared lost or said `bye` | send `hello` again |
| `stale_token` | the token is not this registration's (re-registered since, or the daemon restarted) | send `hello` again |
| `missing_token` | a message after `hello` without the welcome's token | carry `welcome.token` |
| `duplicate_worker` | another live process holds this worker id and is still connected | stop it, or use another id |
| `not_the_process` | the hello names a live registration's `process` but not its `secret` | nothing: only that process can say hello as it (final) |
| `unknown_device` | a device not in the daemon's inventory | fix the worker's device list |
| `device_owned` | another live worker of the same kind holds that device | stop it, or fix the device list |
| `conflict` | this worker id is live with another kind or other devices | use another worker id |
| `bad_request` | e.g. a `hello` with no devices or repeated ones | fix the message |
| `bad_value` | a number that cannot be (negative or infinite seconds, done > total) | fix the measurement |
| `stale_step` | a `step_report` for a step not after the last observed one | report each step once, in order |
| `not_the_reporter` | a `step_report` from a worker other than the job's live reporter | report steps from one worker only |
| `stale_op` | an `op_result` for an op that is not the one in flight | nothing: a late answer to a re-sent op |
| `not_a_target` | an `op_result` from a worker the op was not sent to | nothing: it changes nothing |
| `illegal_transition` | the message is not accepted in the daemon's phase (e.g. an `op_result` with nothing in flight) | nothing |
| `disk_full` | the disk under the event log is full: nothing that would be recorded is accepted | send it again later (heartbeats are still answered) |
| `rate_limited` | more reports that write facts (`queue_empty`, `mini_batch_done`, `step_report`, `state_report`) than `daemon.report_rate` a second (bursts of `daemon.report_burst`) | nothing: the report changed nothing; send a few a step, as the protocol does |

**The order of the checks.** The daemon checks every message on the worker endpoint in this
order, and answers the first that fails: (1) the frame: one payload frame of at most
`daemon.max_message_bytes` (larger ones drop the connection, `ZMQ_MAXMSGSIZE`), a msgpack map
of a known `type` with well-typed fields (`malformed`, `unknown_type`, `invalid`); (2) for a
`hello`, its `secret` and the length of its identity (`invalid`, reason `bad_request`); (3)
under CURVE, the key (`unauthorized`, `wrong_key`); (4) the connection's identity
(`unauthorized`, `wrong_identity`); then (5) for a `hello`, the protocol version
(`bad_version`), for every other message the token (`stale_token`, `missing_token`) and, for a
report that writes facts, the rate (`rate_limited`); (6) the core (the `refused` reasons above).
So a `hello` of another protocol version from a connection whose identity does not name it is
refused `wrong_identity`, not `bad_version`.

**Junk.** Each connection may send `daemon.junk_budget` refused frames (steps 1 to 4, and
messages of no registered worker: `unknown_worker`, `not_registered`) per `daemon.junk_window_s`
(100 per 10 s), each answered. The next one cuts the connection without an answer: its TCP
connection is closed, what it had queued is dropped unread, and a DEALER connects again by
itself with a fresh budget (`dynaresized_connections_cut_total`). A worker that follows this
protocol never comes near it.

A `hello` that several refusals fit gets the first of: `bad_version`, `bad_request`,
`unknown_device`, `device_owned`, `conflict`, `not_the_process`, `duplicate_worker`. So
`device_owned` takes precedence over `conflict`: a hello whose device another live worker of its
kind holds is `device_owned` even when its worker id is also live with other devices.

Other codes: `malformed`, `unknown_type`, `invalid`, `oversize` (the frame), `bad_version`,
`unauthorized` (reason `wrong_key`: the claimed worker id is not the CURVE key's, final; reason
`wrong_identity`: the connection's ZeroMQ identity does not name the claimed worker, or, for a
`hello`, is not `<worker_id>#<process>`; for a client that sets it right this means something on
the way lost it: `WorkerClient` opens a new connection and says hello again). On the control
endpoint: `malformed` with reason `frames` (not two frames), `unauthorized` with reason
`missing_secret` or `wrong_secret`.

## Operator requests and `status`

Operators send one request (`status`, `pause`, `resume`, `resize`, `regroup`, `drain`) and receive one
`reply` (or `error`). `reply.data` of `status` is a map:

| key | value |
|---|---|
| `phase` | `steady`, `draining`, `releasing`, `joining`, `restoring`, `committing`, `rolling_back`, `reconciling` or `degraded` |
| `split` | `{{"train": n, "rollout": n}}` |
| `paused`, `stopping` | booleans |
| `degraded_reason` | text, empty unless degraded |
| `disk_full` | text, empty unless the disk under the event log is full: then no transition starts (docs/store.md, *The daemon on a full disk*) |
| `last_step` | the last observed RL step, -1 before the first |
| `facts` | facts in the log |
| `resizes` | `{{"started": n, "committed": n, "rolled_back": n, "degraded": n, "in_flight": 0 or 1}}`: every resize started is committed, rolled back, degraded (it could neither finish nor roll back) or in flight, so `started` is the sum of the other four. Loans and reconciles are not counted |
| `devices` | device id → `training`, `rollout` or `moving <from>-><to>` |
| `lent` | device id → its home pool, for each device lent to the other pool until the step boundary |
| `engines` | the rollout engines of several devices, each a list of its devices (its leader first) |
| `regroups` | `{{"started": n, "committed": n}}` |
| `samples` | rollout step (a string) → `{{"done": n, "total": n}}`, summed over the engines whose latest `progress` report is of that step. Soft state, as heartbeat times are: progress reports are not facts, so this is empty for about a second after a restart, until the engines report again |
| `workers` | list of `{{"id", "kind", "status" (live, lost, gone), "devices", "incarnation", "actual" (its holding, or null if it never said), "desired" (what the log says, or null), "unconverged" (why, or null)}}` |
| `in_flight` | null, or `{{"resize_id", "from", "to", "devices", "op", "rolling_back", "reason", "acked", "reconciling" (the worker being reconciled, or "")}}` |
| `policy`, `boot_id` | the policy's name, this daemon run's id |

## Operations

| `op.kind` | what the receiving worker does |
|---|---|
| `drain` | stop admitting work; in-flight work finishes or is handed over (engine), or stop at the next optimizer-step boundary (trainer) |
| `release` | give the device up: engine sleeps or stops, trainer leaves its group and offloads state; the process stays |
| `join` | take the device: trainer enters the pre-warmed group and receives state, engine wakes or restarts |
| `restore` | bring state up to date: reload current weights (engine), restore optimizer state (trainer) |
| `commit` | switch to the new topology (`op.training`, `op.rollout`) from the next step boundary; acknowledge as soon as the switch is scheduled, without waiting for the boundary (a step can outlast `op_timeout_s`) |
| `resume` | undo `drain`: admit work again (a drained or just reclaimed worker) |
| `reclaim` | undo `release`: take the device back (wake, restart or reload; rejoin with the parked state) |
| `evict` | undo `join`: give the device back |

`op.plan` (a `PlanKind`) says which sequence an op belongs to; the ops are the same:

| `op.plan` | the sequence |
|---|---|
| `resize` | a resize: the split changes at the commit, for good |
| `loan` | a loan: idle devices serve the other pool for the rest of the RL step in progress (a `release` of a lent engine may keep it loaded) |
| `return` | a loan's return: the lent devices go home at the step boundary |
| `reconcile` | a reconcile: one worker is converged with the log (`drain`, `release`, `reclaim`, `resume` only); the pools do not change |
| `regroup` | a regroup: rollout devices form engines of another size (below); the pools do not change |

## Regroups

`dynaresized regroup n0:gpu2,n0:gpu3 --tp 2` (a `regroup` control request) makes rollout
devices serve as engines of `tp` devices each, in device order: two one-device engines become
one tensor-parallel engine of two, and `--tp 1` makes them one-device engines again. Every op
of it (`drain`, `release`, `join`, `restore`, `commit`, with `op.plan` `regroup`) goes to the
engine workers of those devices, one worker of one device each, and carries `op.engine`: the
devices of the engine the receiving worker serves in once the sequence is done, when wider than
its own device (empty: an engine of its own device). On `join` the worker whose device is the
first of `op.engine` starts that engine over all of its devices and the others, its *members*,
hold nothing; `restore` brings the engine to the current weights; `commit` admits it. A failed
op rolls a regroup back (`evict`, `reclaim`, `resume`, whose `op.engine` names the engines the
log still holds); a failed `commit` leaves the new engines in the log (the daemon is then
degraded, as for a resize). A worker reports the engine it runs in `actual.engine` (empty: its
own device); one that serves another engine than the log says is reconciled with `drain`,
`release`, `reclaim`, `resume` carrying the log's `op.engine`.
An engine of several devices moves between pools whole (a resize that would split it is
refused: regroup it first, or move a multiple of its size), and is lent whole: once the worker that runs it (its
first device's) says its queue is empty, a loan takes all of its devices, or none (`op.engine` names it in
every op of the loan and its way home). A regroup is refused (`regroup_started` never comes; `status`
says why) unless every device is at home in the rollout pool with a live engine worker of its
own, the devices hold whole engines, and the layout changes. `status` shows `engines` and
`regroups`; Prometheus, `dynaresized_wide_engines` and `dynaresized_regroups{{state}}`.

**What the members report.** Members get every op, `restore` and `commit` included. After
`join`, `restore`, `commit`, `reclaim` and `resume` the worker of the first device of `op.engine`
reports what the table below says, with `actual.engine` set to `op.engine`; a member reports
`released`, since the log's `desired` for a member is `released` (`status` shows it), and its
`actual.engine` is not read (the daemon compares it only where it expects `serving`). So after a
committed regroup its members say `released`; after a rollback, or a reconcile whose ops name
their engine, each worker reports for the engine it is back in (an empty `op.engine`: a
one-device engine, `actual.engine` empty).

**Tail regroups (simulated only).** In `dynaresized simulate --policy-option tail_regroup=true`
the policy may also start a regroup inside a rollout step: when engines have run dry, or
trainers have finished their step, while another engine still decodes the step's last requests
(`queue_empty` with `running` > 0 and `tokens_left`), that engine and the idle devices become one
wider engine for the rest of the step, if the saving it predicts exceeds the switch and the way
back (`regroup_started` with `source` the policy and `undo` the engines they were; trainers are
first lent to the rollout, a loan whose reason says it is for the tail). At the step boundary
the core regroups them back (`regroup_started` with `source` `tail`), then sends lent trainers
home and asks the policy about the step. The ops are a regroup's and a loan's, so they are
serialized, logged, rolled back and replayed as those are. The daemon refuses to start with the option: no backend
moves a running request's KV cache to a wider engine yet, and a regroup's `drain` would wait for
the tail it means to speed up (`docs/simulator.md`, "Tail regroups inside a step").

## What a worker reports between the steps of a resize

The `holding` in each `op_result`'s `actual` (and in any `state_report` until the next op) once
the worker performed the op on its devices:

{_holding_table()}

An engine worker whose `op.engine` another device leads reports `released` instead (see *What
the members report*). While a resize, loan or reconcile is in flight the daemon records these
reports (`op_acked`, `worker_reported`) but converges nobody. When the sequence ends, committed,
landed, home or rolled back, each live worker's last report must agree with the log (`serving`
with its devices in its kind's pool, `released` with them in the other pool or as a member), or
the daemon reconciles it. The sim backend, the vLLM engine worker and the torch trainer rank
report this.

## What a worker reports in a loan and on its way home

A loan (`op.plan` `loan`) lends devices to the other pool for the rest of the RL step in
progress; its return (`op.plan` `return`) brings them home at the step boundary. On each lent
device the *lent-from* worker is the worker of the device's home pool's kind (the engine of a
rollout device lent to training, the trainer of a training device lent to the rollout) and the
*lent-to* worker the one of the other kind. Each sequence is three ops and never has a
`restore` or a `commit`. After each op the two workers report this `actual.holding` (the one
that got no op still reports what it reported last):

{_loan_table(PlanKind.LOAN, "landed")}

{_loan_table(PlanKind.RETURN, "home")}

A failed op rolls the sequence back (`evict`, `reclaim`, `resume`, reported as the resize table
says): a loan to the *home* row, a return to the *landed* row. The daemon expects that row, or
the last, once the sequence ends and reconciles a worker whose last report differs, with two
exceptions: a trainer lent to the training step leaves the group by itself once the step's last
mini-batch is done, and may then report `drained` or `released` until the return; and of an
engine of several devices, lent whole with `op.engine` naming it in every op, the members
report `released` where the table says `serving` (the worker of its first device reports
`actual.engine` as well). **Report `serving` after either `join`, not `drained`:** a worker
that stays `drained` waiting for a `commit` takes no work, so the daemon does not count it as
serving but reconciles it with a `resume` after every loan and every return (and a resize that
starts at the same boundary finds it idle until its `commit`).

## Conformance

`dynaresized conformance ENDPOINT [-- COMMAND ...]` checks a worker against this
document: it binds a ROUTER on `ENDPOINT` and plays the daemon, starts `COMMAND` if given (each
`{{endpoint}}` in it replaced, and `DYNARESIZED_ENDPOINT` in its environment), waits for one
worker to say hello, and runs these checks against it, in order:

{_conformance_list()}

It prints one line per check (`--json`: one JSON object) and exits 0 when none failed, 1
otherwise. `--timeout S` bounds each wait (default 10 s; the first hello, the worker's start
included, `--hello-timeout`, 60 s); `--only NAME` runs the named checks (and `hello`). CI runs
the project's own client and the sim backend through every check (`tests/test_conformance.py`).

## Messages
"""

GROUPS = [
    ("Worker → daemon", wire.WorkerMessage),
    ("Daemon → worker", wire.DaemonMessage),
    ("Operator → daemon (control endpoint)", wire.ControlRequest),
    ("Daemon → operator", wire.ControlReply | wire.Error),
]


def _type_of(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[1]
    if "anyOf" in schema:
        return " or ".join(_type_of(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{v}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    t = schema.get("type", "any")
    if t == "array":
        return f"array of {_type_of(schema.get('items', {}))}"
    if t == "object":
        return "map"
    extra = []
    for key in ("minLength", "maxLength", "minimum", "maximum", "maxItems", "pattern"):
        if key in schema:
            extra.append(f"{key} {schema[key]}")
    return str(t) + (f" ({', '.join(extra)})" if extra else "")


def _table(name: str, schema: dict[str, Any], doc: str) -> list[str]:
    lines = [f"### `{name}`", ""]
    if doc:
        lines += [doc, ""]
    lines += ["| field | type | required | default |", "|---|---|---|---|"]
    required = set(schema.get("required", []))
    for field, prop in schema.get("properties", {}).items():
        default = json.dumps(prop["default"]) if "default" in prop else ""
        lines.append(f"| `{field}` | {_type_of(prop)} | {'yes' if field in required else 'no'} | {default} |")
    return lines + [""]


_NESTED_DOC = {
    "ResponseLengths": ("A step report's `timing.lengths`: `quantiles`, the response tokens at quantiles 0.5, 0.9, "
                        "0.99 and 1.0 (four non-negative, non-decreasing integers); `token_s`, the seconds per token "
                        "of the longest response on its engine (0: not measured). Optional: see *Report* above."),
}


def render() -> str:
    components = wire.json_schema()
    out = [INTRO]
    for title, union in GROUPS:
        out.append(f"## {title}\n")
        for cls in union.__args__:  # type: ignore[attr-defined]
            schema = components[cls.__name__]
            tag = cls.__struct_config__.tag
            props = dict(schema.get("properties", {}))
            props.pop("type", None)
            doc = " ".join((cls.__doc__ or "").split())
            out.extend(_table(f'type: "{tag}"', {**schema, "properties": props}, doc))
    out.append("## Nested types\n")
    for name in ("StepTiming", "ResponseLengths", "Split", "ActualState"):
        out.extend(_table(name, components[name], _NESTED_DOC.get(name, "")))
    for name in ("WorkerKind", "OpKind", "Pool", "ErrorCode", "Holding", "PlanKind"):
        values = ", ".join(f"`{v}`" for v in components[name]["enum"])
        out.extend([f"### {name}", "", f"A string, one of: {values}.", ""])
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render(), end="")
