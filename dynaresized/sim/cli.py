"""The `simulate`, `plan` and `bench` subcommands.

`add_parsers(subparsers)` adds them to an argparse subparsers object (the `dynaresized` CLI
calls it); `run_cli(args)` runs the chosen one and returns the exit status. `python -m
dynaresized.sim` runs them on their own.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import msgspec

from dynaresized.core.idle import percent
from dynaresized.core.policy import UnknownPolicyError, available_policies, load_policy
from dynaresized.domain import PIPELINES, PipelineSpec
from dynaresized.sim.asyncrun import async_summary, simulate_async
from dynaresized.sim.plan import PILOT_STEPS, Plan, Replanner, plan, plan_start, start_plan
from dynaresized.sim.plot import PlotUnavailable
from dynaresized.sim.profile import Profile, ProfileError, builtin_profiles, load_profile, parse_split
from dynaresized.sim.stages import ROUTERS, StageModel
from dynaresized.sim.run import (
    AUTO_JOBS_FROM_GPUS,
    BENCH_POLICIES,
    SimReport,
    baselines,
    bench,
    guards_for,
    scenario_shape,
    simulate,
)
from dynaresized.sim.workload import (
    DYNAMIC_SCENARIOS,
    SCENARIOS,
    Trace,
    TraceError,
    UnknownScenarioError,
    load_trace,
    scenario_trace,
)
from dynaresized.spelling import did_you_mean

DEFAULT_PROFILE = "qwen3-8b-h20x8"


class ProgressBar:
    """A one-line progress bar on a terminal (stderr); silent anywhere else."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.label = label
        self.width = width
        self._last = -1.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.1:
            return  # redraw at most ten times a second
        self._last = now
        filled = int(self.width * done / max(total, 1))
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}")
        if done >= total:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 24) + "\r")
        self.stream.flush()


