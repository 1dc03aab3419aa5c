"""The policy plug-in interface: a pure function of an observed view to a proposal or nothing.

Policies never see the daemon, the clock or the network: everything they may use is in
`ObservedView`. Built-in and third-party policies are found through the entry-point group
`dynaresized.policies`; each entry point names a class taking keyword options.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

import msgspec

from dynaresized.domain import DeviceId, Pool, Split, StepTiming

ENTRY_POINT_GROUP = "dynaresized.policies"


class ResizeCosts(msgspec.Struct, frozen=True):
    """Estimated seconds on the critical path of moving one device, per direction."""

    to_training_s: float = 30.0
    to_rollout_s: float = 30.0

    def for_move(self, before: Split, after: Split) -> float:
        """Every moving device's seconds in a row: the estimate before any step is measured."""
        return abs(after.train - before.train) * self.per_device(before, after)

    def per_device(self, before: Split, after: Split) -> float:
        return self.to_training_s if after.train > before.train else self.to_rollout_s


class ObservedView(msgspec.Struct, frozen=True):
    """What a policy may look at when it decides."""

    now: float
    step: int  # the last completed step
    split: Split  # current Train:Rollout split
    candidates: tuple[Split, ...]  # the splits the operator allows
    recent: tuple[StepTiming, ...]  # oldest first, bounded window
    costs: ResizeCosts
    steps_remaining: int | None = None  # None when the job length is unknown
    history: tuple[StepTiming, ...] = ()  # up to 256 steps across resizes, oldest first
    rollout_loan_costs: LoanCosts | None = None
    """What a loan of trainers to the rollout costs (configured or learned, as `LoanView`'s):
    a lending policy predicts a split's step with its own loans (`costmodel.Measure.step_on`).
    None: the policy does not know (a view built without it)."""
    tail_binds: bool = True
    """A step waits for its longest response (False: the job's pipeline carries an unfinished
    response over, `costmodel.tail_binds`): whether the cost model uses the latency floor."""
    rollout_done_step: int = -1
    rollout_done_s: float = -1.0
    """The rollout step after `step` that the engines' progress reports say is done, and its
    seconds (one-step off, at a step boundary the next step's rollout has finished, and its step
    report comes a window later; -1: none reported). A policy may decide from it
    (`hysteresis`'s `decide_from_progress`)."""


class Proposal(msgspec.Struct, frozen=True):
    target: Split
    reason: str
    predicted_step_s: float  # predicted step time if nothing changes
    predicted_step_s_after: float  # predicted step time on the target split

    @property
    def saving_per_step_s(self) -> float:
        return self.predicted_step_s - self.predicted_step_s_after


@runtime_checkable
class Policy(Protocol):
    """`name` is the entry-point name; `guarded` False skips the hysteresis guards
    (never the safety checks: candidate splits, minimum pool sizes, one resize at a time)."""

    name: str
    guarded: bool

    def __call__(self, view: ObservedView) -> Proposal | None: ...


class UnknownPolicyError(LookupError):
    pass


def available_policies() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))


def policy_options(cls: type) -> dict[str, Any] | None:
    """The keyword options a policy class takes, each with its default (None for one taking
    any keyword, whose options are its own business)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # a signature Python cannot read: let the call decide
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default) for p in params
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


def load_policy(name: str, options: Mapping[str, Any] | None = None) -> Policy:
    """Instantiate the policy registered under `name` with keyword `options`."""
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        raise UnknownPolicyError(
            f"unknown policy {name!r}; installed policies: {', '.join(available_policies()) or 'none'}"
        )
    cls = matches[0].load()
    options = dict(options or {})
    accepted = policy_options(cls)
    unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
    valid = "; valid options: " + (", ".join(f"{k} (default {v!r})" for k, v in accepted.items()) or "none") \
        if accepted is not None else ""
    if unknown:
        raise ValueError(f"bad options for policy {name!r}: unknown option(s) {', '.join(map(repr, unknown))}{valid}")
    try:
        policy = cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}{valid}") from None
    if not isinstance(policy, Policy):
        raise TypeError(f"entry point {name!r} does not implement the Policy interface")
    return policy


def stage_split_estimate(timing: StepTiming, split: Split) -> tuple[float, float]:
    """Device-seconds of rollout and training work in one step: time × the devices that served
    each stage (devices lent to it included), `split`'s pool sizes where the step does not say."""
    rollout = timing.rollout_devices_served or max(split.rollout, 1)
    train = timing.train_devices_served or max(split.train, 1)
    return timing.rollout_s * rollout, timing.train_s * train


