"""Prometheus metrics of one run (`prometheus-client`), in a registry of its own.

`RunMetrics` is a `RunObserver`: counters and the recovery histogram follow the rows and
events the run monitor hands it; the gauges of state (job state, rank liveness, shadows, ETTR)
are read from the run's `RunStatus` at each scrape by a custom collector, so the two views never
disagree. Each run gets its own `CollectorRegistry` — never the process-wide default — so two
runs in one process (a job's reference and faulty runs) cannot collide; every series carries a
`run` label. The names are listed in docs/outputs.md ("Live metrics").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from unbroken.metrics.analysis import RecoveryBreakdown
from unbroken.metrics.observer import RunInfo, RunObserver
from unbroken.metrics.status import RunStatus

__all__ = ["JOB_STATES", "RECOVERY_BUCKETS_S", "RunMetrics"]

RECOVERY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Buckets of `unbroken_recovery_seconds`: in-place recovery takes ~0.1-5 s, a checkpoint
restart of a large model a minute or more (docs/architecture.md)."""

JOB_STATES = ("starting", "running", "stopping", "restarting", "done", "failed")
"""The recovery state machine's states (`unbroken.recovery.RecoveryState`)."""


class _StatusCollector(Collector):
    """The gauges of state, read from the run's status at scrape time."""

    def __init__(self, status: RunStatus) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self.status.snapshot()
        run = s["run"]
        state = GaugeMetricFamily(
            "unbroken_job_state",
            "The recovery state machine's state: 1 for the current one",
            labels=["run", "state"],
        )
        for name in JOB_STATES:
            state.add_metric([run, name], float(s["state"] == name))
        yield state
        yield _gauge("unbroken_generation", "Trainer generation running", run, s["generation"])
        yield _gauge("unbroken_restarts", "Recoveries started so far", run, s["restarts"])
        yield _gauge(
            "unbroken_shadows_ready",
            "Ranks whose shadow trainer for the next generation is ready",
            run,
            s["shadows_ready"],
        )
        up = GaugeMetricFamily(
            "unbroken_rank_up", "1 while the rank trains, else 0", labels=["run", "rank"]
        )
        level = GaugeMetricFamily(
            "unbroken_shadow_level",
            "Level (1-3) of the rank's ready shadow trainer; 0 if none is ready",
            labels=["run", "rank"],
        )
        for r in s["ranks"]:
            up.add_metric([run, str(r["rank"])], float(r["state"] == "up"))
            level.add_metric([run, str(r["rank"])], r["shadow_level"] if r["shadow_ready"] else 0)
        yield up
        yield level
        ettr = GaugeMetricFamily(
            "unbroken_ettr",
            "Effective training time ratio so far: T_ref/T_eval at the last completed iteration "
            "(basis=reference), or iterations x median iteration time / wall time "
            "(basis=estimate, without a reference run)",
            labels=["run", "basis"],
        )
        if s["ettr"] is not None:
            ettr.add_metric([run, s["ettr_basis"]], s["ettr"])
        yield ettr


def _gauge(name: str, doc: str, run: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["run"])
    g.add_metric([run], value)
    return g


class RunMetrics(RunObserver):
    """Args: status: the run's status (the source of the gauges of state); run: its name."""

    def __init__(self, status: RunStatus, run: str) -> None:
        self.run = run
        self.registry = CollectorRegistry()
        r, L = self.registry, ["run"]
        self.iterations = Counter(
            "unbroken_iterations",
            "Iteration attempts completed (a recomputed iteration counts again)",
            L,
            registry=r,
        )
        self.completed = Gauge("unbroken_iteration", "Iterations completed", L, registry=r)
        self.target = Gauge("unbroken_iterations_target", "Iterations to run", L, registry=r)
        self.tokens = Counter("unbroken_tokens", "Tokens trained on", L, registry=r)
        self.tokens_per_s = Gauge(
            "unbroken_tokens_per_second", "Throughput of the last iteration", L, registry=r
        )
        self.loss = Gauge("unbroken_loss", "Loss of the last iteration", L, registry=r)
        self.iter_s = Gauge(
            "unbroken_iteration_seconds", "Wall time of the last iteration", L, registry=r
        )
        self.injected = Counter(
            "unbroken_faults_injected", "Faults injected", [*L, "fault"], registry=r
        )
        self.failures = Counter(
            "unbroken_failures_detected",
            "Failures detected, by how (exit, hang, node_lost) and the injected fault behind "
            'them ("none" for a real failure)',
            [*L, "cause", "fault"],
            registry=r,
        )
        self.recoveries = Counter(
            "unbroken_recoveries",
            "Failures recovered, by recovery mode, fault class (hof: the process failed, the "
            'hardware did not) and injected fault ("none" for a real failure)',
            [*L, "mode", "fault_class", "fault"],
            registry=r,
        )
        self.recovery_s = Histogram(
            "unbroken_recovery_seconds",
            "Failure to training caught up again (initialization + recomputation)",
            [*L, "mode", "fault_class"],
            buckets=RECOVERY_BUCKETS_S,
            registry=r,
        )
        self.fail_slow = Counter(
            "unbroken_fail_slow_reports",
            "Fail-slow reports of the workload-aware detector, by what is slow (compute, comm)",
            [*L, "what"],
            registry=r,
        )
        self.replans = Counter(
            "unbroken_replans",
            "Live re-plans the coordinator executed (a `replan` event: a lost device planned around "
            "or a slow one given fewer micro-batches; jobs with adapt.enabled)",
            L,
            registry=r,
        )
        self.checkpoints = Counter("unbroken_checkpoints", "Checkpoints saved", L, registry=r)
        for metric in (self.iterations, self.tokens, self.replans, self.checkpoints):
            metric.labels(run=run)  # present (at 0) from the start
        r.register(_StatusCollector(status))

    def started(self, info: RunInfo) -> None:
        self.target.labels(run=self.run).set(info.iterations)

    def iteration(self, row: dict[str, Any]) -> None:
        run = self.run
        self.iterations.labels(run=run).inc()
        self.completed.labels(run=run).set(row["iter"] + 1)
        self.tokens.labels(run=run).inc(row.get("tokens") or 0)
        self.tokens_per_s.labels(run=run).set(row.get("tokens_per_s") or 0.0)
        self.loss.labels(run=run).set(row["loss"])
        self.iter_s.labels(run=run).set(row["iter_s"])

    def event(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if kind == "failure_injected":
            self.injected.labels(run=self.run, fault=event.get("fault") or "unknown").inc()
        elif kind == "failure_detected":
            fault = (event.get("injected") or "none").split(":", 1)[0]
            cause = event.get("cause") or "unknown"
            self.failures.labels(run=self.run, cause=cause, fault=fault).inc()
        elif kind == "node_lost":
            self.failures.labels(run=self.run, cause="node_lost", fault="none").inc()
        elif kind == "fail_slow":
            self.fail_slow.labels(run=self.run, what=event.get("what") or "compute").inc()
        elif kind == "checkpoint_saved":
            self.checkpoints.labels(run=self.run).inc()
        elif kind == "replan":
            self.replans.labels(run=self.run).inc()

    def recovered(self, breakdown: RecoveryBreakdown) -> None:
        b = breakdown
        self.recoveries.labels(
            run=self.run, mode=b.mode, fault_class=b.kind, fault=b.fault or "none"
        ).inc()
        self.recovery_s.labels(run=self.run, mode=b.mode, fault_class=b.kind).observe(b.total_s)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