def _key_values(items: list[str] | None, what: str) -> dict[str, Any]:
    """`["cooldown_steps=5", "payback_safety=2"]` -> {"cooldown_steps": 5, "payback_safety": 2.0}."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r} must look like KEY=VALUE")
        try:
            out[key] = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            out[key] = raw  # a bare string
    return out


def add_parsers(subparsers: Any) -> None:
    """Add `simulate`, `plan` and `bench` to an `argparse` subparsers object."""
    sim = subparsers.add_parser(
        "simulate",
        help="replay a rollout trace or a built-in scenario through the core and a policy, in virtual time",
        description=(
            "Simulate a disaggregated RL pipeline whose devices are moved by the daemon's own core and "
            "policy, and compare it with the best static split, the colocated mode and a lower bound."
        ),
    )
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="JSON Lines trace, one line per RL step")
    source.add_argument("--scenario", metavar="NAME", help=f"built-in scenario: {', '.join(SCENARIOS)}")
    sim.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE",
                     help=f"cluster profile: {', '.join(builtin_profiles())} or a TOML file "
                          f"(default {DEFAULT_PROFILE})")
    sim.add_argument("--policy", default="hysteresis", metavar="NAME",
                     help="installed policy (static, greedy, hysteresis, planner, ...); default hysteresis")
    sim.add_argument("--gpus", type=int, metavar="N", help="devices in the cluster (default: the profile's)")
    sim.add_argument("--steps", type=int, metavar="K", help="simulate only the first K steps")
    sim.add_argument("--tp", type=int, metavar="K",
                     help="run the policy on rollout engines of K devices (one of the profile's tp_sizes); the "
                          "baselines stay those of the profile (best static configuration, TP-1 split)")
    sim.add_argument("--initial-split", metavar="T:R", help="start the run at Train:Rollout T:R (default: the profile's)")
    sim.add_argument("--layout", choices=("profile", "plan"),
                     help="where the run starts: plan (the plan search picks the engine size and split from the "
                          "first --pilot-steps steps, no hindsight; the default) or profile (the profile's engines "
                          "and initial split; the default with --tp or --initial-split); the baselines stay those of "
                          "the profile")
    sim.add_argument("--pilot-steps", type=int, default=PILOT_STEPS, metavar="K",
                     help=f"steps the plan search sees (--layout plan; default {PILOT_STEPS})")
    sim.add_argument("--replan-every", type=int, default=0, metavar="N",
                     help="every N steps, search the configuration again on the last --pilot-steps steps generated "
                          "and regroup the rollout pool into the engine size it picks, when the saving it predicts "
                          "is twice the regroup's cost, twice in a row (default 0: never)")
    sim.add_argument("--samples", type=int, metavar="S", help="samples per step of a built-in scenario")
    sim.add_argument("--seed", type=int, default=0, help="seed of a built-in scenario (default 0)")
    sim.add_argument("--naive", action="store_true",
                     help="charge naive resize costs: stop the pipeline, fresh communicators, full restart")
    sim.add_argument("--router", choices=ROUTERS, default="pull",
                     help="request placement: pull (one queue, our router; default), verl (contiguous chunks at "
                          "submission, verl's dispatch) or round-robin (request j on engine j %% E)")
    sim.add_argument("--policy-option", action="append", metavar="KEY=VALUE", help="option for the policy")
    sim.add_argument("--guard", action="append", metavar="KEY=VALUE",
                     help="override a hysteresis guard, e.g. cooldown_steps=5")
    sim.add_argument("--jobs", type=int, metavar="N",
                     help="processes: verl's two rules run in their own while this one runs the policy and the "
                          f"baselines (default: the machine's cores from {AUTO_JOBS_FROM_GPUS} devices on, else 1; "
                          "the report is the same)")
    sim.add_argument("--pipeline", choices=PIPELINES,
                     help="the job's pipeline (default: the profile's [pipeline], else one-step-off): one-step-off, "
                          "fully-async (verl's: --staleness, --partial-rollout, --sync-every) or synchronous")
    sim.add_argument("--staleness", type=float, metavar="S",
                     help="verl's staleness_threshold (fully-async; default: the profile's, else 1)")
    sim.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=None,
                     help="verl's partial_rollout: a weight sync aborts running requests, which go on under the "
                          "new weights (fully-async; default: the profile's, else off)")
    sim.add_argument("--sync-every", type=int, metavar="K",
                     help="verl's trigger_parameter_sync_step: mini-batches per weight sync (fully-async; default: "
                          "the profile's, else 1)")
    sim.add_argument("--json", action="store_true", help="print exactly one JSON object")
    sim.add_argument("--plot", metavar="FILE.png", help="write a PNG: pools over time, stage times, resizes")
    sim.set_defaults(sim_command="simulate", run=run_cli)

    pl = subparsers.add_parser(
        "plan",
        help="where `simulate` starts a policy, and the fastest static configuration per phase of a trace",
        description=(
            "ReaL's plan search on the simulator's cost model. First the start `simulate` uses: the fastest "
            "static configurations of the first --pilot-steps steps, each run with the policy, the fastest "
            "kept, with the predicted totals of the policy from there and of the best static configuration. "
            "Then the static plan: cut the trace into phases of alike response lengths, search each phase's "
            "configuration on its first --pilot-steps steps, and check the prediction against the phase "
            "simulated whole."
        ),
    )
    plan_source = pl.add_mutually_exclusive_group(required=True)
    plan_source.add_argument("--trace", metavar="FILE", help="JSON Lines trace, one line per RL step")
    plan_source.add_argument("--scenario", metavar="NAME", help=f"built-in scenario: {', '.join(SCENARIOS)}")
    pl.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE")
    pl.add_argument("--gpus", type=int, metavar="N", help="devices in the cluster (default: the profile's)")
    pl.add_argument("--steps", type=int, metavar="K", help="plan only the first K steps")
    pl.add_argument("--samples", type=int, metavar="S", help="samples per step of a built-in scenario")
    pl.add_argument("--seed", type=int, default=0, help="seed of a built-in scenario (default 0)")
    pl.add_argument("--router", choices=ROUTERS, default="pull")
    pl.add_argument("--pilot-steps", type=int, default=PILOT_STEPS, metavar="K",
                    help=f"steps of each phase the search sees (default {PILOT_STEPS})")
    pl.add_argument("--policy", default="hysteresis", metavar="NAME",
                    help="the policy whose start to plan, as `simulate --policy` runs it (default hysteresis)")
    pl.add_argument("--policy-option", action="append", metavar="KEY=VALUE", help="option for the policy")
    pl.add_argument("--guard", action="append", metavar="KEY=VALUE", help="override a hysteresis guard")
    pl.add_argument("--method", choices=("exhaustive", "bound", "mcmc"),
                    help="search method (default: exhaustive for small spaces, the exact bound up to 256 "
                         "configurations, MCMC above)")
    pl.add_argument("--json", action="store_true", help="print exactly one JSON object")
    pl.set_defaults(sim_command="plan", run=run_cli)

    b = subparsers.add_parser("bench", help="run every built-in scenario x policy and print a table",
                              description="Run every built-in scenario with every built-in policy on one profile.")
    b.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE")
    b.add_argument("--steps", type=int, metavar="K", help="steps per scenario (default: each scenario's)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--naive", action="store_true")
    b.add_argument("--scenarios", default=",".join(DYNAMIC_SCENARIOS), help="comma-separated scenario names")
    b.add_argument("--policies", default=",".join(BENCH_POLICIES), help="comma-separated policy names")
    b.add_argument("--json", action="store_true", help="print JSON lines, one per row")
    b.set_defaults(sim_command="bench", run=run_cli)


def run_cli(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    try:
        if args.sim_command == "simulate":
            return _simulate(args, out)
        if args.sim_command == "plan":
            return _plan(args, out)
        return _bench(args, out)
    except (ProfileError, TraceError, UnknownScenarioError, UnknownPolicyError, ValueError, PlotUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _require_policies(names: list[str]) -> None:
    installed = available_policies()
    for name in names:
        if name not in installed:
            raise UnknownPolicyError(f"unknown policy {name!r}; installed policies: {', '.join(installed)}"
                                     f"{did_you_mean(name, installed)}")


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")


def _workload(args: argparse.Namespace) -> tuple[Profile, Trace, int | None]:
    """The profile, trace and seed that `--profile/--gpus/--trace/--scenario/--samples/--steps` name."""
    _positive(args.steps, "--steps")
    _positive(args.samples, "--samples")
    profile = load_profile(args.profile)
    if args.gpus is not None:
        profile = profile.with_gpus(args.gpus)
    if args.trace is not None:
        if args.samples is not None:
            raise ValueError("--samples applies to built-in scenarios; a trace has its own samples")
        trace = load_trace(args.trace)
        if args.steps is not None:
            trace = trace.head(args.steps)
        warning = lengths_warning(trace, profile)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        return profile, trace, None
    if args.samples is not None:
        profile = profile.with_samples(args.samples)
    return profile, scenario_trace(args.scenario, scenario_shape(profile), seed=args.seed, steps=args.steps), args.seed


def lengths_warning(trace: Trace, profile: Profile) -> str:
    """What to say when `trace` has responses longer than the profile's `max_response_tokens`
    (an engine with that `max_tokens` would have cut them): "" when it has none."""
    limit = profile.workload.max_response_tokens
    over = [int((b.response_tokens > limit).sum()) for b in trace.steps]
    n = sum(over)
    if not n:
        return ""
    total = sum(len(b.response_tokens) for b in trace.steps)
    longest = max(int(b.response_tokens.max()) for b in trace.steps if len(b.response_tokens))
    steps = sum(k > 0 for k in over)
    return (f"{trace.name}: {n} of {total} responses ({steps} of {len(trace)} steps) are longer than profile "
            f"{profile.name}'s max_response_tokens = {limit} (the longest: {longest}); they are simulated at their "
            f"traced length, which an engine with that max_tokens would have cut. Give a profile whose "
            f"[workload] max_response_tokens is the run's max_tokens")


def _simulate(args: argparse.Namespace, out: TextIO) -> int:
    _positive(args.pilot_steps, "--pilot-steps")
    if args.replan_every < 0:
        raise ValueError(f"--replan-every must be >= 0 (0: never), got {args.replan_every}")
    if args.replan_every and args.naive:
        raise ValueError("--replan-every regroups, which are simulated pipelined only: drop --naive")
    _positive(args.jobs, "--jobs")
    profile, trace, seed = _workload(args)
    _require_policies([args.policy])
    spec = pipeline_of(args, profile)
    if not spec.windowed:
        return _simulate_async(args, profile, trace, spec, out)
    manual = args.tp is not None or args.initial_split is not None
    if args.layout == "plan" and manual:
        raise ValueError("--layout plan chooses the engine size and the split itself; drop --tp and --initial-split")
    if args.layout is None:
        args.layout = "profile" if manual else "plan"
    options = _key_values(args.policy_option, "--policy-option")
    overrides = _key_values(args.guard, "--guard")
    # The baselines are the profile's (its best static configuration and its own engines' best
    # split), whatever layout the run itself starts from; without a layout, simulate() computes
    # them on the run's own model (sharing its caches).
    base = None
    layout, planned, origin = args.layout, "", profile
    if args.layout == "plan" or manual:
        base = baselines(StageModel(profile, trace, router=args.router))
    if args.layout == "plan":
        start, _ = plan_start(profile, trace, lambda: load_policy(args.policy, options),
                              guards_for(profile, overrides), router=args.router, pilot_steps=args.pilot_steps)
        profile, planned = profile.with_layout(start.tp, start.split), str(start)
    elif manual:
        initial = parse_split(args.initial_split) if args.initial_split is not None else None
        profile, layout = profile.with_layout(args.tp, initial), "manual"
    result = simulate(
        trace,
        profile,
        args.policy,
        base=base,
        policy_options=options,
        guard_overrides=overrides,
        naive=args.naive,
        seed=seed,
        model=StageModel(profile, trace, router=args.router),
        progress=ProgressBar(f"simulate {trace.name}/{args.policy}"),
        jobs=args.jobs,
        origin=origin,
        pilot_steps=args.pilot_steps,
        layout=Replanner(profile, trace, router=args.router, pilot_steps=args.pilot_steps, every=args.replan_every,
                         confirm=2) if args.replan_every else None,
    )
    report = msgspec.structs.replace(result.report, layout=layout, planned_start=planned)
    if args.plot:
        from dynaresized.sim.plot import plot_run

        plot_run(result, args.plot)
    if args.json:
        out.write(msgspec.json.encode(report).decode() + "\n")
    else:
        out.write(summary(report))
    return 0


def pipeline_of(args: argparse.Namespace, profile: Profile) -> PipelineSpec:
    """The profile's `[pipeline]` with the flags that name a part of it."""
    spec = profile.pipeline
    mode = args.pipeline or spec.mode
    fields = {"mode": mode}
    if mode != spec.mode:
        # another pipeline than the profile's: its own defaults, not the profile's settings
        spec = PipelineSpec(mode=mode, staleness=0.0 if mode == "synchronous" else 1.0)
    for flag, key in (("staleness", "staleness"), ("partial_rollout", "partial_rollout"), ("sync_every", "sync_every")):
        value = getattr(args, flag)
        if value is not None:
            fields[key] = value
    if mode == "one-step-off" and len(fields) > 1:
        raise ValueError("--staleness, --partial-rollout and --sync-every describe verl's fully-async pipeline: "
                         "add --pipeline fully-async")
    return msgspec.structs.replace(spec, **fields)


