"""The three pipeline modes in virtual time: colocated, static disaggregated, dynamic.

Disaggregated modes are one-step off-policy: window w runs the rollout of step w on the
rollout pool and the training of step w-1 on the training pool, side by side, then weights
sync; a window lasts `max(rollout, training) + sync`. (Rollout w needs the weights of step
w-2 and training w needs rollout w, so no schedule can start either earlier.) Colocated runs
every step's rollout on all devices, switches, then trains on all devices.

The dynamic mode drives the daemon's own sans-IO core (`Core.step`) and policy: it feeds
Configure, WorkerHello, Tick, StepReported and OpReported events stamped with virtual time,
and executes each `SendOp` the core returns by acknowledging it after the operation's
simulated duration. Resize costs are charged the way DESIGN.md §5 says they fall:

* pipelined (default): the moving devices serve neither pool from the boundary where the
  resize starts until the step boundary where it commits; drain, release, join and restore
  run during that window (a commit slips to a later boundary when they do not fit); at
  commit the training pool pays `commit_s` (its data-parallel group changes in either
  direction) and the destination pool pays `first_step_s` on its first step. With the pull
  router, devices moving to the rollout pull the window's queue once their ops and warm-up are
  done (our router admits an engine mid-step), and pay no warm-up after the commit.
* naive: the pipeline stops for the whole resize (teardown, fresh communicators, state
  reload, restart) and resumes on the new split.

Where it lives: `static.py` (the static and colocated modes, and the hindsight searches),
this module (the dynamic mode's run: its windows, one after the other), `workers.py` (the
simulated workers that answer the core's ops and charge their costs), `lending.py` (a window
with loans, and the engines' progress reports), `regroups.py` (engines formed, the layout
advisor's regroups, a step's tail). `DynamicPipeline` is one object over one state: the core's
state and the ledgers of what the ops cost (`_penalty`, `_late`, `_acks`, `_early_home`), which
the window's timeline reads and the workers' answers write, each in the middle of the other (a
loan's op answered mid-window changes the window it is answered in). So its parts are mixins
over that shared state, each declaring what it uses, rather than objects that would pass it
back and forth; every name this module had is still importable from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
import numpy as np

from dynaresized.core import ClusterState, Core, CoreConfig, Phase
from dynaresized.core import events as ev
from dynaresized.core import facts as f
from dynaresized.core.guards import GuardConfig
from dynaresized.core.policy import Policy, ResizeCosts
from dynaresized.core.policy import LoanCosts, TailCosts
from dynaresized.domain import FORWARD_ORDER, PlanKind, Pool, Split, StepTiming, WorkerKind
from dynaresized.sim.lending import PROGRESS_POINTS, Lending
from dynaresized.sim.profile import ProfileError
from dynaresized.sim.regroups import Regroups
from dynaresized.sim.stages import StageModel
from dynaresized.sim.static import (
    StaticConfig,
    best_static,
    best_static_config,
    colocated_steps,
    colocated_total,
    oracle_total,
    splits_of,
    static_floor,
    static_floor_windows,
    static_total,
    static_windows,
)
from dynaresized.sim.workers import device_ids, engine_id, trainer_id

__all__ = [
    "PROGRESS_POINTS", "DynamicPipeline", "DynamicRun", "Layout", "Progress", "StaticConfig", "Window",
    "best_static", "best_static_config", "colocated_steps", "colocated_total", "device_ids", "engine_id",
    "oracle_total", "splits_of", "static_floor", "static_floor_windows", "static_total", "static_windows",
    "trainer_id",
]

Progress = Callable[[int, int], None]

Layout = Callable[[int, int], "tuple[int, str] | None"]
"""A layout advisor: given the last step generated and the rollout engines' size now, the
engine size to regroup the rollout pool into, and why; None to keep it (`plan.Replanner`)."""


class Window(msgspec.Struct, frozen=True, array_like=True):
    """One pipeline window: rollout of step `window` and training of step `window - 1`."""

    window: int
    start_s: float
    end_s: float
    rollout_devices: int
    train_devices: int
    moving: int
    rollout_s: float  # 0 in the last window (nothing left to generate)
    train_s: float  # 0 in the first window (nothing generated yet)
    lent: int = 0  # idle devices lent to the other pool during the window (either way)


class DynamicRun(msgspec.Struct, frozen=True):
    total_time_s: float
    windows: tuple[Window, ...]
    facts: tuple[f.Fact, ...]
    final_split: Split
    state: ClusterState
    """The core's state at the end; folding `facts` from an empty state gives it back."""
    held: tuple[tuple[int, str], ...]
    """(step, reason) whenever the policy proposed nothing, if it says why (`last_reason`)."""


