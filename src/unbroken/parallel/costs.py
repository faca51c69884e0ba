"""What each action of a plan costs: the inputs of the dry-run simulator.

Owns the cost model the simulator, the fail-slow detector and the cluster simulator share:
compute time per (stage, kind[, micro-batch]) or per `Work` item, point-to-point time per link,
and the gradient-reduction and optimizer terms. Costs are in any time unit, as long as all of
them use the same one.

[Note: backward costs] Costs name three compute kinds: F, B (input gradient) and W (weight
gradient). A plan whose B is not split (no W for the same stage and micro-batch on that rank)
runs a *full* backward, charged cost(B) + cost(W); a zero-bubble plan charges them separately.
So one cost table times every schedule consistently; give W = 0 (or omit it) when the split does
not matter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from unbroken.parallel.actions import ActionKind

__all__ = ["Costs", "NodeLinks", "Work"]


@dataclass(frozen=True, slots=True)
class Work:
    """One compute action as the cost model sees it."""

    replica: int
    """Replica whose group executes it (after migration)."""
    stage: int
    """Virtual stage."""
    kind: ActionKind
    """F, B or W (see [Note: backward costs])."""
    microbatch: int
    """Global micro-batch id, for variable-length micro-batches (ResiHP eq. 1)."""
    layers: tuple[int, int]
    """Half-open layer range of the stage on the executing replica."""
    ranks: tuple[int, ...]
    """The executing TP group."""


@dataclass(frozen=True, slots=True)
class NodeLinks:
    """Point-to-point time from a two-level topology: ranks ``r // ranks_per_node`` share a node."""

    ranks_per_node: int
    intra_bandwidth: float
    """Bytes per time unit within a node (NVLink)."""
    inter_bandwidth: float
    """Bytes per time unit across nodes (InfiniBand)."""
    intra_latency: float = 0.0
    inter_latency: float = 0.0

    def __call__(self, src: int, dst: int, nbytes: float) -> float:
        """Time to move `nbytes` from `src` to `dst`."""
        if src // self.ranks_per_node == dst // self.ranks_per_node:
            return self.intra_latency + nbytes / self.intra_bandwidth
        return self.inter_latency + nbytes / self.inter_bandwidth


ComputeCosts = Mapping[tuple, float] | Callable[[Work], float]


@dataclass(frozen=True, slots=True, kw_only=True)
class Costs:
    """Per-action costs for `unbroken.parallel.simulate.simulate`."""

    compute: ComputeCosts
    """Either a callable ``Work -> time`` or a dict keyed by ``(stage, kind, microbatch)`` or
    ``(stage, kind)`` (looked up in that order; kind as ``"F"``/``"B"``/``"W"`` or `ActionKind`).
    A missing W costs 0; a missing F or B is an error."""
    link: float | Callable[[int, int, float], float] = 0.0
    """Point-to-point time: a constant per whole message (a chunk of 1/N of the message costs
    1/N of it), or a callable ``(src, dst, bytes) -> time`` such as `NodeLinks`."""
    message_bytes: float = 1.0
    """Bytes of one activation or gradient message between stages, before chunking."""
    reduce_grad: float | Mapping[int, float] = 0.0
    """Gradient reduction time, constant or per physical stage; it is a collective over that
    stage's ranks in every replica."""
    opt_step: float = 0.0
    """Optimizer step time per rank."""
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """rank -> factor >= 1 for fail-slow devices; a TP group computes at its slowest member's
    pace (ResiHP §6.1)."""
    step_lead: Mapping[int, float] = field(default_factory=dict)
    """rank -> seconds it starts its list late: in a steady-state iteration, the part of its
    previous optimizer step that a healthy rank's does not have (a slow device steps slowly
    too; the scheduler's replay, `unbroken.plan.score`). Missing: 0."""

    def compute_time(self, work: Work) -> float:
        """Base cost of one compute action, before slowdown.

        Raises:
            ValueError: F or B has no cost.
        """
        if callable(self.compute):
            return float(self.compute(work))
        for key in ((work.stage, work.kind, work.microbatch), (work.stage, work.kind)):
            if key in self.compute:
                return float(self.compute[key])
        if work.kind is ActionKind.W:
            return 0.0
        raise ValueError(f"no compute cost for stage {work.stage} kind {work.kind}")

    def transfer_time(self, src: int, dst: int, num_chunks: int) -> float:
        """Time for one chunk of a message split into `num_chunks` to cross src -> dst."""
        if callable(self.link):
            return float(self.link(src, dst, self.message_bytes / num_chunks))
        return float(self.link) / num_chunks

    def reduce_time(self, stage: int) -> float:
        """Gradient reduction time of physical stage `stage`."""
        if isinstance(self.reduce_grad, Mapping):
            return float(self.reduce_grad.get(stage, 0.0))
        return float(self.reduce_grad)

    def slowness(self, ranks: tuple[int, ...]) -> float:
        """Slowdown factor of a group: its slowest member's."""
        return max((self.slowdown.get(r, 1.0) for r in ranks), default=1.0)