def predicted_step_s(rollout_work: float, train_work: float, split: Split, sync_s: float = 0.0) -> float:
    """One-step off-policy pipeline: a step takes max(rollout, training) + weight sync,
    each stage's time being its work spread over its pool (linear scaling)."""
    if split.rollout <= 0 or split.train <= 0:
        return float("inf")
    return max(rollout_work / split.rollout, train_work / split.train) + sync_s


# -- loans: lending idle devices for the rest of a step -------------------------------


class LoanCosts(msgspec.Struct, frozen=True):
    """Estimated seconds a loan adds to the critical path, per lent device group."""

    to_training_s: float = 8.0
    """An idle engine released and its trainer joining at a mini-batch boundary (the training
    step in progress pays the group change and the joiner's first step)."""
    to_rollout_s: float = 6.0
    """A done trainer leaving and its engine waking to pull the step's queued requests."""
    return_s: float = 4.0
    """Going home at the step boundary (paid by the next step of the home pool)."""
    lead_s: float = 6.0
    """Seconds from lending until the device can join the other pool (its release and join)."""

    def learned(self, times: Sequence[Any], to_pool: Pool) -> LoanCosts:
        """These costs with what the last loans to `to_pool` measured (`state.LoanTime`s): the
        mean way home replaces `return_s` and, to the rollout, the mean landing `to_rollout_s`
        (a done trainer leaving and its engine joining is the landing). The lead stays as
        configured: a worker acknowledges its join before it serves (an engine still warms
        up), so a landing's seconds are not when the lent device starts to help; nor is the
        group change and first mini-batch of a loan to training (`to_training_s`) an op's
        duration. Nothing measured that way: these, unchanged."""
        landed = [t.landed_s for t in times if t.to_pool is to_pool]
        back = [t.returned_s for t in times if t.to_pool is to_pool and t.returned_s >= 0]
        costs = self
        if landed and to_pool is Pool.ROLLOUT:
            costs = msgspec.structs.replace(costs, to_rollout_s=sum(landed) / len(landed))
        if back:
            costs = msgspec.structs.replace(costs, return_s=sum(back) / len(back))
        return costs


class TailCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What regrouping a step's tail into a wider engine costs, and how fast engines of each
    width decode a tail (a few requests): the simulator's profile gives them (`[resize.tail]`);
    none in the daemon, whose backends do not move a running request's KV cache."""

    switch_s: float = 2.0
    """Seconds from the decision to the tail decoding on the wider engine: pause, move the
    running requests' KV cache onto the wider group, whose communicators are pre-warmed, resume."""
    back_s: float = 1.0
    """Seconds at the step boundary for the wider engine to become the engines it was made of
    (their communicators kept): the next rollout starts that late on its devices."""
    widths: tuple[int, ...] = (1,)  # engine widths (devices per engine) allowed, ascending
    base_s: tuple[float, ...] = (0.0,)
    """Per width in `widths`: seconds of a decode iteration whatever it runs (weights read,
    all-reduces)."""
    per_request_s: tuple[float, ...] = (0.0,)
    """Per width in `widths`: seconds a decode iteration adds per running request (its compute
    and its KV cache read, at the context of a long response)."""

    def iteration_s(self, width: int, running: int) -> float | None:
        """Seconds of one decode iteration of `running` requests on an engine of `width` devices."""
        if width not in self.widths:
            return None
        i = self.widths.index(width)
        return self.base_s[i] + running * self.per_request_s[i]


