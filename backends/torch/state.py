"""A trainer's state as ordered tensors: what a donor sends a joining rank, and how it is checked.

The order is fixed and the same on every rank: the model's parameters and persistent
buffers in `named_parameters()` / `named_buffers()` order, then the optimizer's tensors by
parameter index and state key. A donor first sends an `Outline` (names, shapes, dtypes,
step, hyperparameters); the joiner checks it against its own model, allocates optimizer
state it does not have yet, and only then receives bytes, in place. A `Digest` over the same
order (crc32, ~4 GB/s) lets every member of the new group compare states exactly.
"""

from __future__ import annotations

import ctypes
import hashlib
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from dynaresized.backends.torch.communicators import Group
from dynaresized.backends.torch.staging import StagingBuffer, byte_view, nbytes


class StateMismatch(RuntimeError):
    """Two ranks' states differ where they must be equal (outline or bytes)."""


class TensorEntry(msgspec.Struct, frozen=True, array_like=True):
    name: str
    shape: tuple[int, ...]
    dtype: str
    on_param_device: bool = True  # optimizer scalars such as Adam's `step` stay on the CPU

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=_dtype(self.dtype)).element_size()


class Outline(msgspec.Struct, frozen=True):
    """What a donor is about to send, sent before any tensor bytes."""

    epoch: int
    step: int
    members: tuple[int, ...]
    params: tuple[TensorEntry, ...]
    optimizer: tuple[TensorEntry, ...]  # name: "<param index>.<state key>"
    optimizer_scalars: dict[str, Any]  # non-tensor optimizer state, same naming
    param_groups: tuple[dict[str, Any], ...]  # hyperparameters of each group, without "params"
    with_optimizer: bool  # optimizer tensors follow the parameters (eager restore)
    transfer: str  # "direct" or "staged"
    chunk_bytes: int  # staging chunk size; both sides must use the same

    @property
    def param_bytes(self) -> int:
        return sum(e.nbytes for e in self.params)

    @property
    def optimizer_bytes(self) -> int:
        return sum(e.nbytes for e in self.optimizer)


