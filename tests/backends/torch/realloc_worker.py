"""Rank side of the reallocation test: run every layout pair's plan over one gloo group and
report what each rank ended with and sent."""

from __future__ import annotations

import itertools
from typing import Any

from dynaresized.backends.torch.communicators import Communicators
from dynaresized.backends.torch.jobs import SyntheticRegression
from dynaresized.backends.torch.reallocation import FlatSpace, local_buffer, plan_reallocation, reallocate
from dynaresized.backends.torch.store import StoreAddress, connect_store


def layouts(space: FlatSpace) -> dict[str, Any]:
    from dynaresized.backends.torch.reallocation import FlatShards, Replicated, TensorParallel

    return {
        "replicated[0,1]": Replicated((0, 1)),
        "replicated[0-3]": Replicated((0, 1, 2, 3)),
        "shards[1,2,3]": FlatShards((1, 2, 3)),
        "shards[0-3]": FlatShards((0, 1, 2, 3)),
        "tp[2,3]": TensorParallel.megatron(space, (2, 3)),
        "tp[0-3]": TensorParallel.megatron(space, (0, 1, 2, 3)),
    }


NODES = {0: "node0", 1: "node0", 2: "node1", 3: "node1"}


def run(rank: int, address: StoreAddress, results: Any) -> None:
    model = SyntheticRegression(width=64, depth=3, inputs=16, outputs=8, seed=3).build_model()
    space = FlatSpace.of(model.named_parameters())
    flat = space.flatten(dict(model.named_parameters()))
    store = connect_store(address)
    comms = Communicators(store, address.prefix, rank, timeout_s=30)
    group = comms.group((0, 1, 2, 3))  # every rank asks at once: the group is built on demand
    out = []
    for (a, src), (b, dst) in itertools.product(layouts(space).items(), repeat=2):
        plan = plan_reallocation(space, src, dst, NODES)
        holdings_src, holdings_dst = src.holdings(space), dst.holdings(space)
        local = local_buffer(flat, holdings_src[rank]) if rank in holdings_src else None
        got, report = reallocate(plan, space, src, dst, group, rank, local)
        want = local_buffer(flat, holdings_dst[rank]) if rank in holdings_dst else None
        exact = (got is None and want is None) or (got is not None and want is not None and bool((got == want).all()))
        out.append({"pair": f"{a} -> {b}", "rank": rank, "exact": exact,
                    "sent": report.bytes_sent, "received": report.bytes_received, "kept": report.bytes_kept,
                    "plan_bytes": plan.bytes_moved, "min_bytes": plan.min_bytes})
    comms.close()
    results.put(out)
