"""`VirtualCluster`: the simulator's workload and cost model, for the daemon's `sim` backend.

The daemon demo runs simulated workers over the real client and the real daemon; those
workers take their timings from here, so the demo and `dynaresized simulate` agree on every
number. All methods are pure functions of (profile, trace): a worker may call them from any
process and get the same answer.

    cluster = VirtualCluster.builtin("longtail-drift", "qwen3-8b-h20x8", seed=0)
    cluster.devices                      # ("node0:gpu0", ..., "node0:gpu7")
    cluster.initial_pools                # (Pool.TRAINING x 6, Pool.ROLLOUT x 2)
    cluster.rollout_seconds(step, 2)     # rollout of `step` on 2 rollout devices
    cluster.train_seconds(step, 6)       # old log-probs + update of `step` on 6 trainers
    cluster.weight_sync_seconds()        # trainer -> engines after every step
    cluster.op_seconds(OpKind.JOIN, Pool.TRAINING)           # one resize op (pipelined costs)
    cluster.op_seconds(OpKind.JOIN, Pool.TRAINING, naive=True)
    cluster.step_timing(step, rollout_devices=2, train_devices=6)   # a StepTiming to report
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dynaresized.domain import DeviceId, OpKind, Pool, StepTiming
from dynaresized.sim.pipeline import device_ids
from dynaresized.sim.profile import Profile, load_profile
from dynaresized.sim.run import scenario_shape
from dynaresized.sim.stages import StageModel
from dynaresized.sim.workload import Trace, load_trace, scenario_trace


class VirtualCluster:
    def __init__(self, profile: Profile, trace: Trace, *, naive: bool = False) -> None:
        self.profile = profile
        self.trace = trace
        self.naive = naive
        self.stages = StageModel(profile, trace)

    @classmethod
    def builtin(
        cls,
        scenario: str = "longtail-drift",
        profile: str | Path = "qwen3-8b-h20x8",
        *,
        seed: int = 0,
        steps: int | None = None,
        samples: int | None = None,
        gpus: int | None = None,
        naive: bool = False,
    ) -> VirtualCluster:
        """A built-in scenario (or a trace file, if `scenario` is a path to one) on a profile."""
        p = load_profile(profile)
        if gpus is not None:
            p = p.with_gpus(gpus)
        if samples is not None:
            p = p.with_samples(samples)
        if Path(scenario).suffix in (".jsonl", ".json") and Path(scenario).is_file():
            trace = load_trace(scenario)
            trace = trace.head(steps) if steps is not None else trace
        else:
            trace = scenario_trace(scenario, scenario_shape(p), seed=seed, steps=steps)
        return cls(p, trace, naive=naive)

    @property
    def steps(self) -> int:
        return len(self.trace)

    @property
    def devices(self) -> tuple[DeviceId, ...]:
        return device_ids(self.profile.cluster.gpus, self.profile.cluster.gpus_per_node)

    @property
    def initial_pools(self) -> tuple[Pool, ...]:
        train = self.profile.cluster.initial_train
        return tuple(Pool.TRAINING if i < train else Pool.ROLLOUT for i in range(self.profile.cluster.gpus))

    def rollout_seconds(self, step: int, rollout_devices: int) -> float:
        self._check_step(step)
        return self.stages.rollout_seconds(step, rollout_devices)

    def train_seconds(self, step: int, train_devices: int) -> float:
        self._check_step(step)
        return self.stages.train_seconds(step, train_devices)

    def weight_sync_seconds(self) -> float:
        return self.stages.weight_sync_s

    def op_seconds(self, kind: OpKind, to_pool: Pool, naive: bool | None = None) -> float:
        """Seconds one resize operation takes on a device moving to `to_pool`. COMMIT's value
        is the pause it causes at the step boundary where it happens."""
        return self.profile.op_seconds(kind, to_pool, naive=self.naive if naive is None else naive)

    def loan_op_seconds(self, kind: OpKind, to_pool: Pool) -> float:
        """Seconds one op of a loan (to_pool TRAINING) or of its way home takes."""
        return self.profile.loan_op_seconds(kind, to_pool, naive=self.naive)

    def engine_finish(self, step: int, engines: int, late_s: Sequence[float] | None = None,
                      home: int | None = None) -> np.ndarray:
        """When each engine of the rollout pool has nothing left to do in `step` (seconds after
        the step starts, our pull router); `late_s[e]`: engine e starts that late; engines past
        the first `home` are lent in (the router holds no share for them)."""
        self._check_step(step)
        return self.stages.engine_finish(step, engines, None if late_s is None else np.asarray(late_s, float),
                                         home=home)

    def rollout_reports(self, step: int, engines: int, late_s: Sequence[float],
                        home: int | None = None) -> tuple[np.ndarray, tuple[float, int, int, int] | None]:
        """What the engines of `step`'s rollout report, from one schedule: when each has nothing
        left to do (`engine_finish`), and when the step's queue of requests empties (seconds after
        the step starts), the engine that pulls its last request, how many requests that engine
        runs then and the most tokens one of them still has to decode: what that engine's router
        reports (the vLLM backend's `on_dry`; None with a router that places requests at
        submission)."""
        self._check_step(step)
        if self.stages.router != "pull":
            return self.engine_finish(step, engines, late_s, home), None
        schedule, start_s, pace, empty_at = self.stages.pull_timeline(step, engines, np.asarray(late_s, float), home)
        engine = int(schedule.placement[int(np.argmax(start_s))])
        running = (schedule.placement == engine) & (start_s <= empty_at) & (schedule.done_s > empty_at)
        left = float(((schedule.done_s[running] - empty_at) / pace[engine]).max()) if running.any() else 0.0
        return schedule.finish_s, (empty_at, engine, int(running.sum()), math.ceil(left))

    def mini_batch_seconds(self, step: int, train_devices: int) -> float:
        """One mini-batch (optimizer step) of training step `step` on `train_devices` devices."""
        self._check_step(step)
        mbs = self.profile.training.mini_batches_per_step
        return self.stages.train_work(step) / mbs / (train_devices * self.stages.dp_efficiency(train_devices))

    def step_timing(self, step: int, *, rollout_devices: int, train_devices: int) -> StepTiming:
        """The StepTiming a trainer would report for `step` run on these pool sizes."""
        return StepTiming(
            step=step,
            rollout_s=self.rollout_seconds(step, rollout_devices),
            train_s=self.train_seconds(step, train_devices),
            weight_sync_s=self.weight_sync_seconds(),
            rollout_devices=rollout_devices,
            train_devices=train_devices,
            samples=int(self.stages.samples[step]),
            response_tokens=int(self.stages.response_tokens[step]),
            lengths=self.stages.lengths(step),
        )

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} is outside the trace (0..{self.steps - 1})")