class Digest(msgspec.Struct, frozen=True, array_like=True):
    value: int  # crc32 of all bytes in order (or the first 8 bytes of sha256)
    nbytes: int

    def as_tensor(self, step: int = 0, complete: bool = True) -> torch.Tensor:
        return torch.tensor([self.value, self.nbytes, step, int(complete)], dtype=torch.int64)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in outline")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def host_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy read view of a contiguous CPU tensor's bytes. Not `.numpy()`: that marks
    the storage non-resizable for good, and `release()` frees storage by resizing it."""
    if tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError("host_bytes needs a contiguous CPU tensor")
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def digest(tensors: Sequence[torch.Tensor], *, staging: StagingBuffer | None = None, strong: bool = False) -> Digest:
    """crc32 (or sha256 when `strong`) of the tensors' bytes in order. GPU tensors are read
    through `staging` (required then), so the check never allocates a host copy."""
    h = hashlib.sha256() if strong else None
    crc = 0
    total = 0

    def feed(view: torch.Tensor) -> None:
        nonlocal crc, total
        data = host_bytes(view)
        if h is not None:
            h.update(data)
        else:
            crc = zlib.crc32(data, crc)
        total += view.numel()

    if any(t.is_cuda for t in tensors):
        if staging is None:
            raise ValueError("digest of GPU tensors needs a staging buffer")
        staging.save(tensors, feed)
    else:
        for t in tensors:
            feed(byte_view(t))
    value = int.from_bytes(h.digest()[:8], "big", signed=True) if h is not None else crc
    return Digest(value=value, nbytes=total)


class TrainingState:
    """The model and optimizer of one rank, seen as the ordered tensors above."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        model_params = {id(p) for p in model.parameters()}
        if {id(p) for p in self._params} != model_params:
            raise ValueError("the optimizer must own exactly the model's parameters")
        self.released: Path | None = None  # where the state was offloaded by release()

    # -- the fixed order ---------------------------------------------------------------
    def param_entries(self) -> list[tuple[str, torch.Tensor]]:
        named = [(f"param:{n}", p.data) for n, p in self.model.named_parameters()]
        named += [(f"buffer:{n}", b) for n, b in self.model.named_buffers() if b is not None]
        return named

    def param_tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self.param_entries()]

    def optimizer_entries(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i, p in enumerate(self._params):
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    out.append((f"{i}.{key}", state[key]))
        return out

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return [t for _, t in self.optimizer_entries()]

    def all_tensors(self) -> list[torch.Tensor]:
        return self.param_tensors() + self.optimizer_tensors()

    @property
    def has_optimizer_state(self) -> bool:
        return any(self.optimizer.state.get(p) for p in self._params)

    def param_bytes(self) -> int:
        return sum(nbytes(t) for t in self.param_tensors())

    def optimizer_bytes(self) -> int:
        return sum(nbytes(t) for t in self.optimizer_tensors())

    # -- outline ---------------------------------------------------------------------------
    def outline(self, *, epoch: int, step: int, members: tuple[int, ...], with_optimizer: bool,
                transfer: str, chunk_bytes: int) -> Outline:
        device = {id(p): p.device for p in self._params}
        opt_entries = []
        scalars: dict[str, Any] = {}
        for i, p in enumerate(self._params):
            state = self.optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                name = f"{i}.{key}"
                if isinstance(value, torch.Tensor):
                    opt_entries.append(TensorEntry(name, tuple(value.shape), _dtype_name(value.dtype),
                                                   on_param_device=value.device == device[id(p)]))
                else:
                    scalars[name] = value
        groups = tuple({k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups)
        return Outline(
            epoch=epoch, step=step, members=members,
            params=tuple(TensorEntry(n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in self.param_entries()),
            optimizer=tuple(opt_entries), optimizer_scalars=scalars, param_groups=groups,
            with_optimizer=with_optimizer, transfer=transfer, chunk_bytes=chunk_bytes)

    def check_outline(self, outline: Outline) -> None:
        """Raise `StateMismatch` naming the first difference between the donor's model and ours."""
        mine = [TensorEntry(n, tuple(t.shape), _dtype_name(t.dtype)) for n, t in self.param_entries()]
        if len(mine) != len(outline.params):
            raise StateMismatch(f"donor sends {len(outline.params)} parameter/buffer tensors, this rank's model "
                                f"has {len(mine)}: the ranks do not run the same model")
        for theirs, ours in zip(outline.params, mine, strict=True):
            if theirs != ours:
                raise StateMismatch(f"donor has {theirs.name} {list(theirs.shape)} {theirs.dtype}, this rank has "
                                    f"{ours.name} {list(ours.shape)} {ours.dtype}")
        if len(outline.param_groups) != len(self.optimizer.param_groups):
            raise StateMismatch(f"donor's optimizer has {len(outline.param_groups)} parameter groups, this "
                                f"rank's has {len(self.optimizer.param_groups)}")

    def adopt_optimizer_layout(self, outline: Outline) -> None:
        """Make our optimizer state look like the donor's (same keys, shapes, dtypes,
        hyperparameters), reusing tensors that already match so bytes land in place."""
        for group, theirs in zip(self.optimizer.param_groups, outline.param_groups, strict=True):
            for key, value in theirs.items():
                group[key] = tuple(value) if isinstance(group.get(key), tuple) and isinstance(value, list) else value
        wanted: dict[int, dict[str, TensorEntry]] = {}
        for e in outline.optimizer:
            index, _, key = e.name.partition(".")
            wanted.setdefault(int(index), {})[key] = e
        for name, value in outline.optimizer_scalars.items():
            index, _, key = name.partition(".")
            wanted.setdefault(int(index), {})[key] = value  # type: ignore[assignment]
        for i, p in enumerate(self._params):
            entries = wanted.get(i)
            if not entries:
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state.setdefault(p, {})
            for key in [k for k in state if k not in entries]:
                del state[key]
            for key, e in entries.items():
                if not isinstance(e, TensorEntry):
                    state[key] = e
                    continue
                device = p.device if e.on_param_device else torch.device("cpu")
                dtype = _dtype(e.dtype)
                old = state.get(key)
                if (isinstance(old, torch.Tensor) and tuple(old.shape) == e.shape and old.dtype == dtype
                        and old.device == device and old.untyped_storage().nbytes() >= e.nbytes):
                    continue
                state[key] = torch.empty(e.shape, dtype=dtype, device=device)

    # -- release: free the memory, keep the bytes in host memory outside the process -------
    def release(self, path: Path, staging: StagingBuffer) -> int:
        entries = self.param_entries() + self.optimizer_entries()
        written = staging.save_to_file([t for _, t in entries], path)
        for name, t in entries:
            try:
                t.untyped_storage().resize_(0)
            except RuntimeError as exc:  # e.g. memory shared with numpy or another process
                raise RuntimeError(f"cannot free {name} for release: {exc}") from exc
        self.released = path
        return written

    def reclaim(self, staging: StagingBuffer) -> int:
        if self.released is None:
            return 0
        tensors = self.all_tensors()
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(nbytes(t) + t.storage_offset() * t.element_size())
        read = staging.restore_from_file(tensors, self.released)
        self.released.unlink(missing_ok=True)
        self.released = None
        return read


# -- moving state between ranks -------------------------------------------------------------
def send_outline(group: Group, dst: int, outline: Outline, tag: int) -> None:
    data = msgspec.msgpack.encode(outline)
    group.send(torch.tensor([len(data)], dtype=torch.int64), dst, tag)
    group.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, tag + 1)


def recv_outline(group: Group, src: int, tag: int) -> Outline:
    size = torch.zeros(1, dtype=torch.int64)
    group.recv(size, src, tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv(data, src, tag + 1)
    return msgspec.msgpack.decode(data.numpy().tobytes(), type=Outline)


def send_tensors(group: Group, dst: int, tensors: Sequence[torch.Tensor], tag: int,
                 staging: StagingBuffer | None) -> int:
    """Send in order: one message per tensor (direct), or per staging chunk (staged)."""
    if staging is not None:
        return staging.save(tensors, lambda view: group.send(view, dst, tag))
    works = [(group.isend(byte_view(t), dst, tag), nbytes(t)) for t in tensors if nbytes(t)]
    for i, (work, _) in enumerate(works):
        group.wait(f"send of tensor {i} to rank {dst}", work)
    return sum(n for _, n in works)


def recv_tensors(group: Group, src: int, tensors: Sequence[torch.Tensor], tag: int,
                 staging: StagingBuffer | None) -> int:
    """Receive in place, in the order `send_tensors` sent."""
    if staging is not None:
        return staging.restore(tensors, lambda view: group.recv(view, src, tag))
    works = [(group.irecv(byte_view(t), src, tag), nbytes(t)) for t in tensors if nbytes(t)]
    for i, (work, _) in enumerate(works):
        group.wait(f"recv of tensor {i} from rank {src}", work)
    return sum(n for _, n in works)
