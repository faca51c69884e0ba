"""ReCycle (Gandhi et al., SOSP '24): fail-stop tolerance by re-routing to DP peers.

Owns the ReCycle policy, plain and strengthened with Greyhound's mitigation (ResiHP §8.1). From
the ReCycle paper: when a server fails, the micro-batches its pipeline stage would have run are
re-routed to the data-parallel peers of the same stage, which hold the same parameters
(functional redundancy); its Planner spreads a failed stage's work evenly over the surviving
peers ("failure normalization"). As ResiHP observes, a failure anywhere in a TP group takes
the whole group out (its healthy devices idle), and the job cannot continue once every
replica of some stage has lost its group.

Here: every TP group with a lost device is out; its replica keeps running its other stages, and
each of its micro-batches' stage on the dead group becomes a `Migration` to a surviving peer of
that stage, round-robin over the peers in replica order. [Interpretation] The plan IR has no
empty stage, so the dead group stays in the layout as a placeholder that runs nothing (its
ranks only take part in the gradient reduction, whose cost does not depend on them); such a
layout is for timing only, never for execution. ReCycle's Decoupled BackProp and staggered
optimizer, which let re-routed work fill pipeline bubbles, are not modelled (every policy runs
1F1B with full backward passes), nor its MILP's memory checks (re-routed work is assumed to
fit).
"""

from __future__ import annotations

import math

from unbroken.parallel import Migration
from unbroken.plan.baselines._common import Outcome, moved_bytes, timed
from unbroken.plan.baselines.greyhound import greyhound_mitigation
from unbroken.plan.layout import Layout
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState

__all__ = ["ReCycle", "recycle_layout"]


def recycle_layout(state: ClusterState, layout: Layout) -> Layout | str:
    """The re-routed layout, or why ReCycle cannot continue."""
    dead = {
        (d, s) for (d, s), g in layout.groups() if any(not state.device(r).alive for r in g.ranks)
    }
    plan = layout.skeleton
    migrations = []
    for s in range(layout.pp):
        peers = [d for d in range(layout.dp) if (d, s) not in dead]
        if not peers:
            return f"every replica lost its stage-{s} group: no DP peer can run stage {s}"
        turn = 0
        for d in range(layout.dp):
            if (d, s) not in dead:
                continue
            for m in plan.microbatch_ids(d):
                migrations.append(Migration(m, s, peers[turn % len(peers)]))
                turn += 1
    return layout.with_migrations(migrations)


class ReCycle:
    """The ReCycle policy (module docstring); `strengthened` adds Greyhound's mitigation."""

    def __init__(self, initial: Layout, *, strengthened: bool = False, cache=None) -> None:
        self.initial, self.strengthened = initial, strengthened
        self.name = "recycle+" if strengthened else "recycle"
        self.cache = {} if cache is None else cache
        self.current = initial

    def _plan(self, state: ClusterState) -> tuple[Layout | str, list[str]]:
        scorer = Scorer(state, cache=self.cache)
        base, notes = self.initial, []
        if self.strengthened:
            base, notes = greyhound_mitigation(scorer, base)
        return recycle_layout(state, base), notes

    def react(self, state: ClusterState) -> Outcome:
        (layout, notes), seconds = timed(self._plan, state)
        if isinstance(layout, str):
            return Outcome(policy=self.name, time_s=math.inf, reason=layout, plan_s=seconds)
        moved = moved_bytes(state, [self.current], [layout])
        self.current = layout
        return Outcome(
            policy=self.name,
            time_s=Scorer(state, cache=self.cache).time(layout),
            layouts=(layout,),
            plan_s=seconds,
            moved_bytes=moved,
            notes=tuple(notes),
        )
