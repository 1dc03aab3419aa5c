"""Hysteresis guards: pure checks that stand between a policy's proposal and a resize.

Each guard returns None ("go") or a `Rejection` whose text an operator reads to learn why
nothing happened. Defaults follow DynaResize (cooldown longer than 10 steps, payback in about
11 steps) and are documented field by field in `GuardConfig`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from dynaresized.core.costmodel import measure
from dynaresized.core.policy import LoanProposal, LoanView, ObservedView, Proposal, TailProposal
from dynaresized.domain import Pool, Split, StepTiming


class GuardConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    imbalance_threshold: float = 0.15
    """Act only when |rollout - train| / max(rollout, train) of the last step is at least this."""
    signal_run: int = 3
    """...and the last `signal_run` steps all pointed the same way."""
    min_dwell_s: float = 60.0
    """Seconds that must pass after a resize ends before the next may start."""
    cooldown_steps: int = 10
    """RL steps that must complete after a resize ends before the next may start."""
    min_rollout: int = 1
    """Devices the rollout pool never goes below (enforced even for unguarded policies)."""
    min_train: int = 1
    """Devices the training pool never goes below (enforced even for unguarded policies)."""
    payback_horizon_steps: int = 50
    """Steps over which a resize must pay back when the job length is unknown."""
    payback_safety: float = 1.5
    """Predicted saving over the horizon must exceed predicted resize cost times this."""
    verify_steps: int = 3
    """Steps on the new split whose mean is checked against the policy's prediction."""
    payback_backoff: float = 2.0
    """A resize that measured worse (or did not pay back over its window) multiplies the
    required payback by this; one that paid back divides it again, down to 1."""
    payback_backoff_max: float = 8.0
    """The learned payback multiplier never exceeds this."""
    loan_safety: float = 1.0
    """A loan goes ahead only if its predicted saving in the rest of the step exceeds its
    predicted cost times this."""
    min_gain: float = 0.03
    """A resize whose predicted saving per step is below this fraction of the predicted step
    time is not made: a gain the model cannot tell from its own error (0: any gain)."""
    undo_worse: bool = True
    """A resize whose first `verify_steps` steps on the new split measured slower per response
    token than the split it left, by more than `undo_margin`, is judged worse at once and undone
    at the next step boundary: the cooldown, dwell, run of signals and payback do not hold an
    undo back (the safety checks do)."""
    undo_margin: float = 0.06
    """How much slower per response token than the split it left a resize must measure over its
    first `verify_steps` steps to be undone early (`undo_worse`): above the step-to-step noise of
    a long-tailed rollout over three steps (4-5% at 256 devices), twice `min_gain`."""


class Rejection(msgspec.Struct, frozen=True):
    guard: str
    reason: str


class History(msgspec.Struct, frozen=True):
    """What the guards need to know about past resizes."""

    last_resize_end_at: float | None = None
    last_resize_end_step: int | None = None
    payback_factor: float = 1.0  # learned: raised by resizes that hurt, lowered by ones that paid back


def signal(timing: StepTiming, threshold: float) -> Pool | None:
    """The pool a step asks to grow: the slower stage, if the imbalance reaches `threshold`."""
    slow = max(timing.rollout_s, timing.train_s)
    if slow <= 0:
        return None
    if abs(timing.rollout_s - timing.train_s) / slow < threshold:
        return None
    return Pool.ROLLOUT if timing.rollout_s > timing.train_s else Pool.TRAINING


def grows(before: Split, after: Split) -> Pool | None:
    if after.rollout > before.rollout:
        return Pool.ROLLOUT
    if after.train > before.train:
        return Pool.TRAINING
    return None


