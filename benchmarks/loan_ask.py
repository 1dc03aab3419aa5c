"""What asking a trainer loan again from the step in progress costs the core (issue 43, item 2).

While the trainers wait and the rollout's queue holds requests, the core asks the lending policy
again at the step's first sample done and at every 1/64 of its samples after
(`core.loans.paced`). This drives a core of `--devices` training and as many rollout devices
(the hysteresis policy, three training-bound steps, then training step 3 done with its loan
refused) through one rollout step of engine progress reports, every engine reporting each of its
samples, and times `Core.step()` per report with `lend_from_progress` on and off. The step's pace
is fast (every loan refused), so each ask is paid in full and none starts a loan.

Prints ONE JSON object; asserts nothing on time:
{"devices": N, "reports": R, "us_per_report": {"asked": a, "off": b}, "asks_per_step": k}

    python benchmarks/loan_ask.py [--devices 512] [--samples-per-engine 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import msgspec

from dynaresized.core import Core
from dynaresized.core.loans import PACE_POINTS
from dynaresized.core import events as ev
from dynaresized.core.policy import LoanCosts, load_policy
from dynaresized.domain import StepTiming

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core tests' small cluster
from tests.core.cluster import EAGER, Driver, boot, engine, make_core, trainer  # noqa: E402


def waiting(n: int, asks: bool) -> Driver:
    """n training and n rollout devices; training step 3 done, rollout 4 running."""
    config = msgspec.structs.replace(make_core(EAGER, "hysteresis", op_timeout_s=30.0).config,
                                     loan_costs=LoanCosts(to_rollout_s=1e9, to_training_s=1e9))
    d = boot(Core(config, load_policy("hysteresis", {"lend_from_progress": asks})), n, n)
    for step in range(4):
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=0, total=1))
        d.finish()
        d.at(100.0)
        if step < 3:
            d.send(ev.StepReported(at=d.at(), worker_id=trainer(0), timing=StepTiming(
                step=step, rollout_s=50.0, train_s=100.0, rollout_devices=n, train_devices=n)))
        d.send(ev.MiniBatchDone(at=d.at(), worker_id=trainer(0), step=step, done=1, total=1))
    assert d.state.inflight is None, "the loan at the last mini-batch was meant to be refused"
    return d


def timed(d: Driver, n: int, per_engine: int) -> tuple[float, int]:
    """Seconds per report over the step's reports, and how many loans were asked (all refused)."""
    total = n * per_engine  # the step's samples: each engine reports its own done and the step's total
    reports = [ev.ProgressReported(at=d.now + 1e-6 * (k + 1), worker_id=engine(n + k % n), step=4,
                                   done=k // n + 1, total=total) for k in range(total)]
    before = d.state
    # as `core.loans.paced` asks: at the first sample done, then at every 1/64 mark crossed
    asks = sum(1 for k in range(total) if k == 0 or k * PACE_POINTS // total != (k + 1) * PACE_POINTS // total)
    t = time.perf_counter()
    for r in reports:
        d.send(r)
    seconds = (time.perf_counter() - t) / total
    assert d.state.inflight is None and before.inflight is None
    return seconds, asks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=512, help="training devices (and as many rollout devices)")
    p.add_argument("--samples-per-engine", type=int, default=8)
    args = p.parse_args()
    n, per = args.devices, args.samples_per_engine
    asked, asks = timed(waiting(n, True), n, per)
    off, _ = timed(waiting(n, False), n, per)
    print(json.dumps({"devices": 2 * n, "reports": n * per,
                      "us_per_report": {"asked": round(asked * 1e6, 1), "off": round(off * 1e6, 1)},
                      "asks_per_step": asks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
