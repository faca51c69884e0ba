"""Adaptra (Wu et al., arXiv 2504.19232): pipeline schedule adaptation for stragglers.

Owns the Adaptra policy. Adaptra adapts the pipeline schedule so that a delay — above all a slow
inter-stage link — is absorbed instead of cascading into bubbles: the stages before the delay
keep more micro-batches in flight (a deeper warm-up), as far as memory allows, with the depth
chosen by an analytical model of the schedule. [Interpretation] Here the model is the dry-run
simulator: per replica, the stages up to its slowest link (and, for a compute straggler, up to
the boundary before its slowest stage) get one more in-flight micro-batch at a time while the
predicted iteration time drops (`unbroken.plan.repartition.deepen_inflight` with
`slow_stages=True`). Adaptra's second mechanism, moving communication to host-side RDMA so that
a slow transfer does not block the GPU's next kernels, has no counterpart in the simulator,
whose sends never block compute (eager timing). Fail-stop is out of scope: the policy stops.
"""

from __future__ import annotations

import math

from unbroken.plan.baselines._common import Outcome, timed
from unbroken.plan.layout import Layout
from unbroken.plan.repartition import deepen_inflight
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState

__all__ = ["Adaptra"]


class Adaptra:
    """The Adaptra policy (module docstring)."""

    name = "adaptra"

    def __init__(self, initial: Layout, cache: dict | None = None, budget: int = 32) -> None:
        self.initial, self.budget = initial, budget
        self.cache = {} if cache is None else cache

    def react(self, state: ClusterState) -> Outcome:
        if set(self.initial.ranks) & state.lost:
            return Outcome(
                policy=self.name,
                time_s=math.inf,
                reason="fail-stop: Adaptra handles stragglers only",
            )
        scorer = Scorer(state, cache=self.cache)
        base = scorer.time(self.initial)
        imp, seconds = timed(
            deepen_inflight, scorer, self.initial, base, budget=self.budget, slow_stages=True
        )
        return Outcome(
            policy=self.name,
            time_s=imp.time,
            layouts=(imp.layout,),
            plan_s=seconds,
            notes=imp.notes,
        )
