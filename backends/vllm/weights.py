"""The weight store: where the trainer publishes policy versions for the rollout engines.

A version is a directory `v{version:08d}/` holding `model.safetensors` (checkpoint names, as
the model's own loader expects) in a directory shared by trainer and engines. Publishing
writes into a hidden temporary directory, fsyncs, and renames it into place: rename is
atomic, so an engine never sees a half-written version. Engines read a version by path at a
step boundary (`collective_rpc("reload_weights", kwargs={"weights_path": ...})`); only the
path crosses the engine's RPC, never tensors.

On a GPU cluster this file path is the fallback; docs/vllm-backend.md describes the NCCL/IPC
path that replaces it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WEIGHTS_FILE = "model.safetensors"
_VERSION_DIR = re.compile(r"^v(\d{8})$")


class WeightVersionError(LookupError):
    """A version that was asked for is not (or not yet) published."""


class WeightStore:
    """A directory of published policy versions, written by one trainer, read by many engines."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        """The directory of a published version; raises if it is not published."""
        if version < 0:
            raise ValueError(f"policy versions are >= 0, got {version}")
        directory = self.root / f"v{version:08d}"
        if not (directory / WEIGHTS_FILE).is_file():
            published = self.versions()
            raise WeightVersionError(
                f"policy version {version} is not published in {self.root} "
                f"(published: {published[-5:] if published else 'none'})"
            )
        return directory

    def versions(self) -> list[int]:
        found = []
        for entry in self.root.iterdir():
            match = _VERSION_DIR.match(entry.name)
            if match and (entry / WEIGHTS_FILE).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def publish(self, version: int, tensors: Mapping[str, Any]) -> Path:
        """Write `tensors` (name → torch tensor) as `version`, atomically. Versions are immutable."""
        from safetensors.torch import save_file

        if version < 0:
            raise ValueError(f"policy versions are >= 0, got {version}")
        if not tensors:
            raise ValueError(f"policy version {version}: no tensors to publish")
        final = self.root / f"v{version:08d}"
        if final.exists():
            raise FileExistsError(f"policy version {version} is already published at {final}; versions are immutable")
        staging = Path(tempfile.mkdtemp(prefix=f".v{version:08d}-", dir=self.root))
        try:
            file = staging / WEIGHTS_FILE
            save_file({name: t.contiguous() for name, t in tensors.items()}, str(file))
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
            os.rename(staging, final)  # atomic on one filesystem; fails if `final` appeared meanwhile
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        directory_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(directory_fd)  # make the rename itself durable
        finally:
            os.close(directory_fd)
        return final

    def publish_checkpoint(self, version: int, model_dir: str | Path) -> Path:
        """Publish the weights of a saved model directory (all its *.safetensors) as `version`."""
        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {model_dir}")
        tensors: dict[str, Any] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return self.publish(version, tensors)
