"""verl integration (extra `.[verl]`): the `dynaresized` dynamic-schedule policy for verl's
fully-async trainer. See docs/verl.md.

`register` is the Ray `worker_process_setup_hook`: it runs in every Ray worker process, so the
policy is registered inside the actor where verl's trainer builds it with `build_policy`.
verl itself is imported only there, never on the daemon's side.
"""

from __future__ import annotations

from dynaresized.integrations.verl.layout import POLICY_NAME, VerlLayout


def register() -> None:
    """Register the `dynaresized` policy with verl (idempotent; importing the module does it)."""
    import dynaresized.integrations.verl.policy  # noqa: F401  (registers on import)


__all__ = ["POLICY_NAME", "VerlLayout", "register"]