class EngineTail(msgspec.Struct, frozen=True, array_like=True):
    """An engine whose step's queue is empty and which still decodes `running` requests, with at
    most `tokens_left` tokens to go (the longest of them) when it said so at `at`."""

    devices: tuple[DeviceId, ...]  # the engine's, its leader first
    running: int
    tokens_left: int
    at: float


class TailProposal(msgspec.Struct, frozen=True):
    """Regroup `devices` (a busy engine's first, then idle engines') into one engine of
    `len(devices)` devices for the rest of the step; the core regroups them back at the boundary."""

    devices: tuple[DeviceId, ...]
    reason: str
    saves_s: float  # predicted seconds the step's rollout ends sooner
    cost_s: float  # predicted seconds the switch and the way back add


class LoanView(msgspec.Struct, frozen=True):
    """What a lending decision may look at: measured progress of the step in progress, never
    the lengths of responses not yet generated."""

    now: float
    split: Split  # home split
    idle_engines: tuple[str, ...]  # rollout devices with nothing left to do this step
    free_trainers: tuple[str, ...]  # training devices whose part of the step is done
    training_devices: int  # devices in the training pool now, lent ones included
    mini_batch_done: int  # of the training step in progress (0 before its first report)
    mini_batch_total: int
    mini_batch_s: float  # last measured seconds per mini-batch on the current group (0: unknown)
    queue_empty: bool  # an engine reported that the rollout step's queue is empty
    costs: LoanCosts
    """Of a loan to training: configured, or learned from the last loans that way (`learned`)."""
    recent: tuple[StepTiming, ...] = ()
    rollout_step: int = -1  # the rollout step in progress (the one idle_engines and samples_* are of)
    samples_done: int = 0
    """Samples of `rollout_step` the engines have reported finished (`ProgressReported`, summed
    over engines; lent devices serving the rollout included)."""
    samples_total: int = 0  # the step's samples, as the engines report it (0: no report yet)
    rollout_costs: LoanCosts | None = None
    """Of a loan to the rollout, configured or learned likewise (None: `costs`)."""
    tails: tuple[EngineTail, ...] = ()  # engines of `rollout_step` that still decode its last requests
    tail_costs: TailCosts | None = None  # None: tails are never regrouped (`CoreConfig.tail_costs`)
    lent_to_rollout: tuple[DeviceId, ...] = ()  # trainers' devices lent to the rollout, landed
    tail_open: bool = False  # a tail regroup's engine serves until the step boundary
    step_started_at: float = -1.0
    """When the step in progress began (the last step report; -1: no step reported yet): with
    `recent`, how far into its predicted rollout the step is."""
    tail_binds: bool = True  # as `ObservedView.tail_binds`
    mini_batch_at: float = -1.0
    """When the trainer reported its last mini-batch done (-1: unknown): the mini-batch running now
    began then, and is that far along."""

    def costs_to(self, pool: Pool) -> LoanCosts:
        """The loan costs a loan to `pool` is estimated with."""
        if pool is Pool.ROLLOUT and self.rollout_costs is not None:
            return self.rollout_costs
        return self.costs


class LoanProposal(msgspec.Struct, frozen=True):
    devices: tuple[str, ...]
    to_pool: str  # "training" or "rollout" (a Pool value)
    reason: str
    saves_s: float  # predicted seconds saved in the rest of the step
    cost_s: float  # predicted seconds the loan adds to the critical path
    ends_in_s: float = -1.0
    """Predicted seconds from now until the stage the devices are lent to finishes the step's
    work, with the loan (< 0: no prediction). The core checks it against what the step measures
    (`LoanChecked`)."""
