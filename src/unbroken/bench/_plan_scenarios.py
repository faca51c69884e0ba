"""The scenarios of `unbroken bench plan` (ResiHP §8.3-8.4) and how each policy fares in them.

Owns:

- *severity calibration*: a fail-slow category is defined by the throughput it costs an
  unmitigated job (weak/medium/severe: 35/55/70 %, §8.3); the slowdown factor of the one slow
  GPU (compute) or of its network link is found by bisection on the unmitigated job's
  predicted time — the scenario's definition, not a knob tuned to any policy's result;
- *fail-slow*: one slow GPU or link, every policy's steady-state throughput after it reacts;
- *traces* (fail-stop, Table 6; mixed, Figure 10): over a session of `hours`, one event every
  `minutes` (events at (i - 1/2) x minutes); fail-stop events kill a GPU that is still alive
  (chosen by a seeded generator; workers are never revived), mixed ones alternate a kill and a
  medium compute slowdown. After every event each policy re-plans from its own plan. A re-plan
  costs every policy the same: the interrupted iteration half done on average, 2 s to rebuild
  communicators (ResiHP §8.4 measured under 2 s), and the time to receive its new state (the
  most bytes one GPU must receive, over the network). A policy that cannot continue has no
  throughput (Table 6's "-").
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from unbroken.plan import ClusterState, Layout, PlannerConfig
from unbroken.plan.baselines import (
    Adaptra,
    Greyhound,
    NoMitigation,
    Oobleck,
    Outcome,
    ReCycle,
    ResiHP,
)
from unbroken.plan.score import Scorer

__all__ = [
    "LOSSES",
    "REBUILD_S",
    "Event",
    "Row",
    "calibrate",
    "fail_slow",
    "policies",
    "trace",
]

LOSSES = {"weak": 0.35, "medium": 0.55, "severe": 0.70}
"""Unmitigated throughput loss of each fail-slow category (ResiHP §8.3)."""
REBUILD_S = 2.0
"""Communicator rebuild per re-plan (ResiHP §8.4, Figure 13: under 2 s), for every policy."""


@dataclass(frozen=True, slots=True)
class Row:
    """One (scenario, model, policy) result."""

    scenario: str
    model: str
    policy: str
    samples_per_s: float | None
    survived: bool
    plan_ms: float
    iteration_s: float | None = None
    reason: str = ""
    events: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {
            "scenario": self.scenario,
            "model": self.model,
            "policy": self.policy,
            "samples_per_s": self.samples_per_s,
            "survived": self.survived,
            "plan_ms": self.plan_ms,
            "iteration_s": self.iteration_s,
        }
        if self.reason:
            out["reason"] = self.reason
        if self.events:
            out["events"] = self.events
        out.update(self.extra)
        return out


Factory = Callable[[], list]


def policies(names: Sequence[str], initial: Layout, state: ClusterState, cache: dict) -> list:
    """Fresh policy objects by name (sharing one simulation cache: equal components of equal
    cost are simulated once per job)."""
    made = {
        "none": lambda: NoMitigation(initial, cache),
        "greyhound": lambda: Greyhound(initial, cache),
        "adaptra": lambda: Adaptra(initial, cache),
        "recycle": lambda: ReCycle(initial, cache=cache),
        "recycle+": lambda: ReCycle(initial, strengthened=True, cache=cache),
        "oobleck": lambda: Oobleck(initial, state, cache=cache),
        "oobleck+": lambda: Oobleck(initial, state, strengthened=True, cache=cache),
        "resihp": lambda: ResiHP(initial, cache=cache),
        "resihp-exclusion": lambda: ResiHP(
            initial,
            PlannerConfig(repartition=False, reorder=False, migration=False),
            name="resihp-exclusion",
            cache=cache,
        ),
        "resihp-repartition": lambda: ResiHP(
            initial,
            PlannerConfig(migration=False, ownership=False),
            name="resihp-repartition",
            cache=cache,
        ),
    }
    return [made[n]() for n in names]


def calibrate(
    state: ClusterState, layout: Layout, rank: int, kind: str, loss: float, cache: dict
) -> float:
    """The slowdown factor x of `rank` (its compute, or its link) at which the unmitigated job
    loses `loss` of its throughput (bisection on log x, 40 steps, x <= 1e5)."""
    healthy = Scorer(state, cache=cache).time(layout)
    want = healthy / (1.0 - loss)

    def slowed(x: float) -> float:
        s = (
            state.with_slow(rank, speed=1 / x)
            if kind == "compute"
            else state.with_slow(rank, link_speed=1 / x)
        )
        return Scorer(s, cache=cache).time(layout)

    lo, hi = 0.0, math.log(1e5)
    if slowed(math.exp(hi)) < want:
        raise ValueError(f"no {kind} slowdown of rank {rank} costs {loss:.0%} of the throughput")
    for _ in range(40):
        mid = (lo + hi) / 2
        if slowed(math.exp(mid)) < want:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)


def slowed_state(state: ClusterState, rank: int, kind: str, factor: float) -> ClusterState:
    """`state` with `rank` slower by `factor` in its compute or its link."""
    if kind == "compute":
        return state.with_slow(rank, speed=1 / factor)
    return state.with_slow(rank, link_speed=1 / factor)


def fail_slow(
    state: ClusterState, names: Sequence[str], initial: Layout, batch: int, cache: dict
) -> list[tuple[str, Outcome]]:
    """Each policy's reaction to the slow state `state`."""
    out = []
    for policy in policies(names, initial, state, cache):
        o = policy.react(state)
        out.append((policy.name, o))
    return out


