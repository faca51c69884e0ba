"""The coordinator's run monitor: watches a run through what its processes write — the metrics
rank 0 appends per iteration, every rank's timings, the event log — and turns it into progress
lines, fail-slow reports (`SlowWatch`) and, once a failure is recovered, its breakdown
(`recovery_done`). It passes what it reads on to the run's live observers
(`unbroken.metrics.observer.RunObserver`: the Prometheus exporter, the status page, a Python
caller's own).

An observer only: it reads the logs incrementally (`JsonlTail`) and never takes a control
decision from them; the core tells it of each failure it detected (`failure_detected`).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unbroken.config import JobConfig
from unbroken.launch.progress import Progress
from unbroken.launch.slowwatch import SlowWatch
from unbroken.metrics.analysis import analyze_run
from unbroken.metrics.log import JsonlLog, JsonlTail
from unbroken.metrics.observer import RunInfo, RunObserver
from unbroken.parallel import ParallelPlan

__all__ = ["RunMonitor", "describe_plan", "run_info"]


def describe_plan(plan: ParallelPlan | None, world_size: int) -> str:
    """The plan a run's observers show: one line per stage group, or data parallelism."""
    if plan is None:
        return f"data parallel: {world_size} replicas"
    lines = [f"{plan.schedule}: dp={plan.dp} pp={plan.pp} v={plan.virtual_stages}"]
    for d, replica in enumerate(plan.replicas):
        for s, stage in enumerate(replica.stages):
            lines.append(
                f"replica {d} stage {s}: ranks {list(stage.ranks)} "
                f"layers [{stage.layers[0]}, {stage.layers[1]})"
            )
    return "\n".join(lines)


def run_info(
    cfg: JobConfig, run_name: str, plan: ParallelPlan | None, world: int | None = None
) -> RunInfo:
    """What the run's live observers are told when it starts (`world`: its ranks, when not
    the config's — a replaying reference's)."""
    world = world or cfg.parallel.world_size
    return RunInfo(
        run=run_name,
        world_size=world,
        iterations=cfg.train.iterations,
        recovery_mode=cfg.recovery.mode,
        shadow_level=cfg.recovery.shadow_level if cfg.recovery.mode == "inplace" else 0,
        plan=describe_plan(plan, world),
        placement={r: plan.locate(r) for r in plan.ranks} if plan else {},
    )


ANALYSIS_WINDOW_S = 120.0
"""How far before a pending failure the monitor's analysis looks, at least: the failure's
injection, the iteration before it and its detection (a hang's timeout, a node's beats) lie
well inside (`analysis_window_s` widens it for longer timeouts). The analysis walks every row
and event of the window on each poll while a failure is pending: with 600 s the coordinator's
longest poll grew to ~50 ms on the 2-core VM as the window filled (a 15-minute soak)."""


def analysis_window_s(heartbeat_timeout_s: float, node_timeout_s: float) -> float:
    """The window for a run whose failures are detected within these timeouts: ten times the
    slower detection, and never less than `ANALYSIS_WINDOW_S`."""
    return max(ANALYSIS_WINDOW_S, 10 * max(heartbeat_timeout_s, node_timeout_s))