def check_candidates(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    if p.target.total != view.split.total:
        return Rejection("candidates", f"target {p.target} does not use all {view.split.total} devices")
    if view.candidates and p.target not in view.candidates:
        allowed = ", ".join(str(c) for c in view.candidates)
        return Rejection("candidates", f"target {p.target} is not an allowed split ({allowed})")
    if p.target == view.split:
        return Rejection("candidates", f"target {p.target} is the current split")
    return None


def check_min_pools(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    if p.target.rollout < cfg.min_rollout:
        return Rejection("min_pool", f"rollout pool would drop to {p.target.rollout} < min_rollout={cfg.min_rollout}")
    if p.target.train < cfg.min_train:
        return Rejection("min_pool", f"training pool would drop to {p.target.train} < min_train={cfg.min_train}")
    return None


def check_threshold(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    if not view.recent:
        return Rejection("threshold", "no step observed yet")
    last = view.recent[-1]
    want = grows(view.split, p.target)
    got = signal(last, cfg.imbalance_threshold)
    if got is None:
        slow = max(last.rollout_s, last.train_s) or 1.0
        imb = abs(last.rollout_s - last.train_s) / slow
        return Rejection(
            "threshold",
            f"step {last.step} imbalance {imb:.1%} below imbalance_threshold={cfg.imbalance_threshold:.0%}",
        )
    if got is not want:
        return Rejection("threshold", f"step {last.step} asks to grow {got.value}, proposal grows {want and want.value}")
    return None


def check_signal_run(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    want = grows(view.split, p.target)
    # Only steps observed on the current split count: older ones describe another topology.
    run = 0
    for timing in reversed(view.recent):
        if signal(timing, cfg.imbalance_threshold) is not want:
            break
        run += 1
    if run < cfg.signal_run:
        return Rejection(
            "signal_run",
            f"{run} consecutive step(s) ask to grow {want and want.value}; signal_run={cfg.signal_run} needed",
        )
    return None


def check_dwell(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    return _since_last_resize(
        "dwell", view.now, h.last_resize_end_at, cfg.min_dwell_s,
        lambda waited: f"{waited:.1f}s since the last resize; min_dwell_s={cfg.min_dwell_s:g}")


def check_cooldown(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    return _since_last_resize(
        "cooldown", view.step, h.last_resize_end_step, cfg.cooldown_steps,
        lambda steps: f"{steps} step(s) since the last resize; cooldown_steps={cfg.cooldown_steps}")


def _since_last_resize(guard: str, now: float, ended: float | None, least: float,
                       why: Callable[[float], str]) -> Rejection | None:
    """Rejection `guard`, saying `why(now - ended)`, while less than `least` has passed since the
    last resize ended at `ended` (seconds or steps); None after that, and before any resize."""
    if ended is None:
        return None
    passed = now - ended
    if passed < least:
        return Rejection(guard, why(passed))
    return None


def check_min_gain(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    if p.predicted_step_s <= 0 or cfg.min_gain <= 0:
        return None  # no prediction (an operator's resize) or no margin asked
    gain = p.saving_per_step_s / p.predicted_step_s
    if gain < cfg.min_gain:
        return Rejection("min_gain", f"predicted gain {p.saving_per_step_s:.2f}s/step is {gain:.1%} of the "
                                     f"{p.predicted_step_s:.1f}s step, below min_gain={cfg.min_gain:.0%}")
    return None


COST_STEPS = 3
"""Measured steps a resize's cost is predicted from (the hysteresis policy's window)."""


def resize_cost_s(view: ObservedView, target: Split) -> float:
    """What a resize to `target` costs the job, on its critical path: its ops on one device (they
    run on every moving device at once), and the window it is in flight, when the moving devices
    serve neither pool (`costmodel.Measure.in_flight_s`, from the last measured steps). Before a
    step is measured: every moving device's ops in a row (`ResizeCosts.for_move`). The payback
    guard prices a move with it, and the verdict judges the move against it."""
    model = measure(view.recent[-COST_STEPS:], view.split, floor=view.tail_binds)
    if model is None:
        return view.costs.for_move(view.split, target)
    return view.costs.per_device(view.split, target) + model.in_flight_s(view.split, target)


def check_payback(view: ObservedView, p: Proposal, cfg: GuardConfig, h: History) -> Rejection | None:
    horizon = payback_horizon(view, cfg)
    cost = resize_cost_s(view, p.target)
    gain = p.saving_per_step_s * horizon
    if gain <= cost * cfg.payback_safety * h.payback_factor:
        learned = (f" x {h.payback_factor:g} (raised after resizes that did not pay back)"
                   if h.payback_factor != 1.0 else "")
        return Rejection(
            "payback",
            f"saves {p.saving_per_step_s:.2f}s/step x {horizon} steps = {gain:.1f}s, "
            f"not above cost {cost:.1f}s x payback_safety {cfg.payback_safety:g}{learned}",
        )
    return None


def payback_horizon(view: ObservedView, cfg: GuardConfig) -> int:
    """Steps over which a resize decided now must pay back (and is judged afterwards)."""
    return view.steps_remaining if view.steps_remaining is not None else cfg.payback_horizon_steps


Guard = Callable[[ObservedView, Proposal, GuardConfig, History], Rejection | None]

SAFETY: tuple[Guard, ...] = (check_candidates, check_min_pools)
"""Checked for every proposal, guarded policy or not."""

HYSTERESIS: tuple[Guard, ...] = (check_threshold, check_signal_run, check_dwell, check_cooldown, check_min_gain,
                                 check_payback)
"""Checked for guarded policies (all built-ins but `greedy`)."""


def evaluate(
    view: ObservedView, proposal: Proposal, cfg: GuardConfig, history: History, *, hysteresis: bool = True
) -> Rejection | None:
    guards = SAFETY + HYSTERESIS if hysteresis else SAFETY
    for guard in guards:
        rejection = guard(view, proposal, cfg, history)
        if rejection is not None:
            return rejection
    return None


def check_tail(view: LoanView, p: TailProposal, cfg: GuardConfig) -> Rejection | None:
    """Why a tail regroup may not go ahead, or None: one busy engine and idle ones only, into an
    allowed width, and only when it pays (`loan_safety`, as a loan)."""
    busy = {t.devices[0]: t.devices for t in view.tails}
    if not p.devices or p.devices[0] not in busy:
        return Rejection("tail", "a tail regroup starts from an engine that still decodes the step's last requests")
    rest = [d for d in p.devices if d not in busy[p.devices[0]]]
    free = set(view.idle_engines) | set(view.lent_to_rollout)
    if any(d not in free for d in rest):
        return Rejection("loan_idle", f"{', '.join(d for d in rest if d not in free)}: engine has work left; "
                                      "only idle engines and trainers lent to the rollout join a tail")
    if view.tail_costs is None or len(p.devices) not in view.tail_costs.widths:
        return Rejection("tail", f"engines of {len(p.devices)} device(s) are not allowed")
    if p.saves_s <= p.cost_s * cfg.loan_safety:
        return Rejection("tail_payback", f"saves ~{p.saves_s:.1f}s, not above cost {p.cost_s:.1f}s x "
                                         f"loan_safety {cfg.loan_safety:g}")
    return None


def check_loan(view: LoanView, p: LoanProposal, cfg: GuardConfig) -> Rejection | None:
    """Why a loan may not go ahead, or None: only idle devices, and only when it pays."""
    # a set: a loan of hundreds of devices is checked up to 65 times a step while trainers wait
    free = set(view.idle_engines if p.to_pool == Pool.TRAINING.value else view.free_trainers)
    if not p.devices:
        return Rejection("loan_idle", "a loan names no device")
    busy = [d for d in p.devices if d not in free]
    if busy:
        what = "engine has work left" if p.to_pool == Pool.TRAINING.value else "trainer has not finished its step"
        return Rejection("loan_idle", f"{', '.join(busy)}: {what}; only idle devices are lent")
    if p.saves_s <= p.cost_s * cfg.loan_safety:
        return Rejection("loan_payback", f"saves ~{p.saves_s:.1f}s, not above cost {p.cost_s:.1f}s x "
                                         f"loan_safety {cfg.loan_safety:g}")
    return None
