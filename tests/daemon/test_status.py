"""`status` as the CLI shows it, from states the core reaches: every resize started is
accounted for (committed, rolled back, degraded or in flight)."""

from __future__ import annotations

from dynaresized.daemon.service import status_of
from tests.core.test_machine import RESIZES, advance_to, start


def test_a_degraded_resize_is_counted_and_the_counts_add_up() -> None:
    d = start(RESIZES[0].values[0])
    assert status_of(d.state)["resizes"] == {"started": 1, "committed": 0, "rolled_back": 0, "degraded": 0,
                                             "in_flight": 1}
    advance_to(d, 4)  # committing
    d.ack(d.state.inflight.op.targets[0], ok=False, detail="allreduce hung")
    resizes = status_of(d.state)["resizes"]
    assert resizes == {"started": 1, "committed": 0, "rolled_back": 0, "degraded": 1, "in_flight": 0}
    assert resizes["started"] == resizes["committed"] + resizes["rolled_back"] + resizes["degraded"] + \
        resizes["in_flight"]
    assert status_of(d.replayed())["resizes"] == resizes  # the counts are the log's
