"""The ResiHP scheduler: TP exclusion, then layer repartition and reordering, then DP migration.

Owns `plan_for_state`, the planner's entry point, and `PlanResult`, what it returns. Given a
`ClusterState` (devices with their health, the running plan, the workload), it applies the
three steps of ResiHP §6 in order, each to the previous step's layout:

1. `exclusion`: re-select every affected TP group (eq. 4), rebuild or dissolve replicas that
   lost a stage;
2. `repartition`: move layers off the straggling stage, then deepen the in-flight bounds
   upstream of a slow link — each candidate timed by the simulator;
3. `migration`: Algorithm 1's progress-aware stage migrations;

and, as an alternative to steps 2-3, every affected replica its own layer split (from step 1's
layout) with the micro-batches re-owned by speed (`repartition.repartition_each`, an extension
named there), kept only if it beats the three steps.

Every layout is timed by `unbroken.plan.score` (the dry-run simulator, on a reduced plan). A
step's layout replaces the previous one only if it is predicted faster (or if the previous one
cannot run: it uses a lost device or does not fit in memory). The result is never predicted
slower than the current plan: when no new layout beats it, the current plan itself is returned.

The planner is pure and deterministic: no processes, no clocks in its decisions (it reports its
own wall time), equal states give equal plans, so every rank can run it itself.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from unbroken.parallel import ParallelPlan
from unbroken.plan.exclusion import NoPlanError, Selection, exclude
from unbroken.plan.layout import Layout
from unbroken.plan.memory import fits, memory_problems
from unbroken.plan.migration import migrate
from unbroken.plan.repartition import deepen_inflight, repartition, repartition_each
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState, Device, DeviceStatus

__all__ = ["NoPlanError", "PlanResult", "PlannerConfig", "StepReport", "plan_for_state"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerConfig:
    """Which steps run, and their knobs (the ablation of ResiHP Figure 11 turns steps off)."""

    exclusion: bool = True
    """Step 1 on slow devices; lost devices are always excluded (a plan cannot use them)."""
    repartition: bool = True
    reorder: bool = True
    """Deepen in-flight bounds upstream of slow links (part of step 2)."""
    migration: bool = True
    delta: int | None = None
    """Algorithm 1's progress-gap threshold (None: `migration.auto_delta`)."""
    rounds: int = 3
    """Algorithm 1 passes at most."""
    budget: int = 64
    """Most candidates step 2 times."""
    ownership: bool = True
    """May change how many micro-batches each replica owns (per-replica repartition, the
    migration seed). False keeps the current ownership and moves work with migrations only:
    what today's engine runs (it requires equal micro-batch counts); a replica dissolved by a
    lost stage still hands its micro-batches to the others."""
    empty_replicas: bool = True
    """May give a replica no micro-batch when that is faster ([Note: empty replica] in
    `unbroken.plan.balance`). False for an executor that keeps every replica computing (the
    data-parallel trainer, whose placement gives every rank at least one)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """One line of the explanation: what a step chose and what it predicted."""

    step: str
    before_s: float
    after_s: float
    kept: bool
    notes: tuple[str, ...] = ()
    evaluated: int = 0

    def describe(self) -> str:
        verdict = "kept" if self.kept else "no gain, not kept"
        head = (
            f"{self.step}: {_fmt(self.before_s)} -> {_fmt(self.after_s)} per iteration "
            f"({verdict}; {self.evaluated} candidates timed)"
        )
        return "\n".join([head, *(f"  - {n}" for n in self.notes)])


def _fmt(seconds: float) -> str:
    return "cannot run" if not math.isfinite(seconds) else f"{seconds:.3f} s"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The planner's answer."""

    layout: Layout
    """The chosen layout (the current plan's when nothing beats it)."""
    standbys: tuple[int, ...]
    """Live devices outside the plan."""
    current_s: float
    """Predicted iteration time of the running plan (inf when it cannot run any more)."""
    predicted_s: float
    """Predicted iteration time of the chosen plan."""
    steps: tuple[StepReport, ...]
    selections: tuple[Selection, ...] = ()
    kept_current: bool = False
    planning_s: float = 0.0
    """Wall time the planner took (for the record, never a decision input)."""
    simulations: int = 0
    scorer: Scorer = field(repr=False, compare=False)
    current_plan: ParallelPlan | None = field(default=None, repr=False, compare=False)

    @property
    def speedup(self) -> float:
        """current / predicted iteration time (inf when the current plan cannot run)."""
        return self.current_s / self.predicted_s

    def plan(self) -> ParallelPlan:
        """The chosen plan with every rank's action list (the running plan itself when kept)."""
        if self.kept_current and self.current_plan is not None and self.current_plan.actions:
            return self.current_plan
        return self.scorer.plan(self.layout)

    def actions_of(self, rank: int) -> tuple:
        """`plan().actions[rank]` without materializing every rank's list (a 4,096-GPU plan
        has ~760,000 actions; each rank needs its own).

        Raises:
            KeyError: the rank holds no stage (a standby or a lost device).
        """
        if self.kept_current and self.current_plan is not None and self.current_plan.actions:
            return self.current_plan.actions[rank]
        return self.scorer.actions_of(self.layout, rank)

    def explain(self) -> str:
        """A human-readable account of every step."""
        lines = [
            f"current plan: {_fmt(self.current_s)} per iteration; chosen: "
            f"{_fmt(self.predicted_s)}"
            + (" (the current plan: nothing predicted faster)" if self.kept_current else ""),
            f"planned in {self.planning_s * 1e3:.0f} ms, {self.simulations} simulations",
        ]
        lines += [f"  {s.describe()}" for s in self.selections]
        lines += [s.describe() for s in self.steps]
        if self.standbys:
            lines.append(f"standbys: {list(self.standbys)}")
        return "\n".join(lines)


