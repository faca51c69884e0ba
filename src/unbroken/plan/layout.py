"""The planner's working value: a plan's layout before its action lists exist.

Owns `Layout`: the replicas (each physical stage a `StageGroup`: TP ranks and layer range),
micro-batch ownership, stage-level migrations, and per group the in-flight bound of its 1F1B
order — how many micro-batches may have run their forward but not yet their backward (1F1B:
pp - s; deeper on a stage whose output crosses a slow link, ResiHP §6.2's reordering to overlap
communication). A layout is what the planning steps change and what the scorer times; action
lists are made once, for the chosen layout (`unbroken.plan.schedule.to_plan`).

Every layout is checked by building its skeleton `ParallelPlan` (no actions), so the plan IR's
invariants hold for every layout that exists. Virtual stages are not supported (v = 1).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from unbroken.parallel import ActionKind, Migration, ParallelPlan, Replica, StageGroup

__all__ = ["Layout"]

Group = tuple[int, int]
"""(replica, physical stage)."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A plan without action lists; see the module docstring."""

    replicas: tuple[Replica, ...]
    microbatches: tuple[int, ...]
    migrations: tuple[Migration, ...] = ()
    inflight: tuple[tuple[int, ...], ...] = ()
    """Per replica, per stage, the 1F1B in-flight bound (empty: pp - s everywhere)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "microbatches", tuple(int(m) for m in self.microbatches))
        object.__setattr__(self, "migrations", tuple(sorted(self.migrations)))
        pp = len(self.replicas[0].stages) if self.replicas else 0
        bounds = self.inflight or tuple(tuple(pp - s for s in range(pp)) for _ in self.replicas)
        bounds = tuple(tuple(int(b) for b in row) for row in bounds)
        if len(bounds) != len(self.replicas) or any(len(row) != pp for row in bounds):
            raise ValueError("inflight needs one bound per stage of every replica")
        if bounds and min(min(row) for row in bounds) < 1:
            raise ValueError("in-flight bounds must be >= 1")
        object.__setattr__(self, "inflight", bounds)
        _ = self.skeleton  # the IR's invariants

    @cached_property
    def skeleton(self) -> ParallelPlan:
        """The plan without actions (validated)."""
        return ParallelPlan(
            replicas=self.replicas,
            num_layers=self.replicas[0].stages[-1].layers[1],
            microbatches=self.microbatches,
            schedule="1f1b",
            migrations=self.migrations,
        )

    # -- structure -----------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Replicas."""
        return len(self.replicas)

    @property
    def pp(self) -> int:
        """Stages per replica."""
        return len(self.replicas[0].stages)

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return self.skeleton.num_layers

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that holds a stage, sorted."""
        return self.skeleton.ranks

    def group(self, d: int, s: int) -> StageGroup:
        """Stage `s` of replica `d`."""
        return self.replicas[d].stages[s]

    def groups(self) -> Iterator[tuple[Group, StageGroup]]:
        """Every ((replica, stage), group)."""
        for d, rep in enumerate(self.replicas):
            for s, g in enumerate(rep.stages):
                yield (d, s), g

    def split(self, d: int = 0) -> tuple[int, ...]:
        """Layers per stage of replica `d`."""
        return tuple(g.layers[1] - g.layers[0] for g in self.replicas[d].stages)

    @property
    def uniform_split(self) -> bool:
        """True when every replica has the same layer split."""
        return all(self.split(d) == self.split(0) for d in range(self.dp))

    # -- changes -----------------------------------------------------------------------------
    def with_split(self, split: Sequence[int]) -> Layout:
        """Every replica with the layer split `split` (same groups, no migrations)."""
        edges = [sum(split[:k]) for k in range(len(split) + 1)]
        replicas = tuple(
            Replica(
                tuple(
                    StageGroup(g.ranks, (edges[s], edges[s + 1])) for s, g in enumerate(rep.stages)
                )
            )
            for rep in self.replicas
        )
        return replace(self, replicas=replicas, migrations=())

    def with_migrations(self, migrations: Sequence[Migration]) -> Layout:
        """The same layout with `migrations` instead of its own."""
        return replace(self, migrations=tuple(migrations))

    def with_inflight(self, inflight: Sequence[Sequence[int]]) -> Layout:
        """The same layout with other in-flight bounds."""
        return replace(self, inflight=tuple(tuple(row) for row in inflight))

    # -- from a running plan --------------------------------------------------------------------
    @classmethod
    def from_plan(cls, plan: ParallelPlan) -> Layout:
        """The layout of `plan`; in-flight bounds read from its actions when it has them.

        Raises:
            ValueError: the plan has virtual stages.
        """
        if plan.virtual_stages != 1:
            raise ValueError("the planner handles plans without virtual stages (v = 1)")
        bounds = [[plan.pp - s for s in range(plan.pp)] for _ in range(plan.dp)]
        for d, rep in enumerate(plan.replicas):
            for s, g in enumerate(rep.stages):
                acts = plan.actions.get(g.ranks[0], ())
                measured = _inflight_of(acts)
                # A replica of fewer micro-batches than the bound never reaches it: what its
                # list shows is its count, and a re-balance that gives it more (a slow device
                # back at full speed) would be timed without pipelining (`balance_simulated`
                # kept [1, 7] at [3, 5]). Then the schedule's own bound stands.
                count_bound = measured >= plan.microbatches[d] and measured < plan.pp - s
                if acts and not count_bound:
                    bounds[d][s] = max(measured, 1)
        return cls(
            replicas=plan.replicas,
            microbatches=plan.microbatches,
            migrations=plan.migrations,
            inflight=tuple(tuple(row) for row in bounds),
        )


def _inflight_of(actions: Sequence) -> int:
    """Most forwards run and not yet backwarded at any point of one rank's list."""
    live = most = 0
    for a in actions:
        if a.kind is ActionKind.F:
            live += 1
            most = max(most, live)
        elif a.kind is ActionKind.B:
            live -= 1
    return most