def _simulate_async(args: argparse.Namespace, profile: Profile, trace: Trace, spec: PipelineSpec,
                    out: TextIO) -> int:
    """`simulate` in a fully-async or synchronous pipeline (`sim/asyncrun.py`)."""
    if args.naive or args.replan_every or args.plot or args.router != "pull":
        raise ValueError(f"the {spec.mode} pipeline is simulated with pipelined costs, the pull router, no regroups "
                         "and no plot: drop --naive, --replan-every, --plot and --router")
    manual = args.tp is not None or args.initial_split is not None
    start = None
    if args.layout == "profile" or manual:
        tp = args.tp if args.tp is not None else profile.rollout.gpus_per_engine
        split = parse_split(args.initial_split) if args.initial_split is not None else profile.initial_split
        start = (split, tp)
    report = simulate_async(trace, profile, args.policy, spec,
                            policy_options=_key_values(args.policy_option, "--policy-option"),
                            loan_safety=guards_for(profile, _key_values(args.guard, "--guard")).loan_safety,
                            start=start, pilot_steps=args.pilot_steps)
    if args.json:
        out.write(msgspec.json.encode(report).decode() + "\n")
    else:
        out.write(async_summary(report))
    return 0


def _plan(args: argparse.Namespace, out: TextIO) -> int:
    _positive(args.pilot_steps, "--pilot-steps")
    profile, trace, _ = _workload(args)
    one_step_off_only(profile, "plan")
    _require_policies([args.policy])
    options = _key_values(args.policy_option, "--policy-option")
    guards = guards_for(profile, _key_values(args.guard, "--guard"))
    result = plan(profile, trace, router=args.router, pilot_steps=args.pilot_steps, method=args.method)
    start = start_plan(profile, trace, lambda: load_policy(args.policy, options), guards, router=args.router,
                       pilot_steps=args.pilot_steps, policy=args.policy)
    result = msgspec.structs.replace(result, start=start)
    if args.json:
        out.write(msgspec.json.encode(result).decode() + "\n")
    else:
        out.write(plan_summary(result))
    return 0