def _runnable(state: ClusterState, layout: Layout) -> bool:
    return not (set(layout.ranks) & state.lost) and fits(state, layout)


class _Run:
    """One planning run: the best layout so far and the report."""

    def __init__(self, state: ClusterState, scorer: Scorer, current: Layout | None) -> None:
        self.state, self.scorer = state, scorer
        self.current = current if current is not None else Layout.from_plan(state.plan)
        self.current_s = scorer.time(self.current) if _runnable(state, self.current) else math.inf
        self.best, self.best_s = self.current, self.current_s
        self.steps: list[StepReport] = []

    def offer(self, name: str, layout: Layout, t: float, notes, evaluated: int) -> None:
        kept = t < self.best_s * (1 - 1e-9) or not math.isfinite(self.best_s)
        self.steps.append(StepReport(name, self.best_s, t, kept, tuple(notes), evaluated))
        if kept:
            self.best, self.best_s = layout, t


def plan_for_state(
    state: ClusterState,
    config: PlannerConfig | None = None,
    *,
    scorer: Scorer | None = None,
    current: Layout | None = None,
) -> PlanResult:
    """Plan around the failures in `state` (see the module docstring).

    Args:
        state: devices, the running plan and the workload.
        config: which steps run (default: all, `PlannerConfig()`).
        scorer: a scorer of this state whose cache to reuse (default: a new one).
        current: the running layout, when the caller keeps one (with its in-flight bounds)
            instead of `state.plan`'s.

    Returns:
        The chosen layout, its predicted time, and the explanation.

    Raises:
        NoPlanError: the live devices cannot form one complete pipeline.
    """
    with _collector_paused():
        return _plan(state, config, scorer, current)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Cyclic garbage collection paused for one planning run.

    Timing a candidate allocates some 10^5 short-lived tuples; the young collections they
    trigger promote the ones alive mid-simulation, and every few simulations that forces a full
    collection of the whole process (with torch imported, some 170,000 tracked objects): a
    third of the planning time at 256 GPUs. The planner creates no reference cycles (its garbage
    is freed by reference counting; `tests/plan/test_reference.py` checks), so nothing is left
    for the collector, which resumes afterwards as it was.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan(
    state: ClusterState,
    config: PlannerConfig | None,
    scorer: Scorer | None,
    current: Layout | None,
) -> PlanResult:
    began = time.perf_counter()
    config = config or PlannerConfig()
    scorer = scorer or Scorer(state)
    run = _Run(state, scorer, current)
    selections = _exclusion(run, config)
    after_exclusion, exclusion_s = run.best, run.best_s
    _pipeline_and_migration(run, config)
    if config.repartition and config.ownership:
        imp = repartition_each(
            scorer,
            after_exclusion,
            exclusion_s,
            budget=config.budget,
            floor=0 if config.empty_replicas else 1,
        )
        name = "per-replica repartition (instead of steps 2-3)"
        run.offer(name, imp.layout, imp.time, imp.notes, imp.evaluated)
    if not math.isfinite(run.best_s):
        raise NoPlanError("no layout of the live devices can run")
    used = set(run.best.ranks)
    excluded = any(s.step == "exclusion" and s.kept for s in run.steps)
    return PlanResult(
        layout=run.best,
        standbys=tuple(d.rank for d in state.devices if d.alive and d.rank not in used),
        current_s=run.current_s,
        predicted_s=run.best_s,
        steps=tuple(run.steps),
        selections=selections if excluded else (),
        kept_current=run.best is run.current,
        planning_s=time.perf_counter() - began,
        simulations=scorer.simulations,
        scorer=scorer,
        current_plan=state.plan if current is None else None,
    )


