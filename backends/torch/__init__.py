"""The torch training backend: trainer ranks that grow and shrink on torch.distributed.

Gloo on CPU, NCCL on GPUs. `TrainerRank` executes the training side of a resize (join,
restore, commit, drain, release and their undo ops) at optimizer-step boundaries, with
pre-warmed process groups, bounded host staging and parameter reallocation between layouts.
See docs/torch-backend.md.
"""

from dynaresized.backends.torch.communicators import CollectiveFailed, Communicators, Group
from dynaresized.backends.torch.jobs import SyntheticRegression, TrainingJob
from dynaresized.backends.torch.staging import StagingBuffer
from dynaresized.backends.torch.store import StoreAddress, StoreHost
from dynaresized.backends.torch.trainer import (
    RankState,
    RestoreMode,
    StepRecord,
    TrainerConfig,
    TrainerRank,
    TransferPath,
)

__all__ = [
    "CollectiveFailed",
    "Communicators",
    "Group",
    "RankState",
    "RestoreMode",
    "StagingBuffer",
    "StepRecord",
    "StoreAddress",
    "StoreHost",
    "SyntheticRegression",
    "TrainerConfig",
    "TrainerRank",
    "TrainingJob",
    "TransferPath",
]
