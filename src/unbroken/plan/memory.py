"""Memory feasibility of a layout: every device holds its shards, optimizer state and the
activations of the micro-batches its stage keeps in flight.

Owns the planner's memory rule (ResiHP §6.1 k_min, §6.3 MemoryFeasible). The bytes come from
`Workload.device_bytes`; a group's in-flight count is its layout bound, which its 1F1B list
schedule never exceeds (`unbroken.plan.schedule`), so a layout whose bounds fit fits at every
instant, migrated micro-batches included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from unbroken.plan.layout import Group, Layout
from unbroken.plan.state import ClusterState

__all__ = ["MemoryProblem", "capacity", "fits", "max_bound", "memory_problems", "need"]


@dataclass(frozen=True, slots=True)
class MemoryProblem:
    """A group whose devices cannot hold what the layout gives them."""

    group: Group
    need_bytes: float
    have_bytes: float

    def __str__(self) -> str:
        d, s = self.group
        return (
            f"replica {d} stage {s}: needs {self.need_bytes / 2**30:.1f} GiB per device, "
            f"has {self.have_bytes / 2**30:.1f} GiB"
        )


def capacity(state: ClusterState, ranks: Sequence[int]) -> float:
    """The smallest memory among `ranks`."""
    return min(state.device(r).memory_bytes for r in ranks)


def need(state: ClusterState, layers: tuple[int, int], tp: int, inflight: int) -> float:
    """Bytes per device of a TP group of `tp` holding `layers` with `inflight` micro-batches."""
    return state.workload.device_bytes(layers, tp, inflight)


def max_bound(state: ClusterState, ranks: Sequence[int], layers: tuple[int, int]) -> int:
    """Most in-flight micro-batches a group of `ranks` can hold next to `layers` (0: the state
    alone does not fit)."""
    return state.workload.max_inflight(layers, len(ranks), capacity(state, ranks))


def memory_problems(state: ClusterState, layout: Layout) -> list[MemoryProblem]:
    """Every group of `layout` that does not fit its devices."""
    out = []
    for (d, s), g in layout.groups():
        want = need(state, g.layers, g.tp, layout.inflight[d][s])
        have = capacity(state, g.ranks)
        if want > have:
            out.append(MemoryProblem((d, s), want, have))
    return out


def fits(state: ClusterState, layout: Layout) -> bool:
    """True when every group fits its devices."""
    return not memory_problems(state, layout)