def plan_summary(p: Plan) -> str:
    lines = []
    if p.start is not None:
        st = p.start
        lines += [
            f"start of policy {st.policy} on {p.workload} ({p.profile}, {p.gpus} devices), from its first "
            f"{st.pilot_steps} steps:",
            f"  planned_start              {st.planned_start:>12}   where `simulate` starts the policy: of the "
            f"{len(st.candidates)} fastest static configurations, the one it runs fastest from",
            f"  predicted_dynamic_total_s  {st.predicted_dynamic_total_s:12.1f}   the policy from planned_start over "
            f"{st.steps} steps (its pilot's windows, extrapolated)",
            f"  best_static                {st.best_static:>12}   held still: best_static_predicted_total_s "
            f"{st.best_static_predicted_total_s:.1f} over {st.steps} steps",
            f"  {'candidates':<26} {'static_pilot_s':>14} {'dynamic_pilot_s':>16}",
        ]
        for c in st.candidates:
            mark = "   <- planned_start" if c.config == st.planned_start else ""
            lines.append(f"  {c.config:<26} {c.static_pilot_s:>14.1f} {c.dynamic_pilot_s:>16.1f}{mark}")
        lines.append("")
    lines += [
        f"static plan of {p.workload} on {p.profile} ({p.gpus} devices), each phase searched on its first "
        f"{p.pilot_steps} steps (the fastest configuration held still, no policy)",
        f"  {'steps':>9}  {'configuration':<16} {'predicted s':>12} {'simulated s':>12} {'error':>7}  search",
    ]
    for ph in p.phases:
        lines.append(f"  {ph.start:>4}-{ph.start + ph.steps - 1:<4}  {ph.config:<16} {ph.predicted_s:>12.1f} "
                     f"{ph.simulated_s:>12.1f} {ph.prediction_error:>+7.1%}  {ph.method}, "
                     f"{ph.simulated_configs} of {ph.space} simulated, {ph.search_s:.2f} s")
    lines.append(f"  {'total':<27} {p.predicted_total_s:>12.1f} {p.simulated_total_s:>12.1f} "
                 f"{p.prediction_error:>+7.1%}  {p.search_s:.2f} s")
    lines.append(f"  {p.changes} change(s) of configuration, charged {p.change_s:.1f} s in both totals "
                 "(a regroup where the engine size changes, a resize's commit where the split does)")
    return "\n".join(lines) + "\n"


