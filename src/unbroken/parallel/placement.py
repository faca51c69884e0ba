"""The data-parallel placement: which rank of the running world computes which logical
micro-batch.

Owns `DataPlacement`, the plan IR of a data-parallel job that follows the scheduler (issue 18,
ResiHP §6.3 DP migration and §6.1 exclusion at TP = PP = 1). The job's global batch is fixed
by its config: S logical shards (the data-parallel degree it was launched with) of M
micro-batches each, S·M logical micro-batches with global ids ``k = shard * M + m`` — the ids
of [Note: micro-batch ids] in `unbroken.parallel.plan`, where replica d of the fault-free plan
owns shard d. A placement lists, per rank of the running world, the ids that rank computes
(ascending). Data and randomness are keyed by (shard, m), never by the rank, so moving an id to
another rank, or to a smaller world after a device is lost, changes who computes it and
nothing it computes.

`from_plan` reads the placement off a data-parallel `ParallelPlan` the planner returned
(ownership and migrations), given the devices of the world in rank order. Torch-free; a value:
re-planning builds a new one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from unbroken.parallel.plan import ParallelPlan

__all__ = ["DataPlacement"]


@dataclass(frozen=True, slots=True)
class DataPlacement:
    """Who computes which logical micro-batch; see the module docstring."""

    shards: int
    """S: logical data shards (the job's data-parallel degree at launch)."""
    microbatches: int
    """M: micro-batches per shard per iteration."""
    items: tuple[tuple[int, ...], ...]
    """Per rank of the running world, the global ids it computes, ascending."""

    def __post_init__(self) -> None:
        items = tuple(tuple(sorted(int(k) for k in ids)) for ids in self.items)
        object.__setattr__(self, "items", items)
        if self.shards < 1 or self.microbatches < 1 or not items:
            raise ValueError("a placement needs shards, microbatches and ranks >= 1")
        every = sorted(k for ids in items for k in ids)
        if every != list(range(self.total)):
            raise ValueError(
                f"a placement must give each of the {self.total} micro-batches to exactly one "
                f"rank, got {[list(ids) for ids in items]}"
            )

    @classmethod
    def identity(cls, shards: int, microbatches: int) -> DataPlacement:
        """Rank r computes shard r (the fault-free data-parallel job)."""
        m = microbatches
        return cls(shards, m, tuple(tuple(range(r * m, (r + 1) * m)) for r in range(shards)))

    @classmethod
    def from_plan(
        cls, plan: ParallelPlan, devices: Sequence[int], microbatches: int
    ) -> DataPlacement:
        """The placement of a data-parallel plan (one single-rank stage per replica) whose
        ranks are device ids; `devices` lists the world's devices in rank order.

        Raises:
            ValueError: the plan is not data-parallel, uses a device outside `devices`, or its
                micro-batch count is not a multiple of `microbatches`.
        """
        if plan.num_stages != 1 or any(len(r.stages[0].ranks) != 1 for r in plan.replicas):
            raise ValueError("a data placement comes from a plan with TP = PP = 1")
        if plan.total_microbatches % microbatches:
            raise ValueError(
                f"{plan.total_microbatches} micro-batches are not shards of {microbatches}"
            )
        rank_of = {d: r for r, d in enumerate(devices)}
        items: list[list[int]] = [[] for _ in devices]
        for (mb, _), replica in sorted(plan.placement().items()):
            device = plan.replicas[replica].stages[0].ranks[0]
            if device not in rank_of:
                raise ValueError(f"the plan uses device {device}, not in the world {devices}")
            items[rank_of[device]].append(mb)
        return cls(plan.total_microbatches // microbatches, microbatches, tuple(map(tuple, items)))

    @property
    def total(self) -> int:
        """S·M: micro-batches per iteration (the global batch)."""
        return self.shards * self.microbatches

    @property
    def world_size(self) -> int:
        return len(self.items)

    def key(self, item: int) -> tuple[int, int]:
        """(shard, micro-batch index) of global id `item`: what its data and seed are keyed by."""
        return divmod(item, self.microbatches)

    def counts(self) -> tuple[int, ...]:
        """Micro-batches per rank."""
        return tuple(len(ids) for ids in self.items)

    def describe(self) -> str:
        """One line: each rank's micro-batch count."""
        return " ".join(f"r{r}:{n}" for r, n in enumerate(self.counts()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "shards": self.shards,
            "microbatches": self.microbatches,
            "items": [list(ids) for ids in self.items],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataPlacement:
        """Inverse of `to_dict`.

        Raises:
            ValueError / KeyError / TypeError: a malformed placement.
        """
        return cls(
            int(data["shards"]),
            int(data["microbatches"]),
            tuple(tuple(int(k) for k in ids) for ids in data["items"]),
        )
