"""Prometheus metrics of the daemon, on their own registry (tests start many daemons)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dynaresized import wire
from dynaresized.core import facts as f
from dynaresized.core.state import ClusterState
from dynaresized.domain import Pool, WorkerStatus


# Facts that only report a job's progress: they change no pool, placement or worker status.
_TELEMETRY = frozenset({f.ProgressObserved, f.MiniBatchObserved, f.EngineQueueEmptyObserved})


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.state: ClusterState | None = None  # the latest state; its gauges are counted when scraped
        r.register(_ClusterGauges(self))
        self.resizes = Counter("dynaresized_resizes_total", "Resizes by outcome", ["outcome"], registry=r)
        self.op_seconds = Histogram("dynaresized_op_seconds", "Duration of resize operations", ["op"],
                                    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300), registry=r)
        self.rejections = Counter("dynaresized_guard_rejections_total", "Proposals rejected, by guard",
                                  ["guard"], registry=r)
        self.heartbeats = Counter("dynaresized_heartbeats_total", "Heartbeats received", registry=r)
        self.messages = Counter("dynaresized_messages_total", "Valid messages received, by type", ["type"],
                                registry=r)
        self.decode_errors = Counter("dynaresized_decode_errors_total", "Refused frames, by kind", ["kind"],
                                     registry=r)
        self.refusals = Counter("dynaresized_refusals_total", "Messages the core refused, by reason", ["reason"],
                                registry=r)
        self.stage_seconds = Gauge("dynaresized_stage_seconds", "Last observed stage time", ["stage"], registry=r)
        self.facts = Counter("dynaresized_facts_total", "Facts appended to the log", registry=r)
        # Idle accounting (docs/idle.md). A ratio with no figure behind it is NaN, never 0.
        self.pool_idle_ratio = Gauge("dynaresized_pool_idle_ratio",
                                     "Idle share of the last step's period, per pool (NaN: unknown)", ["pool"],
                                     registry=r)
        self.pool_busy_seconds = Gauge("dynaresized_pool_busy_device_seconds",
                                       "Busy device-seconds accounted per pool since the log began", ["pool"],
                                       registry=r)
        self.pool_idle_seconds = Gauge("dynaresized_pool_idle_device_seconds",
                                       "Idle device-seconds accounted per pool since the log began", ["pool"],
                                       registry=r)
        self.pool_unknown_steps = Gauge("dynaresized_pool_idle_unknown_steps",
                                        "Steps with no idle figure for the pool (a stage not measured)", ["pool"],
                                        registry=r)
        self.device_idle_ratio = Gauge("dynaresized_device_idle_ratio",
                                       "Idle share of each device's accounted time since the log began (NaN: unknown)",
                                       ["device"], registry=r)
        # Owning misses: predicted against measured step time after each resize.
        self.prediction_error = Gauge("dynaresized_prediction_error_ratio",
                                      "(measured - predicted) / predicted step time after the last resize",
                                      registry=r)
        self.prediction_error_seconds = Histogram(
            "dynaresized_prediction_error_seconds", "Measured minus predicted step time after resizes (absolute)",
            buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600), registry=r)
        self.loan_prediction_error_seconds = Histogram(
            "dynaresized_loan_prediction_error_seconds",
            "Measured minus predicted seconds from a loan's start until its stage finished the step (absolute)",
            buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800, 3600), registry=r)
        self.verdicts = Counter("dynaresized_resize_verdicts_total", "Committed resizes judged over their payback window",
                                ["verdict"], registry=r)
        self.payback_factor = Gauge("dynaresized_payback_factor",
                                    "Learned multiplier on the required payback (1: nothing learned)", registry=r)
        self.security_refusals = Counter(
            "dynaresized_security_refusals_total",
            "Refused handshakes, connections without a live worker, control requests without the secret, by kind",
            ["kind"], registry=r)
        self.connections_cut = Counter(
            "dynaresized_connections_cut_total",
            "Connections to the worker endpoint cut for sending more refused frames than daemon.junk_budget, "
            "by the kind of the last one", ["reason"], registry=r)
        self.disk_full = Gauge("dynaresized_disk_full",
                               "1 while the event log cannot be written (a full disk): no transition starts", registry=r)
        self.worker_connections = Gauge("dynaresized_worker_connections",
                                        "Open connections to the worker endpoint", registry=r)

        self._message_counts: dict[type, int] = {}

    def message(self, kind: type) -> None:
        """Count one valid message of this wire type; `flush_messages` passes the counts to
        Prometheus once per batch (each Prometheus increment takes a lock), heartbeats to their
        own counter too."""
        self._message_counts[kind] = self._message_counts.get(kind, 0) + 1

    def flush_messages(self) -> None:
        for kind, count in self._message_counts.items():
            self.messages.labels(kind.__struct_config__.tag).inc(count)
            if kind is wire.Heartbeat:
                self.heartbeats.inc(count)
        self._message_counts.clear()

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def observe(self, state: ClusterState, facts: list[f.Fact]) -> None:
        self.facts.inc(len(facts))
        self.state = state
        for fact in facts:
            if type(fact) in _TELEMETRY:
                continue  # the bulk of the facts under load; nothing to count beyond the total
            if isinstance(fact, f.ResizeCommitted):
                self.resizes.labels("committed").inc()
            elif isinstance(fact, f.ResizeRolledBack):
                self.resizes.labels("rolled_back").inc()
            elif isinstance(fact, f.Degraded):
                self.resizes.labels("degraded").inc()
            elif isinstance(fact, f.ProposalRejected):
                self.rejections.labels(fact.guard).inc()
            elif isinstance(fact, f.OpCompleted):
                self.op_seconds.labels(fact.op_id.rsplit("-", 1)[-1]).observe(fact.duration_s)
            elif isinstance(fact, f.StepObserved):
                self.stage_seconds.labels("rollout").set(fact.timing.rollout_s)
                self.stage_seconds.labels("train").set(fact.timing.train_s)
                self.stage_seconds.labels("weight_sync").set(fact.timing.weight_sync_s)
                self.observe_idle(state)
            elif isinstance(fact, f.PredictionChecked):
                self.prediction_error.set(fact.error_s / fact.predicted_step_s_after)
                self.prediction_error_seconds.observe(abs(fact.error_s))
            elif isinstance(fact, f.LoanChecked):
                self.loan_prediction_error_seconds.observe(abs(fact.error_s))
            elif isinstance(fact, f.ResizeJudged):
                self.verdicts.labels(fact.verdict.value).inc()
                self.payback_factor.set(fact.payback_factor)

    def observe_idle(self, state: ClusterState) -> None:
        ledger, last = state.idle, state.idle.last
        for pool in Pool:
            share = last.pool(pool) if last is not None else None
            self.pool_idle_ratio.labels(pool.value).set(share.ratio if share is not None else math.nan)
            totals = ledger.pool(pool)
            self.pool_busy_seconds.labels(pool.value).set(totals.busy_s)
            self.pool_idle_seconds.labels(pool.value).set(totals.idle_s)
            self.pool_unknown_steps.labels(pool.value).set(totals.unknown_steps)
        for device, totals in ledger.devices.items():
            ratio = totals.ratio
            self.device_idle_ratio.labels(device).set(ratio if ratio is not None else math.nan)


class _ClusterGauges(Collector):
    """Pools, moving devices, wide engines, regroups and workers by status, counted from the
    daemon's latest state when Prometheus scrapes: a pass over every device and worker once per
    scrape, not after every batch of facts (at 1,024 devices a resize's answers come in
    hundreds of batches). The state is immutable; the reactor only swaps the reference."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # no fixed set of samples to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self.metrics.state
        if state is None:
            return
        pools = GaugeMetricFamily("dynaresized_pool_devices", "Devices per pool", labels=["pool"])
        split = state.split
        pools.add_metric([Pool.TRAINING.value], split.train)
        pools.add_metric([Pool.ROLLOUT.value], split.rollout)
        yield pools
        yield GaugeMetricFamily("dynaresized_moving_devices", "Devices moving between pools",
                                value=sum(1 for p in state.devices.values() if p.is_moving))
        yield GaugeMetricFamily("dynaresized_wide_engines", "Rollout engines of several devices (regroups)",
                                value=len(state.wide_engines()))
        regroups = GaugeMetricFamily("dynaresized_regroups", "Regroups since the log began, started and committed",
                                     labels=["state"])
        regroups.add_metric(["started"], state.regroups_started)
        regroups.add_metric(["committed"], state.regroups_committed)
        yield regroups
        counts: dict[tuple[str, str], int] = {}
        for w in state.workers.values():
            counts[(w.kind.value, w.status.value)] = counts.get((w.kind.value, w.status.value), 0) + 1
        workers = GaugeMetricFamily("dynaresized_workers", "Workers by kind and status", labels=["kind", "status"])
        for kind in ("rollout-engine", "trainer-rank"):
            for status in WorkerStatus:
                workers.add_metric([kind, status.value], counts.get((kind, status.value), 0))
        yield workers