class DynamicPipeline(Lending, Regroups):
    """One dynamic run: the core and a policy move devices while the pipeline runs."""

    def __init__(
        self,
        model: StageModel,
        policy: Policy,
        *,
        guards: GuardConfig,
        naive: bool = False,
        progress: Progress | None = None,
        layout: Layout | None = None,
    ) -> None:
        profile = model.profile
        if layout is not None and naive:
            raise ValueError("regroups are simulated pipelined only: drop --naive or the layout advisor")
        gpe = profile.rollout.gpus_per_engine
        if profile.initial_split.rollout < gpe:
            raise ProfileError(f"profile {profile.name}: the initial rollout pool of {profile.initial_split.rollout} "
                               f"device(s) is smaller than one engine of {gpe}; start with a larger rollout "
                               f"pool or smaller engines")
        self.model = model
        self.policy = policy
        self.naive = naive
        self.progress = progress
        self.layout = layout
        self.gpus = profile.cluster.gpus
        self.devices = device_ids(self.gpus, profile.cluster.gpus_per_node)
        self.index = {d: i for i, d in enumerate(self.devices)}
        config = CoreConfig(
            guards=guards,
            heartbeat_timeout_s=math.inf,  # simulated workers never die; nothing sends heartbeats
            op_timeout_s=profile.resize.op_timeout_s,
            steps_total=model.steps,
            costs=ResizeCosts(
                to_training_s=self._estimated_cost(Pool.TRAINING),
                to_rollout_s=self._estimated_cost(Pool.ROLLOUT),
            ),
        )
        self.lending = bool(getattr(policy, "lends", False))
        if self.lending:
            # The profile's own loan costs, exact: the core does not re-learn them from the
            # loans' op seconds (`learn_loan_costs`; the daemon does, from real loans).
            config = msgspec.structs.replace(config, loan_costs=profile.loan_costs(naive=naive),
                                             learn_loan_costs=False)
        # Tail regroups (`propose_tail`): request by request, with the pull router only.
        self.tails = bool(getattr(policy, "regroups_tails", False)) and model.router == "pull" and not naive
        if self.tails:
            config = msgspec.structs.replace(config, tail_costs=self._tail_costs())
        self.core = Core(config, policy)
        self._late = {}  # device -> seconds its engine starts late next window
        self._joins = []  # loan JOIN ops waiting for a mini-batch boundary
        self._joined = []  # (time, devices) of loans that joined
        self._charged = set()  # return ops whose cost is charged
        self.state = ClusterState()
        self.facts = []
        self._acks = []
        self._seq = 0
        self._commits = []
        self._penalty = {Pool.ROLLOUT: 0.0, Pool.TRAINING: 0.0}
        self._served_early = set()  # resizes to the rollout whose engines pulled before commit
        # A policy that reads the rollout's progress (verl's rules; ours where it prices a trainer
        # loan at the step's own pace, `lends_from_progress`) gets the engines' sample counts
        # (`ProgressReported`); others do not need them, and the run is faster without.
        self.paces = bool(getattr(policy, "lends_from_progress", False) and getattr(policy, "lends", False)
                          and getattr(policy, "lends_trainers", False) and model.router == "pull"
                          and not getattr(policy, "regroups_tails", False))
        self.tracks_progress = hasattr(policy, "observe_progress") or self.paces
        self._mid_window = False  # a return of lent devices now happens inside a window
        self._early_home = None  # (when, seconds) of such a return
        self._home_engines = []  # the window's home engines, by engine index
        self._schedule_w = None  # the window's rollout on them, request by request
        self._arrived = False  # a resize brought devices to the rollout: engines to form
        self._tail_in = set()  # tail regroups (the policy's, inside a step)
        self._tail_pending = []  # tail regroups started, not yet priced: (plan, undo)
        self._tail_out = set()  # their ways back at the step boundary
        self.tail_regroups = []  # (window, seconds its rollout ended sooner)
        self._tail_landed = None  # seconds into the window the last loan to the rollout landed

    def _tail_costs(self) -> TailCosts:
        """What the policy estimates a tail regroup with: the profile's switch and way back, and
        per allowed engine width a decode iteration's cost, per running request at the context
        of the trace's long responses (mean prompt and 95th-percentile response)."""
        profile = self.model.profile
        steps = self.model.trace.steps
        ctx = float(np.mean([b.prompt_tokens.mean() for b in steps])
                    + np.percentile(np.concatenate([b.response_tokens for b in steps]), 95))
        widths = tuple(k for k in profile.rollout.engine_sizes() if k <= self.gpus)
        specs = [profile.rollout.at_tp(k) for k in widths]
        tail = profile.resize.tail
        return TailCosts(switch_s=tail.switch_s, back_s=tail.back_s, widths=widths,
                         base_s=tuple(r.iter_base_s for r in specs),
                         per_request_s=tuple(r.iter_per_seq_s + r.iter_per_ctx_token_s * ctx for r in specs))

    def _estimated_cost(self, to_pool: Pool) -> float:
        """Critical-path seconds per moved device before the core has measured one."""
        return sum(self.model.profile.op_seconds(k, to_pool, naive=self.naive) for k in FORWARD_ORDER)

    # -- a window without loans ----------------------------------------------------------
    def _mixed_rollout_s(self, w: int, split: Split, now: float) -> float:
        """Rollout w on `split`, plus, with the pull router, the engines of a pipelined resize to
        the rollout that started at this boundary: each pulls from the step's queue once its
        drain, release, join and restore are done and it has warmed up (our router admits an
        engine mid-step, `backends/vllm/router.py`); the commit still waits for the boundary."""
        model = self.model
        fl = self.state.inflight
        if (self.naive or model.router != "pull" or fl is None or fl.plan.kind is not PlanKind.RESIZE
                or fl.plan.to_pool is not Pool.ROLLOUT or fl.plan.resize_id in self._served_early
                or fl.started_at != now):
            return model.rollout_seconds(w, split.rollout)
        profile = model.profile
        ready = profile.resize.to_rollout.ready_s()
        home, extra = model.engines(split.rollout), model.engines(len(fl.plan.devices))
        if extra == 0:
            return model.rollout_seconds(w, split.rollout)  # too few devices moving for one engine
        late = np.concatenate([np.zeros(home), np.full(extra, ready)])
        self._served_early.add(fl.plan.resize_id)
        return float(model.engine_finish(w, home + extra, late, home=home).max())

    def _candidates(self) -> tuple[Split, ...]:
        """The splits the policy may pick: the profile's, and with engines of several devices
        only those whose rollout pool is whole engines (a resize moves whole engines, and the
        devices it brings start whole engines); empty: every split."""
        profile = self.model.profile
        gpe = profile.rollout.gpus_per_engine
        splits = profile.candidate_splits()
        if gpe == 1:
            return splits
        if not splits:
            splits = tuple(Split(self.gpus - r, r) for r in range(gpe, self.gpus, gpe))
        return tuple(c for c in splits if c.rollout % gpe == 0 or c == profile.initial_split)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> DynamicRun:
        model = self.model
        profile = model.profile
        initial = profile.initial_split
        pools = tuple(Pool.TRAINING if i < initial.train else Pool.ROLLOUT for i in range(self.gpus))
        self._feed(ev.Configure(at=0.0, devices=self.devices, pools=pools, candidates=self._candidates()))
        for i, d in enumerate(self.devices):
            self._feed(ev.WorkerHello(at=0.0, worker_id=engine_id(i), kind=WorkerKind.ROLLOUT_ENGINE, devices=(d,)))
            self._feed(ev.WorkerHello(at=0.0, worker_id=trainer_id(i), kind=WorkerKind.TRAINER_RANK, devices=(d,)))
        self._initial_engines()
        k = model.steps
        sync = model.weight_sync_s
        now = 0.0
        windows: list[Window] = []
        held: list[tuple[int, str]] = []
        last_rollout = (0.0, 0, 0.0)  # (seconds, devices, device-seconds) of the previous window's rollout
        for w in range(k + 1):
            if self.naive and self.state.inflight is not None:
                now = self._stop_the_world(now)
                self._form_arrived_engines(now)
            split = self.state.split
            moving = self.gpus - split.total
            rollout_s = train_s = served = train_served = 0.0
            lent = 0
            if self.lending and moving == 0 and self.state.inflight is None:
                rollout_s, train_s, lent, served, train_served = self._window_with_loans(w, now, split)
            else:
                if w < k:
                    rollout_s = self._mixed_rollout_s(w, split, now) + self._penalty[Pool.ROLLOUT]
                    served = rollout_s * split.rollout
                if w >= 1:
                    train_s = model.train_seconds(w - 1, split.train) + self._penalty[Pool.TRAINING]
                self._late.clear()
            self._penalty = {Pool.ROLLOUT: 0.0, Pool.TRAINING: 0.0}
            end = now + max(rollout_s, train_s) + (sync if w >= 1 else 0.0)
            if self._early_home is not None:
                # lent trainers that went home inside the window: the next step waits for the
                # part of their way home that outlasts this window
                at, paid = self._early_home
                self._penalty[Pool.TRAINING] += max(at + paid - end, 0.0)
                self._early_home = None
            self._ack_until(end)
            self._finish_joins(end)
            end = self._land_loan(end)
            windows.append(Window(w, now, end, split.rollout, split.train, moving, rollout_s, train_s, lent))
            now = end
            self._feed(ev.Tick(at=now))
            if w >= 1:
                step = w - 1
                timing = StepTiming(
                    step=step,
                    rollout_s=last_rollout[0],
                    train_s=train_s,
                    weight_sync_s=sync,
                    rollout_devices=last_rollout[1],
                    rollout_device_s=last_rollout[2],
                    train_devices=split.train,
                    train_device_s=train_served,
                    samples=int(model.samples[step]),
                    response_tokens=int(model.response_tokens[step]),
                    lengths=model.lengths(step),
                )
                before = len(self.facts)
                consulted = self.state.phase is Phase.STEADY and not self.state.paused
                self._feed(ev.StepReported(at=now, worker_id=self._reporter(), timing=timing))
                reason = getattr(self.policy, "last_reason", "")
                proposed = any(isinstance(x, (f.ResizeStarted, f.ProposalRejected)) for x in self.facts[before:])
                if consulted and reason and not proposed:
                    held.append((step, reason))
            if not self.naive:
                self._commit_at_boundary(now)
            self._ack_until(now)  # a loan's way home is answered at the boundary
            self._form_arrived_engines(now)
            if w + 1 < k:
                self._regroup(w, now)
            last_rollout = (rollout_s, split.rollout, served)
            if self.progress is not None:
                self.progress(w + 1, k + 1)
        # A resize started at the very last boundary never ran: nothing is left to run on it.
        return DynamicRun(
            total_time_s=now,
            windows=tuple(windows),
            facts=tuple(self.facts),
            final_split=self.state.split,
            state=self.state,
            held=tuple(held),
        )
