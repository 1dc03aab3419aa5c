"""`static`: never moves a device. The baseline every other policy is measured against."""

from __future__ import annotations

from dynaresized.core.policy import ObservedView, Proposal


class StaticPolicy:
    name = "static"
    guarded = True
    last_reason = "the static policy never moves a device"

    def __call__(self, view: ObservedView) -> Proposal | None:
        return None
