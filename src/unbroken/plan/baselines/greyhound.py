"""Greyhound (Wu et al., ATC '25): fail-slow mitigation by micro-batch redistribution.

Owns the Greyhound policy and its mitigation as a function other policies add ("strengthened"
ReCycle and Oobleck, ResiHP §8.1). From Greyhound's own code (github.com/wutianyuan1/Greyhound,
`detector/control_plane/mitigation_plan.py`, `dp_planner.py`):

- *computation* fail-slow: each DP group's time is its slowest member's (the max over its TP
  and PP peers); the micro-batches of the global batch are redistributed across DP groups,
  n_i >= 1 integers summing to the batch, minimizing the variance of n_i * t_i (`solve_dp`,
  solved there with cvxpy; here exactly by `balance_counts`). [Interpretation] t_i, which
  Greyhound maps linearly from validation latencies to iteration time, is here the simulator's
  time per micro-batch of replica i run alone.
- *communication* fail-slow: the layer split is set proportional to each PP stage's inverse
  communication time (`adjust_pipeline_parallel`), the stage behind the slow link getting fewer
  layers. [Interpretation] A stage's communication time is its slowest inter-stage message.
- fail-stop is out of scope (Greyhound falls back to checkpoint-restart, which needs spare
  devices this cluster does not have): the policy stops.

Greyhound's levels S1 (do nothing) and S4 (checkpoint-restart) and its ski-rental timing of
when to act are not modelled: the bench compares steady states after each mitigation.
"""

from __future__ import annotations

import math

from unbroken.parallel import split_layers
from unbroken.plan.balance import balance_counts, replica_rates
from unbroken.plan.baselines._common import Outcome, timed
from unbroken.plan.layout import Layout
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState

__all__ = ["Greyhound", "greyhound_mitigation"]


def _compute_slow(state: ClusterState, layout: Layout) -> bool:
    return any(state.device(r).speed < 1 for r in layout.ranks if state.device(r).alive)


def _comm_slow(state: ClusterState, layout: Layout) -> bool:
    return any(state.device(r).link_speed < 1 for r in layout.ranks if state.device(r).alive)


def _stage_comm(scorer: Scorer, layout: Layout) -> list[float]:
    link = scorer.group_link(layout)
    out = []
    for s in range(layout.pp):
        worst = 0.0
        for d in range(layout.dp):
            for t in (s - 1, s + 1):
                if 0 <= t < layout.pp:
                    worst = max(worst, link((d, s), (d, t)), link((d, t), (d, s)))
        out.append(worst)
    return out


def greyhound_mitigation(scorer: Scorer, layout: Layout) -> tuple[Layout, list[str]]:
    """Greyhound's adjustments for the slow devices of `scorer.state` (module docstring)."""
    state, notes = scorer.state, []
    if _comm_slow(state, layout) and layout.pp > 1:
        comm = _stage_comm(scorer, layout)
        split = split_layers(layout.num_layers, layout.pp, [1.0 / c for c in comm])
        if split != layout.split(0) and layout.uniform_split:
            layout = layout.with_split(split)
            notes.append(f"layers per stage by inverse communication time: {list(split)}")
    if _compute_slow(state, layout) and layout.dp > 1:
        rates = replica_rates(scorer, layout)
        counts = balance_counts(rates, sum(layout.microbatches))
        if tuple(counts) != layout.microbatches:
            layout = Layout(
                replicas=layout.replicas, microbatches=tuple(counts), inflight=layout.inflight
            )
            notes.append(f"micro-batches per DP group: {counts}")
    return layout, notes


class Greyhound:
    """The Greyhound policy (module docstring)."""

    name = "greyhound"

    def __init__(self, initial: Layout, cache: dict | None = None) -> None:
        self.initial, self.cache = initial, {} if cache is None else cache

    def react(self, state: ClusterState) -> Outcome:
        if set(self.initial.ranks) & state.lost:
            return Outcome(
                policy=self.name,
                time_s=math.inf,
                reason="fail-stop: Greyhound handles fail-slow only (checkpoint-restart "
                "would need spare devices)",
            )
        scorer = Scorer(state, cache=self.cache)
        (layout, notes), seconds = timed(greyhound_mitigation, scorer, self.initial)
        return Outcome(
            policy=self.name,
            time_s=scorer.time(layout),
            layouts=(layout,),
            plan_s=seconds,
            notes=tuple(notes),
        )
