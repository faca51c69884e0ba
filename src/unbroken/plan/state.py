"""What the planner is told: the devices, their health, the running plan and the workload.

Owns `ClusterState`, the planner's only input (ResiHP §6): every device with its status
(healthy, slow with a measured compute speed p_i and link speed, lost), its memory capacity and
its node; the `ParallelPlan` the job runs now; the per-layer workload (`Workload`) and the
fabric (`Fabric`). A state is a value: `with_lost`, `with_slow` and `apply` (a detector's
`DetectionEvent`) return new states, so the coordinator can build one from the detector's
reports without mutating anything.

[Note: speeds] `speed` is p_i of ResiHP §6.1: the device's compute throughput relative to its
healthy peak, in (0, 1]; a compute fail-slow detected as "x times slower" is p = 1/x.
`link_speed` is the same ratio for the device's network link (its NIC): every inter-node
message it sends or receives takes 1/link_speed as long. A lost device has neither.

Devices that hold no stage in the plan and are not lost are standbys (§6.1: node-local
standbys reused for later failures).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from unbroken.detect.events import DetectionEvent, DetectionKind
from unbroken.parallel import ParallelPlan
from unbroken.plan.workload import Fabric, Workload

__all__ = ["ClusterState", "Device", "DeviceStatus"]


class DeviceStatus(enum.StrEnum):
    """Health of one device."""

    HEALTHY = "healthy"
    SLOW = "slow"
    """Runs, but its compute or its link is slower than its healthy peak ([Note: speeds])."""
    LOST = "lost"
    """Fail-stop: gone for good; no plan may use it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """One accelerator as the planner sees it."""

    rank: int
    """Global rank id (the plan's rank numbering)."""
    node: int
    """Node (host) the device sits in; TP groups and standbys are node-local."""
    memory_bytes: float
    """Usable device memory."""
    status: DeviceStatus = DeviceStatus.HEALTHY
    speed: float = 1.0
    """p_i: compute throughput relative to healthy, in (0, 1] ([Note: speeds])."""
    link_speed: float = 1.0
    """Network throughput relative to healthy, in (0, 1]."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", DeviceStatus(self.status))
        if self.rank < 0 or self.node < 0 or self.memory_bytes <= 0:
            raise ValueError(f"device {self.rank}: rank and node >= 0, memory > 0 required")
        if not (0 < self.speed <= 1 and 0 < self.link_speed <= 1):
            raise ValueError(
                f"device {self.rank}: speed {self.speed} and link_speed {self.link_speed} "
                "must be in (0, 1]"
            )
        degraded = self.speed < 1 or self.link_speed < 1
        if self.status is DeviceStatus.HEALTHY and degraded:
            raise ValueError(f"device {self.rank} is healthy but has a speed below 1")

    @property
    def alive(self) -> bool:
        """True unless lost."""
        return self.status is not DeviceStatus.LOST


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterState:
    """The planner's input; see the module docstring."""

    devices: tuple[Device, ...]
    plan: ParallelPlan
    """The plan the job runs now (actions optional)."""
    workload: Workload
    fabric: Fabric
    _by_rank: Mapping[int, Device] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        devices = tuple(sorted(self.devices, key=lambda d: d.rank))
        object.__setattr__(self, "devices", devices)
        by_rank = {d.rank: d for d in devices}
        if len(by_rank) != len(devices):
            raise ValueError("two devices share a rank")
        missing = sorted(set(self.plan.ranks) - set(by_rank))
        if missing:
            raise ValueError(f"the plan uses ranks {missing} that no device describes")
        if self.plan.num_layers != self.workload.num_layers:
            raise ValueError(
                f"the plan has {self.plan.num_layers} layers, the workload "
                f"{self.workload.num_layers}"
            )
        if self.plan.virtual_stages != 1:
            raise ValueError("the planner handles plans without virtual stages (v = 1)")
        object.__setattr__(self, "_by_rank", by_rank)

    # -- queries ---------------------------------------------------------------------------
    def device(self, rank: int) -> Device:
        """The device of `rank`."""
        return self._by_rank[rank]

    @property
    def lost(self) -> frozenset[int]:
        """Ranks of lost devices."""
        return frozenset(d.rank for d in self.devices if not d.alive)

    @property
    def standbys(self) -> tuple[int, ...]:
        """Live devices that hold no stage in the current plan."""
        used = set(self.plan.ranks)
        return tuple(d.rank for d in self.devices if d.alive and d.rank not in used)

    def slowdown(self) -> dict[int, float]:
        """rank -> 1 / p_i for every device slower than healthy (the simulator's slowdown)."""
        return {d.rank: 1.0 / d.speed for d in self.devices if d.alive and d.speed < 1}

    # -- new states --------------------------------------------------------------------------
    def with_plan(self, plan: ParallelPlan) -> ClusterState:
        """The same devices running `plan`."""
        return replace(self, plan=plan)

    def with_workload(self, workload: Workload) -> ClusterState:
        """The same devices and plan priced with `workload` (a live job's measured costs)."""
        return replace(self, workload=workload)

    def with_lost(self, *ranks: int) -> ClusterState:
        """The state after `ranks` fail-stop."""
        return self._update({r: {"status": DeviceStatus.LOST} for r in ranks})

    def with_healthy(self, *ranks: int) -> ClusterState:
        """The state after `ranks` (lost or slow) are whole again (a node came back)."""
        healthy = {"status": DeviceStatus.HEALTHY, "speed": 1.0, "link_speed": 1.0}
        return self._update({r: healthy for r in ranks})

    def with_slow(
        self, rank: int, *, speed: float | None = None, link_speed: float | None = None
    ) -> ClusterState:
        """The state after `rank` became slow (compute `speed`, `link_speed`; None keeps)."""
        old = self.device(rank)
        new = {
            "status": DeviceStatus.SLOW,
            "speed": old.speed if speed is None else speed,
            "link_speed": old.link_speed if link_speed is None else link_speed,
        }
        if new["speed"] >= 1 and new["link_speed"] >= 1:
            new = {"status": DeviceStatus.HEALTHY, "speed": 1.0, "link_speed": 1.0}
        return self._update({rank: new})

    def apply(self, event: DetectionEvent) -> ClusterState:
        """The state after a detector's report (`unbroken.detect.events`).

        A fail-stop marks the rank lost; a fail-slow with factor x sets p = 1/x on the
        compute (cause "compute") or the link (cause "comm").

        Raises:
            ValueError: the event names no rank, or a fail-slow has no factor > 1.
        """
        if event.rank is None:
            raise ValueError("a detection without a localized rank cannot be planned around")
        if event.kind is DetectionKind.FAIL_STOP:
            return self.with_lost(event.rank)
        if event.factor is None or event.factor <= 1:
            raise ValueError(f"fail-slow on rank {event.rank} needs a factor > 1")
        if event.cause == "comm":
            return self.with_slow(event.rank, link_speed=1.0 / event.factor)
        return self.with_slow(event.rank, speed=1.0 / event.factor)

    def _update(self, changes: Mapping[int, Mapping[str, Any]]) -> ClusterState:
        unknown = sorted(set(changes) - set(self._by_rank))
        if unknown:
            raise ValueError(f"no device has rank {unknown}")
        devices = tuple(
            replace(d, **changes[d.rank]) if d.rank in changes else d for d in self.devices
        )
        return replace(self, devices=devices)

    @classmethod
    def healthy(
        cls,
        plan: ParallelPlan,
        workload: Workload,
        fabric: Fabric,
        *,
        memory_bytes: float,
        spare: Iterable[int] = (),
    ) -> ClusterState:
        """Every rank of `plan` (and the `spare` ranks) healthy, rank r on node
        ``r // fabric.gpus_per_node``."""
        ranks = sorted(set(plan.ranks) | set(spare))
        devices = tuple(
            Device(rank=r, node=r // fabric.gpus_per_node, memory_bytes=memory_bytes) for r in ranks
        )
        return cls(devices=devices, plan=plan, workload=workload, fabric=fabric)

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the `unbroken plan` input format)."""
        return {
            "devices": [
                {
                    "rank": d.rank,
                    "node": d.node,
                    "memory_bytes": d.memory_bytes,
                    "status": d.status.value,
                    "speed": d.speed,
                    "link_speed": d.link_speed,
                }
                for d in self.devices
            ],
            "plan": self.plan.to_dict(),
            "workload": self.workload.to_dict(),
            "fabric": self.fabric.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterState:
        """Inverse of `to_dict`.

        Raises:
            ValueError / KeyError / TypeError: a malformed state.
        """
        return cls(
            devices=tuple(Device(**d) for d in data["devices"]),
            plan=ParallelPlan.from_dict(data["plan"]),
            workload=Workload.from_dict(data["workload"]),
            fabric=Fabric.from_dict(data["fabric"]),
        )
