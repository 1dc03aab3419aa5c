"""Parameter reallocation executed for real: four gloo processes run the plan of every ordered
pair of layouts (replicated, flat shards, tensor parallel, over different rank sets) and end
with exactly the bytes the target layout gives them, having sent each byte once."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.local import process_context  # noqa: E402
from dynaresized.backends.torch.store import StoreHost  # noqa: E402

from . import realloc_worker  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def test_every_layout_pair_reallocates_bitwise_and_sends_each_byte_once():
    ctx = process_context()
    results = ctx.Queue()
    with StoreHost() as host:
        procs = [ctx.Process(target=realloc_worker.run, args=(rank, host.address, results)) for rank in range(4)]
        for p in procs:
            p.start()
        rows = [row for _ in procs for row in results.get(timeout=120)]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    pairs = {row["pair"] for row in rows}
    assert len(pairs) == 36
    for pair in pairs:
        mine = [r for r in rows if r["pair"] == pair]
        assert len(mine) == 4
        assert all(r["exact"] for r in mine), pair  # every rank holds exactly its target bytes
        sent = sum(r["sent"] for r in mine)
        received = sum(r["received"] for r in mine)
        plan = mine[0]
        # no byte sent twice: what went over the wire is the plan, and the plan is the minimum
        assert sent == received == plan["plan_bytes"] == plan["min_bytes"], pair
    moving = [p for p in pairs if any(r["sent"] for r in rows if r["pair"] == p)]
    assert len(moving) >= 20  # most pairs really move bytes
