"""Step 1 (ResiHP §6.1): selective device exclusion inside affected TP groups.

Owns the TP half of the planner. A TP group G is *affected* when one of its devices is lost or
computes slower than its peak (p_i < 1). Its executable set is G' = G minus the lost devices,
plus the node-local standbys of G's node(s) (devices an earlier exclusion left unassigned). The
candidate degrees are the powers of two k <= |G'| whose top-k subset S_k (devices ranked by p_i)
can hold the stage: every device its shards of the stage's layers, their gradients and optimizer
state, and the activations of the stage's in-flight micro-batches (the smallest such k is
k_min, `unbroken.plan.memory`). The group becomes

    S* = argmax over k of  k * min_{i in S_k} p_i          (eq. 4)

ties going to the current degree, then to the larger k (no resharding, more devices kept).
Devices of G' left out stay online as standbys of their node, for later failures there.

A group with no candidate (fewer executable devices than k_min) is lost, and so is its replica
as a pipeline. [Interpretation] The plan IR has no replica with a missing stage, so a broken
replica's surviving groups are recombined with other broken replicas' groups (and groups of
node-local standbys) into complete pipelines where possible — a replica lost at stage 1 and
another lost at stage 0 make one. [Extension] What is left then returns to the standby pool,
and pipelines are formed from the pool itself, every stage a node-local group of one degree k
(the largest k that gives a complete, memory-feasible pipeline): four survivors of a TP-4
replica become a pipeline of two TP-2 stages. Standbys that fit nowhere stay standbys. The
micro-batches of dissolved replicas are given to the survivors (the global batch is kept;
this is Algorithm 1's fail-stop eviction at whole-replica granularity, which step 3 then
rebalances per stage). All migrations are dropped: step 3 recomputes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from unbroken.parallel import Replica, StageGroup
from unbroken.plan.layout import Group, Layout
from unbroken.plan.memory import capacity, need
from unbroken.plan.state import ClusterState

__all__ = ["Candidate", "Exclusion", "NoPlanError", "Selection", "exclude", "select_subgroup"]


class NoPlanError(RuntimeError):
    """The surviving devices cannot form even one complete pipeline."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One feasible degree of eq. 4."""

    k: int
    ranks: tuple[int, ...]
    score: float
    """k * min p over the subset."""


@dataclass(frozen=True, slots=True)
class Selection:
    """What step 1 decided for one affected group."""

    group: Group
    before: tuple[int, ...]
    after: tuple[int, ...] | None
    """The new TP group (None: lost)."""
    candidates: tuple[Candidate, ...]
    standby: tuple[int, ...]
    """Live devices of G' left out (node-local standbys)."""

    def describe(self) -> str:
        d, s = self.group
        table = ", ".join(f"k={c.k}: {c.score:.2f}" for c in self.candidates) or "none"
        result = "lost" if self.after is None else f"TP {len(self.after)} {list(self.after)}"
        return f"replica {d} stage {s}: {list(self.before)} -> {result} (k*min p: {table})"


@dataclass(frozen=True, slots=True)
class Exclusion:
    """The outcome of step 1."""

    layout: Layout
    selections: tuple[Selection, ...]
    standbys: tuple[int, ...]
    dissolved: tuple[int, ...] = ()
    """Replicas of the input layout that no longer exist as pipelines."""
    recombined: int = 0
    """Pipelines rebuilt from the groups of broken replicas."""
    notes: tuple[str, ...] = field(default=())


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def select_subgroup(
    state: ClusterState,
    executable: Sequence[int],
    layers: tuple[int, int],
    inflight: int,
    current: int,
) -> tuple[tuple[int, ...] | None, tuple[Candidate, ...]]:
    """Eq. 4 over `executable` (G'): the chosen subgroup (TP order: by rank) and the table.

    Args:
        state: the cluster (speeds p_i and memory).
        executable: G', the live members and the node-local standbys.
        layers: the stage's layers.
        inflight: micro-batches whose activations the stage keeps.
        current: the group's degree now (wins ties).
    """
    ranked = sorted(executable, key=lambda r: (-state.device(r).speed, r))
    candidates = []
    for k in _powers_of_two(len(ranked)):
        subset = tuple(ranked[:k])
        if need(state, layers, k, inflight) <= capacity(state, subset):
            score = k * min(state.device(r).speed for r in subset)
            candidates.append(Candidate(k, tuple(sorted(subset)), score))
    if not candidates:
        return None, ()
    best = max(candidates, key=lambda c: (round(c.score, 12), c.k == current, c.k))
    return best.ranks, tuple(candidates)