def summary(r: SimReport) -> str:
    """The run in text, each figure labelled with its `--json` key (a total's row is named
    after its `..._total_time_s` key, or the struct that holds it, and its speedup's key is
    printed beside it)."""
    b = r.best_static
    t1 = r.best_static_tp1 or b
    rr = r.best_static_round_robin or b
    if r.layout == "plan":
        where = (f"planned_start (the plan search's pick from the first steps; "
                 f"profile_initial_split {r.profile_initial_split})")
    elif r.layout == "manual":
        where = f"--tp/--initial-split (profile_initial_split {r.profile_initial_split})"
    else:
        where = "the profile's engines and initial split"
    lines = [
        f"{r.workload} on {r.profile} ({r.gpus} devices, {r.steps} steps, {r.samples_per_step:g} samples/step), "
        f"policy {r.policy}, {r.cost_mode} resize costs",
        f"  start                    {r.start or r.initial_split:>12}     {where}",
        f"  total_time_s             {r.total_time_s:12.1f} s   mean_step_s {r.mean_step_s:.1f}",
        f"  resizes                  {r.resizes:12d}     initial_split {r.initial_split} -> final_split {r.final_split}"
        + (f"; regroups {r.regroups}" if r.regroups else ""),
        f"  loans                    {r.loans:12d}     devices_lent {r.devices_lent} device-steps, "
        f"loans_refused {r.loans_refused}",
        f"  {'compared with':<24} {'total s':>12}     {'configuration':<14} speedup (this run's)",
    ]

    def row(key: str, total: float, config: str, speedup: str, value: float, note: str = "") -> None:
        text = f"  {key:<24} {total:12.1f}     {config:<14} {speedup} {value:.3f}x"
        lines.append(text + (f"   ({note})" if note else ""))

    row("best_static", b.total_time_s, f"{b.train}:{b.rollout}/TP-{b.tp}", "speedup_vs_best_static",
        r.speedup_vs_best_static, "hindsight: split x engine size")
    row("best_static_tp1", t1.total_time_s, f"{t1.train}:{t1.rollout}/TP-{t1.tp}", "speedup_vs_best_static_tp1",
        r.speedup_vs_best_static_tp1, "hindsight, the profile's own engines")
    row("initial_split", r.initial_split_total_time_s, f"{r.initial_split}/TP-{r.tp}", "speedup_vs_initial_split",
        r.speedup_vs_initial_split, "standing still at this run's start")
    row("colocated", r.colocated_total_time_s, "all devices", "speedup_vs_colocated", r.speedup_vs_colocated)
    row("best_static_round_robin", rr.total_time_s, f"{rr.train}:{rr.rollout}/TP-{t1.tp}",
        "speedup_vs_best_static_round_robin", r.speedup_vs_best_static_round_robin,
        "verl's placement: chunks at submission")
    if r.verl_dynamic_own_start:
        row("verl_dynamic_same_start", r.verl_dynamic_same_start_total_time_s, r.start or r.initial_split,
            "speedup_vs_verl_dynamic_same_start", r.speedup_vs_verl_dynamic_same_start,
            "verl-default from this run's start")
        row("verl_dynamic_own_start", r.verl_dynamic_own_start_total_time_s, r.verl_dynamic_own_start,
            "speedup_vs_verl_dynamic_own_start", r.speedup_vs_verl_dynamic_own_start,
            "verl-default from its own planned start")
        row("verl_v1_switch", r.verl_v1_switch_total_time_s, r.start or r.initial_split, "speedup_vs_verl_v1_switch",
            r.speedup_vs_verl_v1_switch, "from this run's start")
    lines += [
        f"  {'best_split_per_step_tp1':<24} {r.best_split_per_step_tp1_total_time_s:12.1f}     {'':<14} "
        f"(the best TP-{t1.tp} split chosen afresh every step, free resizes, no loans: not a bound)",
        f"  {'lower_bound_s':<24} {r.lower_bound_s:12.1f}     {'':<14} gap_to_lower_bound {r.gap_to_lower_bound:.1%}"
        "   (moves at step boundaries only)",
        f"  {'fluid_bound_s':<24} {r.fluid_bound_s:12.1f}     {'':<14} gap_to_fluid_bound {r.gap_to_fluid_bound:.1%}"
        "   (any schedule, loans included)",
        f"  headroom_vs_best_static {r.headroom_vs_best_static:.3f}x with free resizes of TP-{t1.tp} engines "
        f"(best_static_tp1 / best_split_per_step_tp1), bound_vs_best_static {r.bound_vs_best_static:.3f}x "
        "for any step-boundary schedule",
    ]
    for e in r.resize_events:
        lines.append(f"  resize {e.resize_id} after step {e.step}: {e.before} -> {e.after} ({e.outcome}): {e.reason}")
    lines += why_held(r)
    if r.idle_ratio:
        lines.append("  idle_ratio (docs/idle.md) "
                     + ", ".join(f"{pool} {percent(v)}" for pool, v in r.idle_ratio.items()))
    if r.prediction_errors:
        lines.append("  prediction_errors        " + ", ".join(f"{e:+.0%}" for e in r.prediction_errors)
                     + " (measured vs predicted step time after each resize)")
    if r.loans_checked and r.prediction_mae_s.get("loan") is not None:
        lines.append(f"  loan predictions         {r.loans_checked} checked, mean abs error "
                     f"{r.prediction_mae_s['loan']:.1f}s (when the stage they serve finishes the step)")
    if r.verdicts:
        lines.append("  verdicts                 " + ", ".join(f"{k} {v}" for k, v in r.verdicts.items()))
    return "\n".join(lines) + "\n"