class RunMonitor:
    """Args: run_dir, run_name, world_size, iterations, events (the run's event log), plan
    (the plan the job runs, if any), quiet (no terminal output), info and observers (the run
    as its live observers see it, and those observers), window_s (how far before a pending
    failure its analysis looks, `analysis_window_s`)."""

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        world_size: int,
        iterations: int,
        events: JsonlLog,
        *,
        plan: ParallelPlan | None = None,
        quiet: bool = False,
        info: RunInfo | None = None,
        observers: Sequence[RunObserver] = (),
        window_s: float = ANALYSIS_WINDOW_S,
    ) -> None:
        self.run_name = run_name
        self.window_s = window_s
        """How far before a pending failure its analysis looks (`analysis_window_s`)."""
        self.observers = list(observers)
        self.info = info or RunInfo(
            run=run_name,
            world_size=world_size,
            iterations=iterations,
            recovery_mode="",
            shadow_level=0,
            plan=describe_plan(plan, world_size),
        )
        self.progress = Progress(run_name, iterations, quiet=quiet)
        self.slow_watch = SlowWatch(world_size, events, self.progress.say, plan=plan)
        self.events = events
        self.rows: list[dict[str, Any]] = []
        """This run's metrics rows, in order."""
        self.seen_events: list[dict[str, Any]] = []
        """This run's events so far."""
        self._row_t: list[float] = []
        """`t_end` of each row (rank 0 appends them in time order): the window by bisection."""
        self._event_t: list[float] = []
        """The running maximum of the events' `t` (events of several processes interleave):
        a sorted key for bisection that never cuts an event inside the window."""
        self._healthy: list[float] = []
        """Sorted `iter_s` of the rows without a checkpoint: the run's healthy iteration time
        (`healthy_iter_s`) as a median kept up to date, not recomputed over the run."""
        self._metrics = JsonlTail(run_dir / "metrics.jsonl")
        self._timings = JsonlTail(run_dir / "timings.jsonl")
        self._events = JsonlTail(run_dir / "events.jsonl")
        self._pending: list[float] = []
        """Times of detected failures not yet recovered."""

    def say(self, text: str) -> None:
        self.progress.say(text)

    def start(self) -> None:
        """The run starts: tell its observers what it is."""
        for o in self.observers:
            o.started(self.info)

    def failure_detected(self, t: float) -> None:
        """The core detected a failure at `t`: report its breakdown once it is recovered."""
        self._pending.append(t)

    def poll(self) -> None:
        """Read what the run's processes appended since the last poll."""
        self._read_events()
        for t in self._timings.read_new():
            if t.get("run") == self.run_name:
                self.slow_watch.add_timing(t)
                for o in self.observers:
                    o.timing(t)
        resumed = False
        for m in self._metrics.read_new():
            if m.get("run") != self.run_name:
                continue
            self._add_row(m)
            for o in self.observers:
                o.iteration(m)
            self.progress.iteration(m)
            self.slow_watch.add_metric(m)
            resumed = resumed or bool(self._pending and m["t_start"] > self._pending[0])
        if resumed:  # once per poll, however many rows it read
            self._read_events()  # the recovery's own events precede its first iteration
            self._report_recovered()
        self.slow_watch.pump()

    def _add_row(self, m: dict[str, Any]) -> None:
        self.rows.append(m)
        t = m.get("t_end", m.get("t_start", 0.0))
        self._row_t.append(max(t, self._row_t[-1]) if self._row_t else t)
        if not m.get("ckpt_s"):
            bisect.insort(self._healthy, m["iter_s"])

    def _healthy_s(self) -> float:
        """`healthy_iter_s(self.rows)`, from the sorted times (the same median)."""
        h, n = self._healthy, len(self._healthy)
        if not n:
            return 0.0
        return h[n // 2] if n % 2 else (h[n // 2 - 1] + h[n // 2]) / 2

    def _read_events(self) -> None:
        new = [e for e in self._events.read_new() if e.get("run") == self.run_name]
        self.seen_events += new
        last = self._event_t[-1] if self._event_t else float("-inf")
        for e in new:
            last = max(last, e.get("t", 0.0))
            self._event_t.append(last)
        for e in new:
            for o in self.observers:
                o.event(e)

    def _report_recovered(self) -> None:
        """Log the breakdown of every pending failure the rows show recovered.

        Only the run's rows and events from `window_s` before the oldest pending
        failure are analyzed (with the healthy iteration time of the whole run): analyzing the
        whole history at every row while a failure is pending grew with the run — 0.37 s per
        row after an hour of the soak, on an idle core — and stalled the coordinator's loop
        for long enough during a checkpoint recompute that it declared its own node lost.

        A pending failure the analysis does not find recovered once a later one is (its
        recovery left no row to read) is logged `recovery_unanalyzed` and dropped: left
        pending, it held back every later report and kept the window open behind it, so the
        analysis grew with the run again (a 15-minute soak's longest poll rose to 0.45 s)."""
        since = self._pending[0] - self.window_s
        rows = [
            m
            for m in self.rows[bisect.bisect_left(self._row_t, since) :]
            if m.get("t_end", 0.0) >= since
        ]
        events = [
            e
            for e in self.seen_events[bisect.bisect_left(self._event_t, since) :]
            if e.get("t", 0.0) >= since
        ]
        found = analyze_run(rows, events, healthy_s=self._healthy_s())
        done = {r.detected_t: r for r in found}
        newest = max((t for t in self._pending if t in done), default=None)
        while self._pending and newest is not None and self._pending[0] <= newest:
            t = self._pending.pop(0)
            if t not in done:
                # A later failure was recovered, so this one's recovery lies behind: what the
                # analysis cannot read now it never will. Said once, and it no longer holds
                # the later ones back nor keeps the analysis window open behind it.
                self.events.emit(
                    "recovery_unanalyzed",
                    detected_t=t,
                    reason="no recovery of it found in the run's rows and events",
                )
                continue
            r = done[t]
            self.events.emit(
                "recovery_done",
                mode=r.mode,
                rank=r.rank,
                fault=r.fault,
                injected=r.injected,
                detect_s=r.detect_s,
                init_s=r.init_s,
                recompute_s=r.recompute_s,
                total_s=r.total_s,
                resumed_iter=r.iteration,
                restored_iter=r.restored_iter,
            )
            for o in self.observers:
                o.recovered(r)
            self.say(
                f"recovered ({r.mode}) at iteration {r.restored_iter}: "
                f"detect {r.detect_s:.3f}s, init {r.init_s:.2f}s, "
                f"recompute {r.recompute_s:.2f}s, total {r.total_s:.2f}s"
            )

    def finish(self, state: str = "", reason: str = "") -> None:
        """Read what was appended after the last poll (a failed run's last rows); tell the
        observers the run ended in `state` for `reason`."""
        self._read_events()
        rows = [m for m in self._metrics.read_new() if m.get("run") == self.run_name]
        for m in rows:
            self._add_row(m)
        for o in self.observers:
            for m in rows:
                o.iteration(m)
            o.finished(state, reason)
