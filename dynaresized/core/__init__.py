"""The sans-IO core of dynaresized: domain rules, the resize state machine, guards, policies.

Nothing in this package does IO: no asyncio, sockets, files, SQLite, torch or clock; time
arrives inside events. Everything here is deterministic, so replaying the same events gives
the same facts, and folding the same facts gives the same state.
"""

from dynaresized.core.machine import Command, Core, CoreConfig, IllegalTransition, QueryState, Refused, SendOp
from dynaresized.core.state import ClusterState, Phase, fold, mutate

__all__ = [
    "ClusterState",
    "Command",
    "Core",
    "CoreConfig",
    "IllegalTransition",
    "Phase",
    "QueryState",
    "Refused",
    "SendOp",
    "fold",
    "mutate",
]
