"""Parameter reallocation between parallel layouts (ReaL, arXiv 2406.14088), planned then run.

A model's parameters are laid end to end in one flat byte buffer (`FlatSpace`, fixed tensor
order). A layout says which byte intervals of it each rank holds:
* `Replicated`: every rank holds everything (data parallelism);
* `FlatShards`: k contiguous shards of the flat buffer (FSDP/ZeRO-3 style);
* `TensorParallel`: each listed tensor split along dim 0 (column parallel for a Linear
  weight) or dim 1 (row parallel), the rest replicated (Megatron style).

`plan_reallocation` says, before anything moves, who sends which intervals to whom: each
destination keeps what it already holds and receives every missing byte exactly once, from
a sender on its own node when one holds it, else from the least loaded holder. The plan
prints, checks itself, and estimates its time with `cost()` (170 GB/s within a node,
20 GB/s across, ReaL's figures). `reallocate` executes it over a process group: one message
per (sender, receiver) pair, all posted at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import msgspec
import numpy as np
import torch

from dynaresized.backends.torch.communicators import Group

Intervals = np.ndarray  # int64 [m, 2]: sorted, disjoint [start, end) byte ranges


class PlanError(ValueError):
    pass


# -- interval arithmetic ------------------------------------------------------------------------------
def intervals(pairs: Iterable[tuple[int, int]] | np.ndarray) -> Intervals:
    """Sorted, merged, non-empty intervals."""
    a = np.asarray(list(pairs) if not isinstance(pairs, np.ndarray) else pairs, dtype=np.int64).reshape(-1, 2)
    a = a[a[:, 1] > a[:, 0]]
    if len(a) == 0:
        return a
    a = a[np.argsort(a[:, 0], kind="stable")]
    # merge touching/overlapping runs
    ends = np.maximum.accumulate(a[:, 1])
    starts_new = np.ones(len(a), dtype=bool)
    starts_new[1:] = a[1:, 0] > ends[:-1]
    group = np.cumsum(starts_new) - 1
    out = np.empty((group[-1] + 1, 2), dtype=np.int64)
    out[:, 0] = a[starts_new, 0]
    out[:, 1] = np.maximum.reduceat(a[:, 1], np.flatnonzero(starts_new))
    return out


def size(iv: Intervals) -> int:
    return int((iv[:, 1] - iv[:, 0]).sum()) if len(iv) else 0


def intersect(a: Intervals, b: Intervals) -> Intervals:
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i, 0], b[j, 0]), min(a[i, 1], b[j, 1])
        if lo < hi:
            out.append((lo, hi))
        if a[i, 1] < b[j, 1]:
            i += 1
        else:
            j += 1
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    out = []
    j = 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j, 1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k, 0] < hi:
            if b[k, 0] > cur:
                out.append((cur, b[k, 0]))
            cur = max(cur, b[k, 1])
            if cur >= hi:
                break
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


# -- the flat parameter space ----------------------------------------------------------------------------
class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


class FlatSpace:
    """The model's tensors end to end, in order, as one byte buffer."""

    def __init__(self, tensors: Sequence[TensorSpec]) -> None:
        if not tensors:
            raise ValueError("a flat space needs at least one tensor")
        self.tensors = tuple(tensors)
        self.offsets: dict[str, int] = {}
        offset = 0
        for t in self.tensors:
            if t.name in self.offsets:
                raise ValueError(f"tensor name {t.name!r} appears twice")
            self.offsets[t.name] = offset
            offset += t.nbytes
        self.total_bytes = offset
        self.align = max(t.itemsize for t in self.tensors)

    @staticmethod
    def of(named: Iterable[tuple[str, torch.Tensor]]) -> FlatSpace:
        return FlatSpace([TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named])

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"no tensor {name!r} in the flat space")

    def everything(self) -> Intervals:
        return intervals([(0, self.total_bytes)])

    def locate(self, byte: int) -> str:
        for t in self.tensors:
            if self.offsets[t.name] <= byte < self.offsets[t.name] + t.nbytes:
                return t.name
        return "?"

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full flat buffer of a model held whole (uint8)."""
        return torch.cat([tensors[t.name].detach().contiguous().reshape(-1).view(torch.uint8) for t in self.tensors])


# -- layouts --------------------------------------------------------------------------------------------------
class Layout(Protocol):
    ranks: tuple[int, ...]

    def holdings(self, space: FlatSpace) -> dict[int, Intervals]: ...

    def describe(self) -> str: ...


class Replicated(msgspec.Struct, frozen=True):
    ranks: tuple[int, ...]

    def holdings(self, space: FlatSpace) -> dict[int, Intervals]:
        return {r: space.everything() for r in self.ranks}

    def describe(self) -> str:
        return f"replicated over {list(self.ranks)}"


class FlatShards(msgspec.Struct, frozen=True):
    ranks: tuple[int, ...]

    def holdings(self, space: FlatSpace) -> dict[int, Intervals]:
        k = len(self.ranks)
        units = math.ceil(space.total_bytes / space.align)
        shard = math.ceil(units / k) * space.align  # shard edges never cut an element
        return {r: intervals([(min(i * shard, space.total_bytes), min((i + 1) * shard, space.total_bytes))])
                for i, r in enumerate(self.ranks)}

    def describe(self) -> str:
        return f"{len(self.ranks)} flat shards over {list(self.ranks)}"


class TensorParallel(msgspec.Struct, frozen=True):
    """`split[name]` = the dim a tensor is cut along (0: column parallel for an [out, in]
    Linear weight and its bias, 1: row parallel); tensors not listed are replicated."""

    ranks: tuple[int, ...]
    split: dict[str, int]

    @staticmethod
    def megatron(space: FlatSpace, ranks: tuple[int, ...]) -> TensorParallel:
        """Alternate column and row parallel over consecutive 2-D weights (an MLP's pairs);
        a bias follows a column-split weight and is replicated after a row-split one."""
        split: dict[str, int] = {}
        column = True
        last: int | None = None
        for t in space.tensors:
            if len(t.shape) == 2:
                last = 0 if column else 1
                split[t.name] = last
                column = not column
            elif len(t.shape) == 1 and last == 0:
                split[t.name] = 0
        return TensorParallel(ranks=ranks, split=split)

    def holdings(self, space: FlatSpace) -> dict[int, Intervals]:
        k = len(self.ranks)
        held: dict[int, list[np.ndarray]] = {r: [] for r in self.ranks}
        for t in space.tensors:
            base = space.offsets[t.name]
            dim = self.split.get(t.name)
            if dim is None:
                for r in self.ranks:
                    held[r].append(np.asarray([[base, base + t.nbytes]], dtype=np.int64))
                continue
            if dim >= len(t.shape) or t.shape[dim] % k:
                raise PlanError(f"tensor {t.name} {list(t.shape)} cannot be split {k} ways along dim {dim}")
            outer = math.prod(t.shape[:dim])
            inner = math.prod(t.shape[dim + 1:]) * t.itemsize
            part = t.shape[dim] // k * inner  # bytes of one rank's slice within one outer row
            row = t.shape[dim] * inner
            starts = base + np.arange(outer, dtype=np.int64) * row
            for i, r in enumerate(self.ranks):
                s = starts + i * part
                held[r].append(np.stack([s, s + part], axis=1))
        return {r: intervals(np.concatenate(parts)) for r, parts in held.items()}

    def describe(self) -> str:
        cols = sum(1 for d in self.split.values() if d == 0)
        rows = sum(1 for d in self.split.values() if d == 1)
        return (f"tensor parallel over {list(self.ranks)} ({cols} tensors split by column, {rows} by row, "
                "the rest replicated)")


# -- the plan -------------------------------------------------------------------------------------------------------
class Bandwidth(msgspec.Struct, frozen=True):
    intra_node_bytes_per_s: float = 170e9  # ReaL's NVLink figure
    inter_node_bytes_per_s: float = 20e9  # ReaL's InfiniBand figure


class Transfer(msgspec.Struct, frozen=True):
    src: int
    dst: int
    intervals: tuple[tuple[int, int], ...]  # byte ranges of the flat space, increasing
    nbytes: int


class ReallocationPlan(msgspec.Struct, frozen=True):
    source: str
    target: str
    total_bytes: int
    transfers: tuple[Transfer, ...]
    kept: dict[int, int]  # bytes each destination already held (copied locally, not sent)
    min_bytes: int  # sum over destinations of the bytes they need and do not hold
    nodes: dict[int, str]

    @property
    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def cost(self, bandwidth: Bandwidth | None = None) -> float:
        """Seconds, if every rank sends and receives at once and each rank's sends (and its
        receives) share its link: the slowest rank's send or receive time."""
        bw = bandwidth or Bandwidth()
        send: dict[int, float] = {}
        recv: dict[int, float] = {}
        for t in self.transfers:
            same = self.nodes.get(t.src) == self.nodes.get(t.dst)
            seconds = t.nbytes / (bw.intra_node_bytes_per_s if same else bw.inter_node_bytes_per_s)
            send[t.src] = send.get(t.src, 0.0) + seconds
            recv[t.dst] = recv.get(t.dst, 0.0) + seconds
        return max([*send.values(), *recv.values(), 0.0])

    def __str__(self) -> str:
        lines = [f"reallocation: {self.source} -> {self.target}",
                 f"  {self.bytes_moved} bytes in {len(self.transfers)} transfers (minimum {self.min_bytes}); "
                 f"kept in place: {sum(self.kept.values())} bytes; estimated {self.cost() * 1e3:.3f} ms"]
        for t in self.transfers:
            where = "same node" if self.nodes.get(t.src) == self.nodes.get(t.dst) else "across nodes"
            spans = ", ".join(f"[{a}, {b})" for a, b in t.intervals[:3])
            more = f" and {len(t.intervals) - 3} more" if len(t.intervals) > 3 else ""
            lines.append(f"  rank {t.src} -> rank {t.dst} ({where}): {t.nbytes} bytes in {len(t.intervals)} "
                         f"intervals {spans}{more}")
        return "\n".join(lines)

    def check(self, space: FlatSpace, source: Layout, target: Layout) -> None:
        """Raise `PlanError` unless every destination ends with exactly the bytes it needs,
        each received once, from a rank that holds it."""
        src, dst = source.holdings(space), target.holdings(space)
        empty = intervals([])
        for t in self.transfers:
            iv = intervals(t.intervals)
            if size(iv) != t.nbytes or size(iv) != sum(b - a for a, b in t.intervals):
                raise PlanError(f"transfer {t.src}->{t.dst} has overlapping intervals or a wrong byte count")
            if size(intersect(iv, src.get(t.src, empty))) != t.nbytes:
                raise PlanError(f"rank {t.src} is asked to send bytes it does not hold")
        for d, need in dst.items():
            have = intersect(need, src.get(d, empty))
            parts = [have] + [intervals(t.intervals) for t in self.transfers if t.dst == d]
            got = sum(size(p) for p in parts)
            union = intervals(np.concatenate(parts)) if parts else empty
            if got != size(union):
                raise PlanError(f"rank {d} would receive some bytes twice ({got - size(union)} bytes)")
            if size(intersect(union, need)) != size(need) or size(union) != size(need):
                raise PlanError(f"rank {d} would not end with exactly the bytes it needs")


