"""verl integration (extra `.[verl]`): the `dynaresized` dynamic-schedule policy for verl's
fully-async trainer, and the `dynaresized_separate_async` trainer for verl's V1 separate-async
mode. See docs/verl.md.

`register` and `register_v1` are Ray `worker_process_setup_hook`s: they run in every Ray worker
process, so the policy (or the trainer) is registered inside the actor where verl looks it up by
name (the fully-async trainer's `build_policy`, the V1 TaskRunner's `get_trainer_cls`). verl
itself is imported only there, never on the daemon's side.
"""

from __future__ import annotations

import structlog

from dynaresized.integrations.verl.layout import POLICY_NAME, V1_TRAINER_NAME, VerlLayout


def register() -> None:
    """Register the `dynaresized` policy with verl (idempotent; importing the module does it)."""
    import dynaresized.integrations.verl.policy  # noqa: F401  (registers on import)


def register_v1() -> None:
    """Register the `dynaresized_separate_async` trainer with verl's V1 trainer registry
    (idempotent; importing the module does it). A verl without the hybrid-rollout switch is said
    in one line here; verl then names the trainers it has when the job asks for this one."""
    try:
        import dynaresized.integrations.verl.v1  # noqa: F401  (registers on import)
    except ImportError as exc:
        structlog.get_logger("dynaresized.verl").error(f"cannot register verl's {V1_TRAINER_NAME} trainer",
                                                       error=str(exc))


__all__ = ["POLICY_NAME", "V1_TRAINER_NAME", "VerlLayout", "register", "register_v1"]
