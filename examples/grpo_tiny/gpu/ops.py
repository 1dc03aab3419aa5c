"""Per-op resize latencies from a daemon's event log, as one JSON object (GPU variant).

    python examples/grpo_tiny/gpu/ops.py /tmp/grpo-tiny-gpu/state/events.sqlite
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from dynaresized.core import facts as f
from dynaresized.core.facts import decode_fact
from dynaresized.store import open_recorder


def main(path: str) -> int:
    recorder = open_recorder(path, read_only=True)
    try:
        facts = [decode_fact(e.data) for e in recorder.read_all()]
    finally:
        recorder.close()
    ops: dict[str, list[float]] = defaultdict(list)
    resizes = []
    for fact in facts:
        if isinstance(fact, f.OpCompleted):
            ops[fact.op_id.split("-", 1)[1]].append(round(fact.duration_s, 4))
        elif isinstance(fact, f.ResizeCommitted):
            resizes.append({"resize": fact.resize_id, "seconds": round(fact.duration_s, 3), "step": fact.step})
    print(json.dumps({"ops_s": ops, "resizes": resizes}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