def plan_reallocation(space: FlatSpace, source: Layout, target: Layout,
                      node_of: Callable[[int], str] | Mapping[int, str] | None = None) -> ReallocationPlan:
    src, dst = source.holdings(space), target.holdings(space)
    nodes_fn = (node_of.get if isinstance(node_of, Mapping) else node_of) or (lambda r: "node0")
    everyone = sorted(set(src) | set(dst))
    nodes = {r: str(nodes_fn(r)) for r in everyone}  # type: ignore[misc]
    load = dict.fromkeys(src, 0)
    transfers: list[Transfer] = []
    kept: dict[int, int] = {}
    min_bytes = 0
    empty = intervals([])
    for d in sorted(dst):
        need = dst[d]
        have = intersect(need, src.get(d, empty))
        kept[d] = size(have)
        remaining = subtract(need, have)
        min_bytes += size(remaining)
        owners = sorted((s for s in src if s != d), key=lambda s: (nodes[s] != nodes[d], load[s], s))
        for s in owners:
            if not len(remaining):
                break
            piece = intersect(remaining, src[s])
            if not len(piece):
                continue
            n = size(piece)
            transfers.append(Transfer(src=s, dst=d, intervals=tuple((int(a), int(b)) for a, b in piece), nbytes=n))
            load[s] += n
            remaining = subtract(remaining, piece)
        if len(remaining):
            a = int(remaining[0, 0])
            raise PlanError(f"no source rank holds bytes [{a}, {int(remaining[0, 1])}) (tensor {space.locate(a)}) "
                            f"that rank {d} needs")
    return ReallocationPlan(source=source.describe(), target=target.describe(), total_bytes=space.total_bytes,
                            transfers=tuple(transfers), kept=kept, min_bytes=min_bytes, nodes=nodes)


