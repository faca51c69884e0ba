"""`GenerationSpec`: everything a trainer of one generation needs, written as JSON by the
coordinator before the generation starts (and before its shadows pre-initialize), read by each
trainer at start or at promotion. Addresses are data here: a trainer connects where the spec
says, never to an assumed host."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from unbroken.recovery import RestoreMode

__all__ = ["GenerationSpec"]


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    config: dict[str, Any]
    run_dir: str
    run_name: str
    store_host: str
    store_port: int
    generation: int
    world_size: int
    restore: RestoreMode
    """How this generation's trainers obtain their state (the coordinator's one decision,
    `unbroken.recovery.restore_mode`)."""
    retains_state: bool
    """The job keeps its state in state managers (in-place recovery): trainers attach it."""
    search_path: list[str] = field(default_factory=list)
    state_sockets: dict[str, str] = field(default_factory=dict)
    """rank -> state manager socket (when `retains_state`)."""
    debug: bool = False
    """The job runs with --debug (tracebacks on the terminal)."""
    devices: list[int] = field(default_factory=list)
    """rank -> the device it runs on, numbered as the job's ranks at launch (empty: rank r on
    device r). A world that lost a device keeps its survivors' devices (issue 18)."""
    placement: dict[str, Any] | None = None
    """Who computes which logical micro-batch (`unbroken.parallel.DataPlacement.to_dict`);
    None: rank r computes shard r."""
    plan_epoch: int = 0
    """The epoch of `placement` in the job store (`JobStore.placement_epoch`)."""
    plan: dict[str, Any] | None = None
    """The engine plan this generation runs (`unbroken.parallel.ParallelPlan.to_dict`, ranks of
    this world); None: the config's (`engine.build.job_plan`). A pipeline job that lost a
    device runs a smaller one (issue 18)."""
    plan_before: dict[str, Any] | None = None
    """With `restore` RESHARD: the plan whose layout the devices' retained state holds (ranks of
    this world, the same devices); the trainers move their state from it to `plan`."""
    device_registry: str = ""
    """The directory of the devices' health on CPU ranks (`unbroken.devices`)."""

    def device_of(self, rank: int) -> int:
        """The device `rank` runs on."""
        return self.devices[rank] if self.devices else rank

    def data_placement(self):
        """`placement` as a `DataPlacement` (None: rank r computes shard r)."""
        if self.placement is None:
            return None
        from unbroken.parallel import DataPlacement

        return DataPlacement.from_dict(self.placement)

    def engine_plan(self):
        """`plan` as a `ParallelPlan` (None: the config's)."""
        if self.plan is None:
            return None
        from unbroken.parallel import ParallelPlan

        return ParallelPlan.from_dict(self.plan)

    def engine_plan_before(self):
        """`plan_before` as a `ParallelPlan` (None without one)."""
        if self.plan_before is None:
            return None
        from unbroken.parallel import ParallelPlan

        return ParallelPlan.from_dict(self.plan_before)

    @property
    def resume(self) -> bool:
        """A restart after a failure (not the job's first generation)."""
        return self.restore is not RestoreMode.FRESH

    def to_json(self) -> str:
        fields = {s: getattr(self, s) for s in self.__slots__}
        fields["restore"] = self.restore.value
        return json.dumps(fields, indent=1)

    @classmethod
    def from_json(cls, text: str) -> GenerationSpec:
        fields = json.loads(text)
        fields["restore"] = RestoreMode(fields["restore"])
        return cls(**fields)
