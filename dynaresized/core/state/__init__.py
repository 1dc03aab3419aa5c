"""The cluster state and the one function that folds facts into it.

`mutate(state, fact)` is the only way state changes, live or on replay, so replaying the
log always gives the live state. The exceptions are soft timers: `last_seen` (heartbeat
times: heartbeats are not facts, and after a restart every worker gets a fresh grace period),
`last_sent` (when the pending op was last sent), `last_audit` (when every worker was last
asked for its state) and `last_tick` (when the core last ticked): re-sending and asking are
commands, not facts.
`ClusterState.durable()` is the part that replay must reproduce exactly.

`cluster` holds the state and the fold; each family's facts are folded in a module of its own
(`workers`, `steps`, `resizes`, `loans`, `regroups`), imported here so that every fact type
has its handler whenever this package is imported.
"""

from dynaresized.core import facts as f
from dynaresized.core.state import loans, regroups, resizes, steps, workers
from dynaresized.core.state.cluster import (
    _MUTATORS,
    HISTORY_WINDOW,
    LOAN_TIMES_KEPT,
    PHASE_OF_OP,
    RECENT_WINDOW,
    Accuracy,
    ClusterState,
    InFlight,
    LoanCheck,
    LoanTime,
    MiniBatch,
    Outcome,
    Phase,
    Progress,
    StepProgress,
    Unconverged,
    decode_state,
    encode_state,
    fold,
    mutate,
    overlaid,
    progressed,
    seen_at,
    with_step_progress,
)
from dynaresized.core.state.memo import derived, grown

__all__ = [
    "HISTORY_WINDOW", "LOAN_TIMES_KEPT", "PHASE_OF_OP", "RECENT_WINDOW", "Accuracy", "ClusterState", "InFlight",
    "LoanCheck", "LoanTime",
    "MiniBatch", "Outcome", "Phase", "Progress", "StepProgress", "Unconverged", "decode_state", "derived",
    "encode_state", "fold", "grown", "mutate", "overlaid", "progressed", "seen_at", "with_step_progress",
    # the modules of the families, whose import registers their handlers
    "loans", "regroups", "resizes", "steps", "workers",
]

missing = set(f.FACT_TYPES) - set(_MUTATORS)
assert not missing, f"facts without a mutator: {missing}"