# -- local buffers and execution ----------------------------------------------------------------------------------
def local_offsets(holding: Intervals, iv: Intervals) -> np.ndarray:
    """Where each interval of `iv` (inside `holding`) starts in the rank's local buffer,
    which is its holding's intervals concatenated in order."""
    if not len(iv):
        return np.zeros(0, dtype=np.int64)
    lengths = holding[:, 1] - holding[:, 0]
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    idx = np.searchsorted(holding[:, 0], iv[:, 0], side="right") - 1
    if (idx < 0).any() or (iv[:, 1] > holding[idx, 1]).any():
        raise PlanError("an interval lies outside the rank's holding")
    return before[idx] + (iv[:, 0] - holding[idx, 0])


def local_buffer(space_flat: torch.Tensor, holding: Intervals) -> torch.Tensor:
    """The local buffer of a rank holding `holding`, cut from the full flat buffer."""
    if not len(holding):
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([space_flat[a:b] for a, b in holding.tolist()])


def _gather(local: torch.Tensor, holding: Intervals, iv: Intervals) -> torch.Tensor:
    offs = local_offsets(holding, iv)
    return torch.cat([local[o:o + (b - a)] for o, (a, b) in zip(offs.tolist(), iv.tolist(), strict=True)])


def _scatter(local: torch.Tensor, holding: Intervals, iv: Intervals, data: torch.Tensor) -> None:
    offs = local_offsets(holding, iv)
    pos = 0
    for o, (a, b) in zip(offs.tolist(), iv.tolist(), strict=True):
        local[o:o + (b - a)].copy_(data[pos:pos + (b - a)])
        pos += b - a


