"""Regroups: rollout devices become engines of another size, on request or for a step's tail
(its last busy engine and idle ones as one wider engine, regrouped back at the boundary).
Emits RegroupStarted, RegroupCommitted (and ProposalRejected for a regroup refused)."""

from __future__ import annotations

from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core import guards
from dynaresized.core.loans import proposed, tail_open
from dynaresized.core.resizes import advance
from dynaresized.core.state import ClusterState, InFlight, Phase
from dynaresized.core.tx import CoreLike, Tx, reject
from dynaresized.domain import DeviceId, OpKind, OpSpec, PlanKind, Pool, ResizePlan, WorkerKind


def on_regroup_requested_steady(core: CoreLike, tx: Tx, e: ev.RegroupRequested) -> None:
    s = tx.state
    if s.stopping or s.paused:
        why = "the daemon is shutting down" if s.stopping else "resizing is paused; run `dynaresized resume` first"
        reject(tx, e.at, e.requested_by, None, "stopping" if s.stopping else "paused", why, PlanKind.REGROUP)
        return
    plan = plan_regroup(s, e.devices, e.tp)
    if isinstance(plan, str):
        reject(tx, e.at, e.requested_by, None, "regroup", plan, PlanKind.REGROUP)
        return
    shape = " + ".join("TP-%d engine [%s]" % (len(g), ", ".join(g)) for g in plan.engines)
    tx.emit(f.RegroupStarted(at=e.at, plan=plan, source=e.requested_by,
                             reason=f"{e.reason or 'requested by operator'}: {len(plan.devices)} device(s) "
                                    f"become {shape}",
                             op_deadline=e.at + core.config.op_timeout_s))
    advance(core, tx, e.at, fresh=True)


def plan_regroup(state: ClusterState, devices: tuple[DeviceId, ...], tp: int, *, lent_ok: bool = False,
                 engines: tuple[tuple[DeviceId, ...], ...] | None = None) -> ResizePlan | str:
    """Drain, release, join, restore and commit that make `devices` (rollout devices, each with
    a live engine worker of its own) serve as engines of `tp` devices each, in device order;
    or why that is impossible now. The devices must hold whole engines: a regroup never
    splits an engine it does not name whole. A tail regroup (`lent_ok`) may take devices lent to
    the rollout, and its way back names the `engines` it restores."""
    devices = tuple(sorted(set(devices)))
    if tp < 1 or not devices or len(devices) % tp:
        return f"{len(devices)} device(s) do not form engines of {tp} device(s) each"
    unknown = [d for d in devices if d not in state.devices]
    if unknown:
        return f"device(s) {', '.join(unknown)} are not in this cluster's inventory"
    lent = set(state.lent_devices())
    held_back = state.held_back()
    for d in devices:
        p = state.devices[d]
        if p.pool is not Pool.ROLLOUT or (not lent_ok and (p.home is not None or d in lent)):
            where = "moving" if p.pool is None else f"lent to {p.pool.value}" if p.home else f"in {p.pool.value}"
            return f"device {d} is {where}: only devices at home in the rollout pool are regrouped"
        if d in held_back:
            return f"device {d} is left out: a worker on it has not converged"
        outside = [x for x in state.engine_of(d) if x not in devices]
        if outside:
            return (f"device {d} serves in the engine [{', '.join(state.engine_of(d))}]: name all of its "
                    f"devices ({', '.join(outside)} missing)")
    live = state.live_workers_by_device()
    workers = []
    for d in devices:
        w = live.get((d, WorkerKind.ROLLOUT_ENGINE))
        if w is None:
            return f"device {d} has no live rollout-engine worker"
        if w.devices != (d,):
            return (f"worker {w.worker_id} holds {', '.join(w.devices)}: only engines of one device's worker "
                    "each are regrouped (a worker of several devices shapes its own engines)")
        workers.append(w.worker_id)
    if engines is None:
        engines = tuple(devices[i:i + tp] for i in range(0, len(devices), tp))
    if all(state.engine_of(g[0]) == g for g in engines):
        return f"devices {', '.join(devices)} already serve as engines of {tp} device(s)"
    rid = f"g{state.regroups_started + 1}"
    ops = tuple(OpSpec(op_id=f"{rid}/{i}-{k.value}", kind=k, devices=devices, targets=tuple(workers),
                       from_pool=Pool.ROLLOUT, to_pool=Pool.ROLLOUT)
                for i, k in enumerate((OpKind.DRAIN, OpKind.RELEASE, OpKind.JOIN, OpKind.RESTORE, OpKind.COMMIT)))
    split = state.split
    return ResizePlan(resize_id=rid, devices=devices, from_pool=Pool.ROLLOUT, to_pool=Pool.ROLLOUT, ops=ops,
                      before=split, after=split, kind=PlanKind.REGROUP, engines=engines)


def committed(core: CoreLike, tx: Tx, fl: InFlight, at: float) -> None:
    """The end of a regroup: every op, its commit included, was acknowledged (`machine.ENDINGS`)."""
    tx.emit(f.RegroupCommitted(at=at, resize_id=fl.plan.resize_id, duration_s=at - fl.started_at,
                               step=tx.state.last_step))


# -- the tail of a step ----------------------------------------------------------------


def consider_tail(core: CoreLike, tx: Tx, at: float) -> None:
    """An engine reported its queue empty: ask the policy whether to regroup a busy engine and
    idle ones into one wider engine for the rest of the step (`propose_tail`), and start that
    regroup when the guard lets it (its saving over its cost, as a loan's)."""
    if core.config.tail_costs is None or tail_open(tx.state):
        return
    proposal = proposed(core, tx, at, getattr(core.policy, "propose_tail", None), guards.check_tail,
                        PlanKind.REGROUP)
    if proposal is None:
        return
    s = tx.state
    undo = tuple(dict.fromkeys(s.engine_of(d) for d in proposal.devices))
    plan = plan_regroup(s, proposal.devices, len(proposal.devices), lent_ok=True)
    if isinstance(plan, str):
        reject(tx, at, core.policy.name, None, "regroup", plan, PlanKind.REGROUP)
        return
    tx.emit(f.RegroupStarted(at=at, plan=plan, source=core.policy.name, reason=proposal.reason,
                             op_deadline=at + core.config.op_timeout_s, undo=undo))
    advance(core, tx, at, fresh=True)


def tail_back(core: CoreLike, tx: Tx, at: float) -> None:
    """After the step boundary, the engine a tail regroup made becomes the engines it was made of
    again (a regroup of source "tail"), once nothing else is in flight."""
    s = tx.state
    if not s.tail_due or s.inflight is not None or s.phase is not Phase.STEADY or s.stopping:
        return
    if not tail_open(s):
        return  # already those engines (the tail regroup was rolled back)
    undo = s.tail_undo
    devices = tuple(d for group in undo for d in group)
    plan = plan_regroup(s, devices, len(undo[0]), lent_ok=True, engines=undo)
    if isinstance(plan, str):
        reject(tx, at, "tail", None, "regroup", f"the tail's engine cannot be regrouped back yet: {plan}",
               PlanKind.REGROUP)
        return
    sizes = " + ".join(str(len(g)) for g in undo)
    tx.emit(f.RegroupStarted(at=at, plan=plan, source="tail", op_deadline=at + core.config.op_timeout_s,
                             reason=f"the step is over: back to engines of {sizes} device(s)"))
    advance(core, tx, at, fresh=True)