def _exclusion(run: _Run, config: PlannerConfig) -> tuple[Selection, ...]:
    """Step 1 (always when the running plan cannot run: it uses a lost device)."""
    if math.isfinite(run.current_s) and not config.exclusion:
        return ()
    state = run.state
    ex = exclude(state if config.exclusion else _lost_only(state), run.current)
    problems = memory_problems(state, ex.layout)
    if problems:  # pragma: no cover - exclusion only forms groups that fit
        raise RuntimeError(f"step 1 formed a group that does not fit: {problems[0]}")
    changed = ex.layout != run.current
    t = run.scorer.time(ex.layout) if changed else run.current_s
    run.offer("exclusion", ex.layout, t, ex.notes, int(changed))
    return ex.selections


def _pipeline_and_migration(run: _Run, config: PlannerConfig) -> None:
    """Steps 2 and 3, each from the best layout so far."""
    scorer = run.scorer
    if config.repartition:
        imp = repartition(scorer, run.best, run.best_s, budget=config.budget)
        run.offer("repartition", imp.layout, imp.time, imp.notes, imp.evaluated)
    if config.reorder:
        imp = deepen_inflight(scorer, run.best, run.best_s, budget=config.budget)
        run.offer("reorder", imp.layout, imp.time, imp.notes, imp.evaluated)
    if config.migration:
        imp = migrate(
            scorer,
            run.best,
            run.best_s,
            delta=config.delta,
            rounds=config.rounds,
            ownership=config.ownership,
            floor=0 if config.empty_replicas else 1,
        )
        run.offer("migration", imp.layout, imp.time, imp.notes, imp.evaluated)


def _lost_only(state: ClusterState) -> ClusterState:
    """The state with every slow device counted healthy for step 1 (so that only lost devices
    trigger a re-selection) — the ablation without exclusion of slow devices."""
    devices = tuple(
        d
        if not d.alive or d.status is DeviceStatus.HEALTHY
        else Device(rank=d.rank, node=d.node, memory_bytes=d.memory_bytes)
        for d in state.devices
    )
    return ClusterState(
        devices=devices, plan=state.plan, workload=state.workload, fabric=state.fabric
    )
