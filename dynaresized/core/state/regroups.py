"""The fold of regroups' facts: rollout devices that serve as engines of another size, a step's
tail regroup and the engines it is to be regrouped back into. Folds RegroupStarted and
RegroupCommitted."""

from __future__ import annotations

from msgspec.structs import replace

from dynaresized.core import facts as f
from dynaresized.core.state.cluster import PHASE_OF_OP, ClusterState, InFlight, Phase, on, regrouped, undry


@on(f.RegroupStarted)
def _(s: ClusterState, e: f.RegroupStarted) -> ClusterState:
    plan = e.plan
    inflight = InFlight(plan=plan, source=e.source, reason=e.reason, started_at=e.at, ops=plan.ops, index=0,
                        op_started_at=e.at, op_deadline=e.op_deadline, step=s.last_step)
    # the regrouped engines stop: whatever they had run dry in is over for them
    return replace(s, inflight=inflight, phase=PHASE_OF_OP[plan.ops[0].kind], dry=undry(s, plan.devices),
                   tails=tuple(t for t in s.tails if t[0] not in plan.devices), tail_undo=e.undo, tail_due=False,
                   regroups_started=s.regroups_started + 1)


@on(f.RegroupCommitted)
def _(s: ClusterState, e: f.RegroupCommitted) -> ClusterState:
    plan = s.inflight.plan  # type: ignore[union-attr]
    # Steps measured on the old engines do not describe the new ones (as after a resize); a
    # tail regroup's engine serves the rest of one step and is undone at its boundary: the steps
    # still describe the engines.
    tail = s.inflight.source == "tail" or bool(s.tail_undo)  # type: ignore[union-attr]
    return replace(regrouped(s, plan), inflight=None, phase=Phase.STEADY, recent=s.recent if tail else (),
                   regroups_committed=s.regroups_committed + 1)
