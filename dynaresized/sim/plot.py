"""A PNG of one simulated run: devices per pool over time, per-step stage times, resizes.

matplotlib is the optional extra `plot` (`pip install 'dynaresized[plot]'`); it is imported
only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

from dynaresized.sim.run import SimRun


class PlotUnavailable(RuntimeError):
    pass


def plot_run(result: SimRun, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: install the plot extra (pip install 'dynaresized[plot]')"
        ) from None
    report = result.report
    windows = result.run.windows
    hours = [w.start_s / 3600.0 for w in windows] + [windows[-1].end_s / 3600.0]
    fig, (pools, stages) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, constrained_layout=True)
    fig.suptitle(f"{report.workload} on {report.profile}: policy {report.policy} "
                 f"({report.total_time_s / 3600:.1f} h, best static {report.best_static.total_time_s / 3600:.1f} h, "
                 f"lower bound {report.lower_bound_s / 3600:.1f} h)")
    train = [w.train_devices for w in windows]
    rollout = [w.rollout_devices for w in windows]
    moving = [w.moving for w in windows]
    pools.stackplot(hours[:-1], train, rollout, moving, step="post", labels=["training", "rollout", "moving"],
                    colors=["#4c72b0", "#dd8452", "#c0c0c0"])
    pools.set_ylabel("devices")
    pools.set_ylim(0, report.gpus)
    pools.legend(loc="upper right")
    mid = [(w.start_s + w.end_s) / 7200.0 for w in windows]
    stages.plot(mid, [w.rollout_s if w.rollout_s > 0 else float("nan") for w in windows], label="rollout (s)")
    stages.plot(mid, [w.train_s if w.train_s > 0 else float("nan") for w in windows], label="training (s)")
    stages.set_ylabel("stage time per step (s)")
    stages.set_xlabel("virtual time (hours)")
    for event in report.resize_events:
        for ax in (pools, stages):
            ax.axvline(event.started_at_s / 3600.0, color="black", linestyle=":", linewidth=1)
        pools.annotate(f"{event.before}->{event.after}", (event.started_at_s / 3600.0, report.gpus),
                       xytext=(2, -12), textcoords="offset points", fontsize=8)
    stages.legend(loc="upper right")
    fig.savefig(path, dpi=110)
    plt.close(fig)
