"""What every policy shares: its outcome, the policy interface, and Greyhound's batch solver.

Owns `Outcome` (a policy's answer to one cluster state: the layouts it runs, their predicted
iteration time, or why it stops), the `Policy` interface the bench drives, a replica's time
per micro-batch, and the bytes a re-plan has to move (for the bench's reconfiguration time).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from unbroken.plan.balance import replica_rates
from unbroken.plan.layout import Layout
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState

__all__ = ["Outcome", "Policy", "moved_bytes", "per_microbatch_s", "timed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """A policy's answer to one cluster state."""

    policy: str
    time_s: float
    """Predicted iteration time; inf when the policy cannot continue."""
    layouts: tuple[Layout, ...] = ()
    """What it runs: one layout, or one per pipeline when pipelines differ in depth."""
    reason: str = ""
    """Why it stopped, or what it did."""
    plan_s: float = 0.0
    """Wall time of the decision."""
    moved_bytes: float = 0.0
    """Most state bytes one device had to receive for this re-plan."""
    notes: tuple[str, ...] = field(default=())

    @property
    def survived(self) -> bool:
        """False when the policy aborts the job."""
        return math.isfinite(self.time_s)


class Policy(Protocol):
    """A failure-handling policy: reacts to every new cluster state, keeping its own plan."""

    name: str

    def react(self, state: ClusterState) -> Outcome:
        """The policy's plan for `state` (the devices as they are now; `state.plan` is the
        job's initial plan, the policy keeps its own current one)."""
        ...


def timed(fn, *args, **kwargs):
    """(result, seconds) of a call."""
    began = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - began


def per_microbatch_s(scorer: Scorer, layout: Layout, d: int) -> float:
    """Seconds per micro-batch of replica d run alone: Greyhound's per-DP-group time."""
    return replica_rates(scorer, layout)[d]


def moved_bytes(state: ClusterState, before: Sequence[Layout], after: Sequence[Layout]) -> float:
    """Most bytes of model state one device must receive to go from `before` to `after`: a
    device whose (layers, TP degree, TP position) changed receives its whole new shard."""
    held = {}
    for lay in before:
        for _, g in lay.groups():
            for i, r in enumerate(g.ranks):
                held[r] = (g.layers, g.tp, i)
    wl = state.workload
    most = 0.0
    for lay in after:
        for _, g in lay.groups():
            for i, r in enumerate(g.ranks):
                if held.get(r) != (g.layers, g.tp, i):
                    most = max(most, wl.stage_params(g.layers) / g.tp * wl.state_bytes_per_param)
    return most