def why_held(r: SimReport) -> list[str]:
    """What held the run where it was: the policy's own reason for the steps it proposed
    nothing, and each core guard that refused a proposal or a loan, with its last reason (the
    threshold and what it measured)."""
    lines = []
    if r.resizes == 0:
        what = "no resize and no loan" if r.loans == 0 else "no resize"
        lines.append(f"  why it held: {what}; the policy's own reason and the guards that refused, below"
                     if r.policy_holds or r.rejections else f"  why it held: {what}, and no proposal was made")
    if r.policy_holds:
        lines.append(f"  policy_holds             {r.policy_holds:12d}     steps the policy proposed no resize; "
                     f"last_hold_reason: {r.last_hold_reason}")
    for guard, n in r.rejections.items():
        reason = r.rejection_reasons.get(guard, "")
        lines.append(f"  rejections[{guard}]{'':<{max(12 - len(guard), 0)}} {n:12d}     refused by the core's guard "
                     f"{guard}" + (f"; last: {reason}" if reason else ""))
    return lines


def one_step_off_only(profile: Profile, command: str) -> None:
    """`plan` and `bench` model the one-step-off pipeline: a profile of another says so."""
    if not profile.pipeline.windowed:
        raise ValueError(f"`{command}` models the one-step-off pipeline, and profile {profile.name} runs "
                         f"{profile.pipeline.label()}: `dynaresized simulate` runs it (its planned_start is the plan "
                         "search in that pipeline)")