@dataclass(frozen=True, slots=True)
class Event:
    """One event of a trace."""

    at_s: float
    lost: int | None = None
    slow: int | None = None
    factor: float = 1.0


def events(
    spec_hours: float,
    minutes: float,
    ranks: Sequence[int],
    *,
    mixed: bool,
    slow_factor: float,
    seed: int,
) -> list[Event]:
    """The trace's events: n = hours * 60 / minutes of them at (i - 1/2) * minutes; kills of
    distinct GPUs (and, when `mixed`, every second event a compute slowdown of a GPU that is
    neither lost nor slow yet)."""
    rng = random.Random(seed)
    n = round(spec_hours * 60 / minutes)
    order = list(ranks)
    rng.shuffle(order)
    out = []
    for i, target in enumerate(order[:n]):
        at = (i + 0.5) * minutes * 60
        if mixed and i % 2 == 1:
            out.append(Event(at, slow=target, factor=slow_factor))
        else:
            out.append(Event(at, lost=target))
    return out


def trace(
    state: ClusterState,
    names: Sequence[str],
    initial: Layout,
    plan_events: Sequence[Event],
    hours: float,
    batch: int,
    cache: dict,
) -> list[dict]:
    """Run every policy through the events; per policy its average samples/s over the session
    (None if it stopped), planning times, and why it stopped."""
    session = hours * 3600
    results = []
    for policy in policies(names, initial, state, cache):
        st, now, samples = state, 0.0, 0.0
        iteration = policy.react(st).time_s
        plan_ms, stopped, last = [], "", None
        for ev in plan_events:
            samples += max(ev.at_s - now, 0.0) / iteration * batch
            st = (
                st.with_lost(ev.lost)
                if ev.lost is not None
                else st.with_slow(ev.slow, speed=1 / ev.factor)
            )
            began = time.perf_counter()
            outcome = policy.react(st)
            plan_ms.append((time.perf_counter() - began) * 1e3)
            if not outcome.survived:
                stopped, now = outcome.reason, ev.at_s
                break
            downtime = _downtime(st, outcome, iteration, last, lost=ev.lost is not None)
            last, iteration, now = outcome.layouts, outcome.time_s, ev.at_s + downtime
        else:
            samples += max(session - now, 0.0) / iteration * batch
        results.append(
            {
                "policy": policy.name,
                "samples_per_s": None if stopped else samples / session,
                "effective_samples_per_s": samples / session,
                "survived": not stopped,
                "plan_ms": sum(plan_ms) / len(plan_ms) if plan_ms else 0.0,
                "reason": stopped,
                "final_iteration_s": None if stopped else iteration,
            }
        )
    return results


def _downtime(st: ClusterState, outcome: Outcome, before_s: float, last, *, lost: bool) -> float:
    changed = last is None or tuple(outcome.layouts) != tuple(last)
    redo = 0.5 * before_s if lost else 0.0
    if not changed:
        return redo
    return redo + REBUILD_S + outcome.moved_bytes / st.fabric.inter_bytes_per_s