class _Pool:
    """Node-local standbys: live devices outside every group."""

    def __init__(self, state: ClusterState, layout: Layout) -> None:
        used = set(layout.ranks)
        self.state = state
        self.by_node: dict[int, list[int]] = defaultdict(list)
        for d in state.devices:
            if d.alive and d.rank not in used:
                self.by_node[d.node].append(d.rank)

    def near(self, ranks: Sequence[int]) -> list[int]:
        nodes = {self.state.device(r).node for r in ranks}
        return sorted(r for n in nodes for r in self.by_node[n])

    def take(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            node = self.by_node[self.state.device(r).node]
            if r in node:
                node.remove(r)

    def give(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            if self.state.device(r).alive:
                self.by_node[self.state.device(r).node].append(r)

    def group_for(self, layers: tuple[int, int], inflight: int) -> tuple[int, ...] | None:
        """The best eq.-4 group of one node's standbys for a stage, taken from the pool."""
        best: tuple[float, tuple[int, ...]] | None = None
        for node in sorted(self.by_node):
            chosen, cands = select_subgroup(self.state, self.by_node[node], layers, inflight, 0)
            if chosen is not None:
                score = max(c.score for c in cands)
                if best is None or score > best[0]:
                    best = (score, chosen)
        if best is None:
            return None
        self.take(best[1])
        return best[1]

    def all(self) -> tuple[int, ...]:
        return tuple(sorted(r for rs in self.by_node.values() for r in rs))

    def exact(self, k: int, layers: tuple[int, int], inflight: int) -> tuple[int, ...] | None:
        """k standbys of one node (the fastest; the node with the fastest such set) that can
        hold a stage, taken from the pool."""
        best: tuple[float, tuple[int, ...]] | None = None
        for node in sorted(self.by_node):
            ranked = sorted(self.by_node[node], key=lambda r: (-self.state.device(r).speed, r))
            subset = tuple(ranked[:k])
            if len(subset) < k or need(self.state, layers, k, inflight) > capacity(
                self.state, subset
            ):
                continue
            score = min(self.state.device(r).speed for r in subset)
            if best is None or score > best[0]:
                best = (score, tuple(sorted(subset)))
        if best is not None:
            self.take(best[1])
        return None if best is None else best[1]

    def pipeline(self, layers: list[tuple[int, int]]) -> list[tuple[int, ...]] | None:
        """A complete pipeline of standbys, every stage a node-local group of one degree (the
        largest that works), or None."""
        pp = len(layers)
        for k in reversed(_powers_of_two(len(self.all()) // pp)):
            stages = []
            for s, lay in enumerate(layers):
                group = self.exact(k, lay, pp - s)
                if group is None:
                    break
                stages.append(group)
            if len(stages) == pp:
                return stages
            self.give([r for g in stages for r in g])
        return None


def _affected(state: ClusterState, ranks: Sequence[int]) -> bool:
    return any(not state.device(r).alive or state.device(r).speed < 1 for r in ranks)


def _reselect(state: ClusterState, layout: Layout, pool: _Pool):
    """Eq. 4 on every affected group; returns the new groups ((d, s) -> ranks or None)."""
    groups: dict[Group, tuple[int, ...] | None] = {}
    selections = []
    for (d, s), g in layout.groups():
        if not _affected(state, g.ranks):
            groups[(d, s)] = g.ranks
            continue
        live = [r for r in g.ranks if state.device(r).alive]
        near = pool.near(g.ranks)
        chosen, table = select_subgroup(state, live + near, g.layers, layout.inflight[d][s], g.tp)
        pool.give(live)
        if chosen is not None:
            pool.take(chosen)
        left = tuple(r for r in live + near if chosen is None or r not in chosen)
        groups[(d, s)] = chosen
        selections.append(Selection((d, s), g.ranks, chosen, table, left))
    return groups, selections


def _fits(state: ClusterState, ranks, layers: tuple[int, int], inflight: int) -> bool:
    return need(state, layers, len(ranks), inflight) <= capacity(state, ranks)


def _complete(state, spare, pool: _Pool, base: int, layers) -> list[tuple[int, ...]] | None:
    """One pipeline with the layer split `layers` of broken replica `base`: its own surviving
    groups, other broken replicas' groups that can hold the missing stages, then groups of
    standbys; None (everything given back) when a stage cannot be filled."""
    pp = len(layers)
    stages, taken, made = [], [], []
    for s in range(pp):
        mine = [i for i, (d, _) in enumerate(spare[s]) if d == base]
        other = [i for i, (_, r) in enumerate(spare[s]) if _fits(state, r, layers[s], pp - s)]
        pick = (mine or other or [None])[0]
        group = None
        if pick is not None:
            entry = spare[s].pop(pick)
            taken.append((s, entry))
            group = entry[1]
        else:
            group = pool.group_for(layers[s], pp - s)
            made += [group] if group is not None else []
        if group is None:
            for t, entry in taken:
                spare[t].append(entry)
            pool.give([r for g in made for r in g])
            return None
        stages.append(group)
    return stages


def _recombine(state: ClusterState, layout: Layout, groups, broken: list[int], pool: _Pool):
    """Complete pipelines out of broken replicas' surviving groups and the pool."""
    pp = layout.pp
    spare: dict[int, list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for d in broken:
        for s in range(pp):
            if groups[(d, s)] is not None:
                spare[s].append((d, groups[(d, s)]))
    rebuilt = []
    for base in sorted(broken, key=lambda d: -sum(groups[(d, s)] is not None for s in range(pp))):
        layers = [layout.group(base, s).layers for s in range(pp)]
        stages = _complete(state, spare, pool, base, layers)
        if stages is not None:
            rebuilt.append(Replica(tuple(StageGroup(r, layers[s]) for s, r in enumerate(stages))))
    for leftovers in spare.values():
        pool.give([r for _, ranks in leftovers for r in ranks])
    layers = [layout.group(0, s).layers for s in range(pp)]
    while (stages := pool.pipeline(layers)) is not None:
        rebuilt.append(Replica(tuple(StageGroup(r, layers[s]) for s, r in enumerate(stages))))
    return rebuilt


def _spread(total: int, parts: int) -> tuple[int, ...]:
    return tuple(total // parts + (1 if i < total % parts else 0) for i in range(parts))


def exclude(state: ClusterState, layout: Layout) -> Exclusion:
    """Step 1 on `layout` (see the module docstring).

    Raises:
        NoPlanError: no complete pipeline can be formed from the live devices.
    """
    pool = _Pool(state, layout)
    groups, selections = _reselect(state, layout, pool)
    broken = [d for d in range(layout.dp) if any(groups[(d, s)] is None for s in range(layout.pp))]
    kept = [d for d in range(layout.dp) if d not in broken]
    replicas = [
        Replica(
            tuple(
                StageGroup(groups[(d, s)], g.layers)
                for s, g in enumerate(layout.replicas[d].stages)
            )
        )
        for d in kept
    ]
    rebuilt = _recombine(state, layout, groups, broken, pool) if broken else []
    if not replicas and not rebuilt:
        raise NoPlanError(
            f"no complete pipeline: {len(state.lost)} devices lost, "
            f"{len(pool.all())} standbys cannot hold every stage"
        )
    counts = (
        tuple(layout.microbatches[d] for d in kept)
        if not broken
        else _spread(sum(layout.microbatches), len(replicas) + len(rebuilt))
    )
    inflight = [layout.inflight[d] for d in kept]
    inflight += [tuple(layout.pp - s for s in range(layout.pp))] * len(rebuilt)
    new = Layout(
        replicas=tuple(replicas + rebuilt),
        microbatches=counts,
        inflight=tuple(inflight),
    )
    notes = []
    if broken:
        notes.append(
            f"replicas {broken} lost a stage; {len(rebuilt)} pipeline(s) rebuilt from their "
            f"groups and standbys; {len(broken) - len(rebuilt)} dissolved, their micro-batches "
            f"spread over the {new.dp} remaining"
        )
    return Exclusion(
        layout=new,
        selections=tuple(selections),
        standbys=pool.all(),
        dissolved=tuple(broken),
        recombined=len(rebuilt),
        notes=tuple(notes),
    )