class ExecutionReport(msgspec.Struct, frozen=True):
    bytes_sent: int
    bytes_received: int
    bytes_kept: int
    messages_sent: int


_TAG = 4242


def reallocate(plan: ReallocationPlan, space: FlatSpace, source: Layout, target: Layout, group: Group, rank: int,
               local: torch.Tensor | None) -> tuple[torch.Tensor | None, ExecutionReport]:
    """Run `plan` on this rank: `local` is its buffer in the source layout (None if it holds
    nothing there); returns its buffer in the target layout (None if it holds nothing)."""
    src, dst = source.holdings(space), target.holdings(space)
    empty = intervals([])
    mine_src, mine_dst = src.get(rank, empty), dst.get(rank, empty)
    if rank in src and (local is None or local.numel() != size(mine_src)):
        raise PlanError(f"rank {rank} must pass its {size(mine_src)}-byte source buffer")
    out = torch.empty(size(mine_dst), dtype=torch.uint8) if rank in dst else None
    kept = 0
    if out is not None and local is not None:
        have = intersect(mine_dst, mine_src)
        if len(have):
            _scatter(out, mine_dst, have, _gather(local, mine_src, have))
            kept = size(have)
    recvs = []
    for t in plan.transfers:
        if t.dst == rank:
            buf = torch.empty(t.nbytes, dtype=torch.uint8)
            recvs.append((t, buf, group.irecv(buf, t.src, _TAG)))
    sends = []
    for t in plan.transfers:
        if t.src == rank:
            assert local is not None
            data = _gather(local, mine_src, intervals(t.intervals))
            sends.append((data, group.isend(data, t.dst, _TAG)))
    for _, work in sends:
        group.wait("reallocation send", work)
    received = 0
    for t, buf, work in recvs:
        group.wait(f"reallocation recv from rank {t.src}", work)
        assert out is not None
        _scatter(out, mine_dst, intervals(t.intervals), buf)
        received += t.nbytes
    return out, ExecutionReport(bytes_sent=sum(d.numel() for d, _ in sends), bytes_received=received,
                                bytes_kept=kept, messages_sent=len(sends))
