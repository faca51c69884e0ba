"""The policies `unbroken bench plan` compares, all planning over the same simulator.

Owns the policy interface (`Policy`: react to each new cluster state, keeping your own plan;
`Outcome`: what you run and its predicted iteration time, or why you stop) and the policies of
ResiHP §8.1, each faithful to its own paper and code where they say what it does, with every
interpretation named in its module docstring:

- `NoMitigation`: keeps the initial plan; stops at the first fail-stop;
- `Greyhound` (fail-slow: redistribute micro-batches across DP groups by speed; communication
  stragglers: layer split by link speed);
- `Adaptra` (pipeline schedule adaptation: deeper warm-up ahead of a delay);
- `ReCycle` (fail-stop: re-route a failed stage's micro-batches to its DP peers);
- `Oobleck` (fail-stop: re-instantiate pipelines from templates on the surviving units);
- strengthened ReCycle and Oobleck (``strengthened=True``: plus Greyhound's mitigation);
- `ResiHP`: ours, `unbroken.plan.plan_for_state`, with `PlannerConfig` for the ablation.

Every iteration time comes from `unbroken.plan.score.Scorer` — `unbroken.parallel.simulate` —
never from a formula of a policy's own.
"""

from __future__ import annotations

import math

from unbroken.plan.balance import balance_counts
from unbroken.plan.baselines._common import Outcome, Policy, moved_bytes
from unbroken.plan.baselines.adaptra import Adaptra
from unbroken.plan.baselines.greyhound import Greyhound, greyhound_mitigation
from unbroken.plan.baselines.oobleck import Oobleck, template_split
from unbroken.plan.baselines.recycle import ReCycle, recycle_layout
from unbroken.plan.exclusion import NoPlanError
from unbroken.plan.layout import Layout
from unbroken.plan.planner import PlannerConfig, plan_for_state
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState

__all__ = [
    "Adaptra",
    "Greyhound",
    "NoMitigation",
    "Oobleck",
    "Outcome",
    "Policy",
    "ReCycle",
    "ResiHP",
    "balance_counts",
    "greyhound_mitigation",
    "moved_bytes",
    "recycle_layout",
    "template_split",
]


class NoMitigation:
    """Keep running the initial plan; a lost device ends the job."""

    name = "none"

    def __init__(self, initial: Layout, cache: dict | None = None) -> None:
        self.initial, self.cache = initial, {} if cache is None else cache

    def react(self, state: ClusterState) -> Outcome:
        if set(self.initial.ranks) & state.lost:
            return Outcome(policy=self.name, time_s=math.inf, reason="a device was lost")
        t = Scorer(state, cache=self.cache).time(self.initial)
        return Outcome(policy=self.name, time_s=t, layouts=(self.initial,))


class ResiHP:
    """Ours: `plan_for_state` on every new state, from the plan it chose last."""

    def __init__(
        self,
        initial: Layout,
        config: PlannerConfig | None = None,
        *,
        name: str = "resihp",
        cache: dict | None = None,
    ) -> None:
        self.name, self.config = name, config or PlannerConfig()
        self.current = initial
        self.cache = {} if cache is None else cache
        self.last = None

    def react(self, state: ClusterState) -> Outcome:
        scorer = Scorer(state, cache=self.cache)
        try:
            result = plan_for_state(state, self.config, scorer=scorer, current=self.current)
        except NoPlanError as exc:
            return Outcome(policy=self.name, time_s=math.inf, reason=str(exc))
        moved = moved_bytes(state, [self.current], [result.layout])
        self.current, self.last = result.layout, result
        return Outcome(
            policy=self.name,
            time_s=result.predicted_s,
            layouts=(result.layout,),
            plan_s=result.planning_s,
            moved_bytes=moved,
            notes=tuple(n for step in result.steps if step.kept for n in step.notes),
        )