def _bench(args: argparse.Namespace, out: TextIO) -> int:
    _positive(args.steps, "--steps")
    profile = load_profile(args.profile)
    one_step_off_only(profile, "bench")
    scenarios = [s for s in args.scenarios.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    for name in scenarios:
        if name not in SCENARIOS:
            raise UnknownScenarioError(f"unknown scenario {name!r}; built-in scenarios: {', '.join(SCENARIOS)}")
    _require_policies(policies)
    rows = bench(profile, scenarios=scenarios, policies=policies, seed=args.seed, steps=args.steps,
                 naive=args.naive, progress=ProgressBar(f"bench {profile.name}"))
    if args.json:
        for row in rows:
            out.write(msgspec.json.encode(row).decode() + "\n")
        return 0
    header = f"{'workload':<20} {'policy':<14} {'total_s':>11} {'resizes':>7} {'best':>9} {'vs best':>8} " \
             f"{'vs TP1':>7} {'vs init':>8} {'gap LB':>7} {'headroom':>8} {'loans':>6} {'vs RR':>6} {'gap FB':>7} " \
             f"{'vs verl':>7} {'verl own':>8} {'vs v1':>6}"
    out.write(header + "\n" + "-" * len(header) + "\n")
    for r in rows:
        b = r.best_static
        best = f"{b.train}:{b.rollout}/{b.tp}"
        out.write(f"{r.workload:<20} {r.policy:<14} {r.total_time_s:>11.0f} {r.resizes:>7d} {best:>9} "
                  f"{r.speedup_vs_best_static:>8.3f} {r.speedup_vs_best_static_tp1:>7.3f} "
                  f"{r.speedup_vs_initial_split:>8.3f} {r.gap_to_lower_bound:>7.1%} "
                  f"{r.headroom_vs_best_static:>8.3f} {r.loans:>6d} {r.speedup_vs_best_static_round_robin:>6.3f} "
                  f"{r.gap_to_fluid_bound:>7.1%} {r.speedup_vs_verl_dynamic_same_start:>7.3f} "
                  f"{r.speedup_vs_verl_dynamic_own_start:>8.3f} {r.speedup_vs_verl_v1_switch:>6.3f}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dynaresized.sim", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_parsers(sub)
    return run_cli(parser.parse_args(argv))
