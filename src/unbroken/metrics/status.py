"""The live status of one run, as the status page and the Prometheus gauges show it: the job's
state, each rank's liveness and shadow, the plan, recent events, the loss and throughput
series, failures and recoveries, and ETTR so far.

`RunStatus` is a `RunObserver` fed by the coordinator's run monitor (main thread) and read by
the metrics server's threads (`snapshot`), so every read and write holds its lock. It
interprets events the way docs/outputs.md defines them and nothing else: no sockets, no
Prometheus.

Rank liveness follows the recovery state machine's `state` events and the ranks' own
timings: a rank is `starting` until its first timing row of the running generation, then `up`;
a detected failure marks it `failed`, its peers `stopping` then `restarting`; `done` at the end.
A rank's shadow is the one prepared for the next generation: `shadows_spawned` (pending, at its
level), `shadow_ready` (ready), `shadows_promoted` (consumed), `shadows_reclaimed` (killed,
relaunched lower).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.metrics.analysis import RecoveryBreakdown, ettr
from unbroken.metrics.observer import RunInfo, RunObserver

__all__ = ["RankView", "RunStatus", "describe_event", "ettr_so_far"]

MAX_EVENTS = 200
"""Recent events the status keeps."""
MAX_POINTS = 4000
"""Iteration rows kept for the chart (the oldest are dropped past this)."""


def ettr_so_far(
    rows: list[dict[str, Any]], reference: list[dict[str, Any]] | None
) -> tuple[float | None, str]:
    """ETTR at the last completed iteration, and its basis.

    With the fault-free reference's rows: T_ref(i)/T_eval(i) as in summary.json ("reference").
    Without: the iterations completed times the run's own median iteration time (checkpoint
    iterations left out), over the wall time since the first iteration started ("estimate").
    """
    if not rows:
        return None, "none"
    if reference:
        return ettr(reference, rows), "reference"
    done = {m["iter"]: m for m in rows}
    healthy = [m["iter_s"] for m in rows if not m.get("ckpt_s")] or [m["iter_s"] for m in rows]
    wall = done[max(done)]["t_end"] - min(m["t_start"] for m in rows)
    if wall <= 0:
        return None, "estimate"
    return min(1.0, len(done) * statistics.median(healthy) / wall), "estimate"


def _finite(x: Any) -> Any:
    """JSON has no NaN: a diverged loss is shown as a gap."""
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _rank_of(e: dict[str, Any]) -> str:
    return f"rank {e['rank']}" if e.get("rank") is not None else "the sync stage"


_TEXT: dict[str, Any] = {
    "state": lambda e: f"state {e['old']} → {e['new']}: {e.get('reason', '')}",
    "failure_injected": lambda e: (
        f"injected {e.get('fault')} on rank {e.get('rank')} at iteration {e.get('iter')} "
        f"({e.get('phase')})"
    ),
    "failure_detected": lambda e: (
        f"failure detected: rank {e.get('rank')} {e.get('reason', '')}"
        + (f" ({e['detect_s'] * 1000:.0f} ms after injection)" if e.get("detect_s") else "")
    ),
    "node_lost": lambda e: f"node {e.get('node')} lost: {e.get('reason', '')}",
    "recovery_start": lambda e: f"recovery ({e['mode']}): generation {e['generation']}",
    "recovery_done": lambda e: (
        f"recovered ({e['mode']}) rank {e['rank']} at iteration {e.get('restored_iter')}: "
        f"total {e['total_s']:.2f}s (detect {e['detect_s']:.3f}s, init {e['init_s']:.2f}s, "
        f"recompute {e['recompute_s']:.2f}s)"
    ),
    "trainer_ready": lambda e: (
        f"generation {e['generation']} ready at iteration {e.get('restored_iter')} "
        f"({e.get('recovery', 'fresh')})"
    ),
    "shadows_promoted": lambda e: (
        f"shadows promoted into generation {e['generation']} (L{e.get('level')}, "
        f"{e.get('ready')} ready)"
    ),
    "shadows_reclaimed": lambda e: (
        f"memory: reclaimed {e.get('shadows')} shadow(s), L{e.get('level_from')} → "
        f"L{e.get('level_to')}"
    ),
    "fail_slow": lambda e: (
        f"fail-slow: {_rank_of(e)} ({e.get('what', 'compute')}) {e.get('factor', 0):.2f}x "
        f"slower since iteration {e.get('since_iter')}"
    ),
    "replan": lambda e: (
        f"re-plan ({(e.get('trigger') or {}).get('kind', '?')}): micro-batches per rank "
        f"{e.get('counts_before')} → {e.get('counts_after')} on devices {e.get('devices_after')}"
    ),
    "plan_applied": lambda e: (
        f"plan {e.get('epoch')} applied from iteration {e.get('iter')}: {e.get('counts')}"
    ),
    "inplace_fallback": lambda e: f"in-place fallback to checkpoint: {e.get('reason', '')}",
    "checkpoint_loaded": lambda e: f"checkpoint of iteration {e.get('iter')} loaded",
    "job_end": lambda e: f"job {e['state']}: {e.get('reason', '')}",
}
_LEVEL = {
    "failure_injected": "fault",
    "failure_detected": "fault",
    "node_lost": "fault",
    "fail_slow": "fault",
    "inplace_fallback": "fault",
    "recovery_done": "ok",
    "trainer_ready": "ok",
}


def describe_event(e: dict[str, Any]) -> str | None:
    """One line for a notable event (None for the others: checkpoints, timings, repairs)."""
    fmt = _TEXT.get(e.get("kind", ""))
    if fmt is None:
        return None
    try:
        return fmt(e)
    except (KeyError, TypeError, ValueError):
        return str(e.get("kind"))


@dataclass(slots=True)
class RankView:
    """One rank as the status page shows it."""

    rank: int
    state: str = "starting"
    """starting, up, failed, stopping, restarting, done, stopped, lost."""
    generation: int = 0
    iteration: int = -1
    """The last iteration its timings reported."""
    seen_t: float | None = None
    """When its last timing row arrived (unix seconds)."""
    shadow_generation: int | None = None
    """The generation its shadow is prepared for (None: no shadow)."""
    shadow_level: int = 0
    shadow_ready: bool = False
    slow_factor: float | None = None
    """Set when the fail-slow watch reported this rank slow."""


class RunStatus(RunObserver):
    """Args: reference_rows: the fault-free reference run's metrics rows, if it ran first
    (ETTR then follows summary.json's definition)."""

    def __init__(self, reference_rows: list[dict[str, Any]] | None = None) -> None:
        self._lock = threading.Lock()
        self.reference_rows = reference_rows
        self.info: RunInfo | None = None
        self.state, self.reason = "starting", ""
        self.generation = self.restarts = 0
        self.t_started = time.time()
        self.t_finished: float | None = None
        self.ranks: dict[int, RankView] = {}
        self.rows: deque[dict[str, Any]] = deque(maxlen=MAX_POINTS)
        self.all_rows: list[dict[str, Any]] = []
        """Every row's timing fields (iter, t_start, t_end, iter_s, ckpt_s) for ETTR."""
        self.events: deque[dict[str, Any]] = deque(maxlen=MAX_EVENTS)
        self.failures: list[dict[str, Any]] = []
        self.recoveries: list[dict[str, Any]] = []
        self.fail_slow: list[dict[str, Any]] = []
        self.checkpoints = 0

    # -- RunObserver ----------------------------------------------------------------------
    def started(self, info: RunInfo) -> None:
        with self._lock:
            self.info = info
            self.t_started = time.time()
            self.ranks = {r: RankView(r) for r in range(info.world_size)}

    def iteration(self, row: dict[str, Any]) -> None:
        keep = ("iter", "generation", "t_start", "t_end", "iter_s", "loss", "tokens_per_s")
        with self._lock:
            self.rows.append({k: _finite(row.get(k)) for k in keep})
            self.all_rows.append({k: row.get(k) for k in ("iter", "t_start", "t_end", "iter_s")})
            self.all_rows[-1]["ckpt_s"] = row.get("ckpt_s") or 0.0

    def timing(self, row: dict[str, Any]) -> None:
        with self._lock:
            view = self.ranks.get(row.get("rank", -1))
            if view is None or row.get("generation", self.generation) != self.generation:
                return
            view.iteration, view.seen_t, view.generation = row["iter"], time.time(), self.generation
            if self.state in ("running", "restarting") and view.state in ("starting", "failed"):
                view.state = "up"

    def event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._apply(event)
            text = describe_event(event)
            if text is not None:
                level = _LEVEL.get(event["kind"], "info")
                self.events.append(
                    {"t": event.get("t"), "kind": event["kind"], "text": text, "level": level}
                )

    def recovered(self, breakdown: RecoveryBreakdown) -> None:
        with self._lock:
            self.recoveries.append(asdict(breakdown))

    def finished(self, state: str, reason: str) -> None:
        with self._lock:
            self.state, self.reason, self.t_finished = state or self.state, reason, time.time()
            for view in self.ranks.values():
                view.state = "done" if state == "done" else "stopped"

    # -- events -----------------------------------------------------------------------------
    def _apply(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        if kind == "state":
            self._state(e)
        elif kind == "failure_detected":
            self.failures.append(
                {k: e.get(k) for k in ("t", "rank", "iter", "phase", "reason", "injected")}
            )
            if e.get("rank") in self.ranks:
                self.ranks[e["rank"]].state = "failed"
        elif kind == "node_lost":
            for view in self.ranks.values():
                view.state = "lost"
        elif kind in ("shadows_spawned", "shadow_ready", "shadows_promoted", "shadows_reclaimed"):
            self._shadow(e)
        elif kind == "fail_slow":
            self.fail_slow.append(
                {k: e.get(k) for k in ("t", "rank", "what", "factor", "since_iter", "detected_at")}
            )
            if e.get("rank") in self.ranks:
                self.ranks[e["rank"]].slow_factor = e.get("factor")
        elif kind == "checkpoint_saved":
            self.checkpoints += 1

    def _state(self, e: dict[str, Any]) -> None:
        self.state, self.reason = e["new"], e.get("reason", "")
        self.generation = e.get("generation", self.generation)
        self.restarts = e.get("restarts", self.restarts)
        for view in self.ranks.values():
            if self.state == "stopping" and view.state != "failed":
                view.state = "stopping"
            elif self.state == "restarting" and view.state != "failed":
                view.state = "restarting"
            elif self.state == "running" and view.generation != self.generation:
                view.state = "starting"

    def _shadow(self, e: dict[str, Any]) -> None:
        kind, gen = e["kind"], e.get("generation")
        if kind == "shadow_ready":
            view = self.ranks.get(e.get("rank", -1))
            if view is not None:
                view.shadow_generation, view.shadow_level = gen, e.get("level", 0)
                view.shadow_ready = True
            return
        for view in self.ranks.values():
            if kind == "shadows_spawned":
                view.shadow_generation, view.shadow_level = gen, e.get("level", 0)
                view.shadow_ready = False
            elif kind == "shadows_promoted" and view.shadow_generation == gen:
                view.shadow_generation, view.shadow_level, view.shadow_ready = None, 0, False
            elif kind == "shadows_reclaimed" and view.shadow_generation is not None:
                view.shadow_level, view.shadow_ready = e.get("level_to") or 0, False

    # -- reading ----------------------------------------------------------------------------
    def shadows_ready(self) -> int:
        """Ranks whose shadow for the next generation is ready (with the lock held or not:
        one pass over small values)."""
        nxt = self.generation + 1
        return sum(v.shadow_ready and v.shadow_generation == nxt for v in list(self.ranks.values()))

    def snapshot(self) -> dict[str, Any]:
        """Everything the status page shows, as JSON-ready values."""
        with self._lock:
            info = self.info
            value, basis = ettr_so_far(self.all_rows, self.reference_rows)
            rows = list(self.rows)
            return {
                "run": info.run if info else "",
                "world_size": info.world_size if info else 0,
                "iterations": info.iterations if info else 0,
                "recovery_mode": info.recovery_mode if info else "",
                "shadow_level": info.shadow_level if info else 0,
                "plan": info.plan if info else "",
                "placement": {str(r): list(p) for r, p in (info.placement if info else {}).items()},
                "state": self.state,
                "reason": self.reason,
                "generation": self.generation,
                "restarts": self.restarts,
                "t_started": self.t_started,
                "t_finished": self.t_finished,
                "now": time.time(),
                "completed": max((r["iter"] for r in self.all_rows), default=-1) + 1,
                "attempts": len(self.all_rows),
                "checkpoints": self.checkpoints,
                "shadows_ready": self.shadows_ready(),
                "ettr": value,
                "ettr_basis": basis,
                "ranks": [asdict(v) for v in self.ranks.values()],
                "rows": rows,
                "events": list(self.events),
                "failures": list(self.failures),
                "recoveries": list(self.recoveries),
                "fail_slow": list(self.fail_slow),
            }
