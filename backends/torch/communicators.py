"""Process groups cached by membership, pre-warmed for every candidate topology.

Measured on gloo: a new group costs 16-30 ms and destroying one 19-58 ms, while an op on an
existing group costs ~1 ms; so groups are built once, at start-up, for the memberships the
policy may choose (never for every subset: that grows as 2^W), and a resize switches to one.

Groups are built directly on a `PrefixStore` named after the membership and a generation
(`dr/pg/0,1,3/g0`), not through `dist.new_group`: a name that comes from the membership, not
from a counter, lets ranks build groups in any order, and no default group is needed (whose
members would all have to stay alive). Prewarming builds groups in one canonical order, so
two ranks never wait on each other in opposite orders.

A group that saw an error is discarded and its generation bumped in the store; the next
switch to that membership reads the generation after a store barrier of its members and
builds `g1`, so every member uses the same, fresh group.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from datetime import timedelta

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

log = structlog.get_logger("dynaresized.backends.torch")

Members = tuple[int, ...]


class CollectiveFailed(RuntimeError):
    """A collective or point-to-point op failed or timed out; its group must be discarded."""

    def __init__(self, op: str, group: Group, cause: BaseException | str) -> None:
        self.op = op
        self.members = group.members
        super().__init__(f"{op} on group {group.name} failed: {cause}")


def members_of(ranks: Iterable[int]) -> Members:
    members = tuple(sorted(set(ranks)))
    if not members:
        raise ValueError("a process group needs at least one member")
    return members


def members_key(members: Members) -> str:
    return ",".join(str(r) for r in members)


class Group:
    """One process group and the rank's view of it; every op waits with the group timeout."""

    def __init__(self, pg: dist.ProcessGroup, members: Members, rank: int, generation: int, name: str,
                 timeout_s: float, device: torch.device) -> None:
        self.pg = pg
        self.members = members
        self.rank = rank
        self.generation = generation
        self.name = name
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.ops = 0

    def index(self, rank: int) -> int:
        try:
            return self.members.index(rank)
        except ValueError:
            raise ValueError(f"rank {rank} is not a member of group {self.name}") from None

    @property
    def size(self) -> int:
        return len(self.members)

    def _wait(self, op: str, work: dist.Work) -> None:
        self.ops += 1
        try:
            done = work.wait(self.timeout)
        except RuntimeError as exc:  # gloo: "Connection closed by peer", timeouts, ...
            raise CollectiveFailed(op, self, exc) from exc
        if done is False:
            raise CollectiveFailed(op, self, f"not done within {self.timeout.total_seconds():.1f}s")

    def _start(self, op: str, start: object) -> dist.Work:
        try:
            return start()  # type: ignore[operator]
        except RuntimeError as exc:  # a broken pair can fail at submission already
            raise CollectiveFailed(op, self, exc) from exc

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.index(root)
        opts.timeout = self.timeout
        self._wait("broadcast", self._start("broadcast", lambda: self.pg.broadcast([tensor], opts)))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = self.timeout
        self._wait("all_reduce", self._start("all_reduce", lambda: self.pg.allreduce([tensor], opts)))

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in self.members]
        opts = AllgatherOptions()
        opts.timeout = self.timeout
        self._wait("all_gather", self._start("all_gather", lambda: self.pg.allgather([out], [tensor], opts)))
        return out

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        return self._start("send", lambda: self.pg.send([tensor], self.index(dst), tag))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        return self._start("recv", lambda: self.pg.recv([tensor], self.index(src), tag))

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._wait(f"send to rank {dst}", self.isend(tensor, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        self._wait(f"recv from rank {src}", self.irecv(tensor, src, tag))

    def wait(self, op: str, work: dist.Work) -> None:
        self._wait(op, work)

    def close(self) -> None:
        """Release the group's sockets. A group that saw an error is never used again."""
        try:
            self.pg.abort()
        except RuntimeError as exc:
            log.warning("aborting a process group failed; dropping it anyway", group=self.name, error=str(exc))


class CacheStats(msgspec.Struct):
    prewarmed: int = 0
    prewarm_s: float = 0.0
    hits: int = 0
    builds: int = 0  # groups built on demand (a membership not pre-warmed, or a new generation)
    discarded: int = 0
    last_switch_s: float = 0.0


class Communicators:
    """This rank's process groups, keyed by membership."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, *, backend: str = "gloo",
                 timeout_s: float = 30.0, device: torch.device | None = None) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r} is not supported; use 'gloo' or 'nccl'")
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.stats = CacheStats()
        self._groups: dict[Members, Group] = {}

    def _generation_key(self, members: Members) -> str:
        return f"{self.prefix}/gen/{members_key(members)}"

    def generation(self, members: Members) -> int:
        return int(self.store.add(self._generation_key(members), 0))

    def _build(self, members: Members, generation: int) -> Group:
        name = f"{self.prefix}/pg/{members_key(members)}/g{generation}"
        pg_store = dist.PrefixStore(name, self.store)
        index = members.index(self.rank)
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "gloo":
            pg: dist.ProcessGroup = dist.ProcessGroupGloo(pg_store, index, len(members), timeout)
        else:
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None:
                raise RuntimeError("this torch build has no NCCL; use backend='gloo'")
            opts = nccl.Options()
            opts._timeout = timeout
            pg = nccl(pg_store, index, len(members), opts)
        return Group(pg, members, self.rank, generation, name, self.timeout_s, self.device)

    def prewarm(self, candidates: Iterable[Sequence[int]]) -> int:
        """Build the groups of every candidate membership this rank belongs to.

        Every rank builds in one canonical order (size, then members): building blocks until
        all members arrive, and a total order means no two ranks wait on each other in
        opposite orders. Returns how many groups were built."""
        started = time.perf_counter()
        wanted = sorted({members_of(c) for c in candidates if self.rank in c}, key=lambda m: (len(m), m))
        built = 0
        for members in wanted:
            if members in self._groups:
                continue
            group = self._build(members, self.generation(members))
            if self.backend == "nccl":
                # NCCL creates its communicator at the first collective: do it now, off the
                # critical path (every member pre-warms in the same order, so this matches).
                group.all_reduce(torch.zeros(1, device=self.device))
            self._groups[members] = group
            built += 1
        self.stats.prewarmed += built
        self.stats.prewarm_s += time.perf_counter() - started
        return built

    def group(self, members: Sequence[int]) -> Group:
        """The group for `members`; call only after a barrier of all members (see module doc),
        since a missing or stale group is built here and building needs everyone."""
        started = time.perf_counter()
        key = members_of(members)
        if self.rank not in key:
            raise ValueError(f"rank {self.rank} asked for the group of {list(key)}, which it is not in")
        generation = self.generation(key)
        cached = self._groups.get(key)
        if cached is not None and cached.generation == generation:
            self.stats.hits += 1
            self.stats.last_switch_s = time.perf_counter() - started
            return cached
        if cached is not None:
            self._drop(key, f"generation {cached.generation} is stale (store has {generation})")
        log.info("building process group on demand", members=list(key), generation=generation)
        group = self._build(key, generation)
        self._groups[key] = group
        self.stats.builds += 1
        self.stats.last_switch_s = time.perf_counter() - started
        return group

    def taint(self, members: Sequence[int], reason: str) -> None:
        """The group saw an error: bump its generation for everyone and drop it here."""
        key = members_of(members)
        self.store.add(self._generation_key(key), 1)
        self._drop(key, reason)

    def discard_containing(self, ranks: Iterable[int], reason: str) -> None:
        """Drop every cached group with one of `ranks` (dead peers) in it."""
        dead = set(ranks)
        for key in [k for k in self._groups if dead & set(k)]:
            self._drop(key, reason)

    def _drop(self, key: Members, reason: str) -> None:
        group = self._groups.pop(key, None)
        if group is None:
            return
        log.info("discarding process group", group=group.name, reason=reason)
        group.close()
        self.stats.discarded += 1

    def set_timeout(self, timeout_s: float) -> None:
        """The timeout of every op from now on (start-up rendezvous may use a longer one)."""
        self.timeout_s = timeout_s
        for group in self._groups.values():
            group.timeout = timedelta(seconds=timeout_s)

    def cached(self) -> list[Members]:
        return sorted(self._groups, key=lambda m: (len(m), m))

    def close(self) -> None:
        for key in list(self._groups):
            group = self._groups.pop(key)
            group.close()
