"""Predicted iteration time of a layout: `unbroken.parallel.simulate` on a reduced plan.

Owns the planner's one way of timing a candidate (ResiHP §5.2 eq. 2, "one model of the
schedule"): the layout's action lists (`unbroken.plan.schedule`) replayed by the dry-run
simulator with costs from the workload model (`unbroken.plan.workload`) and the cluster state
(slow devices, slow links). Nothing here adds up pipeline times by a formula of its own.

[Note: reduced simulation] Timing a 256- or 4,096-GPU plan action by action takes seconds, and
the planner times dozens of candidates, so each candidate is simulated on a smaller plan that the
simulator provably times the same:

- *One rank per TP group.* Every member of a group runs the group's compute together (the
  simulator syncs them) and takes part in every message between two groups (chunk c goes from
  sender position c·a/N to receiver position c·b/N, N = max(a, b)), all chunks posted at the same
  instant. With eager sends a group's batch therefore ends at the latest chunk's arrival: the
  group collapses to one rank whose message takes the slowest chunk's time, and whose slowdown
  is the group's (its slowest member's).
- *One pipeline per component.* Replicas not linked by migrations meet only at REDUCE_GRAD,
  the last collective of an iteration, whose cost depends on the stage alone; so the iteration
  time is the largest of the components' iteration times, each simulated as a plan of its own.
- *One simulation per distinct component.* Components with equal costs, links, bounds and
  micro-batch counts have equal timelines: they are simulated once (cached by that signature
  for the scorer's lifetime), and a replica's timeline is read off its representative's.

[Note: reduction-free key] The gradient reduction and the optimizer step are every rank's last
two actions: a stage's REDUCE_GRAD starts when the last of its groups in the component is ready,
and nothing waits for it but that rank's OPT_STEP. So the cache keeps, per stage, when its
reduction starts, and the iteration time for any reduction and step costs is
max_s (start_s + reduce_s) + opt, added in the simulator's own order (bit for bit its time;
checked against it on every simulation). A pipeline timed alone (micro-batch balancing: the
reduction of one replica) and inside its layout (the reduction of all) is simulated once.

[Note: step lead] The replay is one steady-state iteration: a rank's optimizer step runs
after the world-wide sync and before its next compute, and a slow device steps slowly too. So
a slow group starts its list late by its own step (its parameters x `step_s_per_param`) times
its slowdown less one (`Scorer.lead`, `Costs.step_lead`), and every rank's closing step lasts
the healthy `opt` of the layout: the fast replicas' compute overlaps a slow device's long step,
and a micro-batch left on the slow device waits for it. Its own step, not the layout's largest:
a slow stage that gives layers away steps fewer parameters. The lead is part of each group's
cost-table entry, so of the cache key.

That overlap needs ranks that do not meet at the boundary. A live job's ranks do, every
iteration (the placement switch's broadcast, the audit's hash gather at `train.hash_every` 1):
measured on TP 2 x DP 2 with the slow replica emptied, 0.14 s of compute and a 0.19 s slow step
made a 0.35 s iteration (stop 49). Under `Workload.boundary_sync` (the coordinator's workload)
no group leads, and the iteration ends when the slowest step does: the layout's time gains
`max(0, max_g(slowdown_g x own step_g) - opt)` (`Scorer.boundary_s`). Micro-batch balancing
times replicas without it (`time(boundary=False)`): the slow step ends the iteration whatever
the counts, so the counts only even out the compute.

Receive placement ([Note: receive placement] in `unbroken.plan.schedule`): a component with a
slow link (a device below full link speed) takes the arrival placement when the simulator's
blocking replay completes, else the instant one; other components take the instant placement
directly — on healthy links the two differ by less than 0.1 % of the iteration on the shapes
measured (docs/scheduler.md) and the instant one needs no extra replay.

`tests/plan/test_score.py` checks the reduced time against `simulate` on the full plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from unbroken.parallel import (
    ActionKind,
    Costs,
    Migration,
    ParallelPlan,
    Replica,
    StageGroup,
    Work,
    p2p_chunks,
    simulate,
)
from unbroken.plan.layout import Group, Layout
from unbroken.plan.schedule import (
    ComputeCost,
    LinkCost,
    component_actions,
    components,
    to_plan,
    work_lists,
)
from unbroken.plan.state import ClusterState
from unbroken.plan.workload import ring_s

__all__ = ["GroupTrace", "Scorer"]


@dataclass(frozen=True, slots=True)
class GroupTrace:
    """When one group ran its forwards and backwards in the simulated iteration."""

    forwards: tuple[tuple[int, float, float], ...]
    """(micro-batch, start, end) of each forward, in run order."""
    backwards: tuple[tuple[int, float, float], ...]


@dataclass(frozen=True, slots=True)
class _Component:
    """A component simulated once: when each stage's gradient reduction starts, and its groups'
    traces by local ids ([Note: reduction-free key])."""

    reduce_start: Mapping[int, float]
    """Physical stage -> start of its REDUCE_GRAD (the last of its groups' ready times)."""
    traces: Mapping[Group, GroupTrace]
    safe: bool
    """True when the component's lists use the instant-transfer receive placement
    ([Note: receive placement] in `unbroken.plan.schedule`)."""

    def time(self, reduce: Mapping[int, float], opt: float) -> float:
        """The iteration time with these reduction and step costs: each stage's reduction
        then its step, as the simulator adds them (the step is every rank's last action)."""
        return max(
            (start + float(reduce.get(s, 0.0))) + float(opt)
            for s, start in self.reduce_start.items()
        )


@dataclass(slots=True)
class Scorer:
    """Times layouts of one cluster state; see [Note: reduced simulation]."""

    state: ClusterState
    cache: dict = field(default_factory=dict)
    """Component signature -> result; may be shared between scorers of one job."""
    simulations: int = 0
    """Simulator runs so far (cache misses)."""
    _group: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    _slow: dict[tuple[int, ...], float] = field(default_factory=dict)
    _message: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = field(default_factory=dict)
    _alone: dict[tuple, tuple] = field(default_factory=dict)
    """(replica, micro-batches, bounds) -> `_reduced_key` of a component of that replica alone
    (at 4,096 GPUs every candidate has 64 of them, almost all unchanged)."""

    # -- prices --------------------------------------------------------------------------------
    def base_cost(self, g: StageGroup) -> tuple[float, float]:
        """(forward, backward) of one micro-batch on group `g` at full speed."""
        key = (g.ranks, g.layers)
        if key not in self._group:
            nodes = {self.state.device(r).node for r in g.ranks}
            self._group[key] = self.state.workload.stage_compute_s(
                g.layers, g.tp, self.state.fabric, same_node=len(nodes) == 1
            )
        return self._group[key]

    def slowness(self, ranks: Sequence[int]) -> float:
        """A group's slowdown: its slowest member's 1 / p."""
        key = tuple(ranks)
        if key not in self._slow:
            self._slow[key] = max(1.0 / self.state.device(r).speed for r in ranks)
        return self._slow[key]

    def lead(self, g: StageGroup) -> float:
        """How late group `g` starts its list in the steady state ([Note: step lead]): its own
        optimizer step (its parameters) times its slowdown less one; 0 when every rank meets
        at the boundary (`Workload.boundary_sync`)."""
        slow = self.slowness(g.ranks)
        wl = self.state.workload
        if slow <= 1.0 or wl.boundary_sync:
            return 0.0
        return (slow - 1.0) * wl.stage_params(g.layers) / g.tp * wl.step_s_per_param

    def _own_step(self, g: StageGroup) -> float:
        wl = self.state.workload
        return wl.stage_params(g.layers) / g.tp * wl.step_s_per_param

    def boundary_s(self, layout: Layout) -> float:
        """Under `Workload.boundary_sync`: how much longer than the healthy closing step the
        slowest group's own step runs (every rank waits for it at the boundary); else 0."""
        if not self.state.workload.boundary_sync:
            return 0.0
        slowest = max(self.slowness(g.ranks) * self._own_step(g) for _, g in layout.groups())
        return max(0.0, slowest - self.opt_s(layout))

    def compute_cost(self, layout: Layout) -> ComputeCost:
        """Seconds of group (d, s)'s forward or backward, slowdown included."""

        def cost(g: Group, kind: ActionKind) -> float:
            group = layout.group(*g)
            f, b = self.base_cost(group)
            return (f if kind is ActionKind.F else b) * self.slowness(group.ranks)

        return cost

    def group_link(self, layout: Layout) -> LinkCost:
        """Seconds of one message between two groups of `layout`."""

        def link(a: Group, b: Group) -> float:
            return self.message_s(layout.group(*a).ranks, layout.group(*b).ranks)

        return link

    def link_s(self, src: int, dst: int, nbytes: float) -> float:
        """One message of `nbytes` between two ranks."""
        a, b = self.state.device(src), self.state.device(dst)
        speed = min(a.link_speed, b.link_speed)
        return self.state.fabric.transfer_s(nbytes, a.node == b.node, speed)

    def message_s(self, src: Sequence[int], dst: Sequence[int]) -> float:
        """A whole message between two groups: its slowest chunk ([Note: reduced simulation])."""
        key = (tuple(src), tuple(dst))
        if key not in self._message:
            chunks = p2p_chunks(src, dst)
            nbytes = self.state.workload.message_bytes / len(chunks)
            self._message[key] = max(self.link_s(a, b, nbytes) for _, a, b in chunks)
        return self._message[key]

    def reduce_s(self, layout: Layout) -> dict[int, float]:
        """Per stage, the gradient all-reduce across replicas: a ring over the largest shard,
        at NVLink speed when every replica's group of the stage shares one node, else at the
        network speed of the stage's slowest link."""
        wl, fabric = self.state.workload, self.state.fabric
        out = {}
        for s in range(layout.pp):
            groups = [rep.stages[s] for rep in layout.replicas]
            devices = [self.state.device(r) for g in groups for r in g.ranks]
            shard = max(wl.stage_params(g.layers) / g.tp for g in groups)
            if len({dev.node for dev in devices}) == 1:
                bw, lat = fabric.intra_bytes_per_s, fabric.intra_latency_s
            else:
                speed = min(dev.link_speed for dev in devices)
                bw, lat = fabric.inter_bytes_per_s * speed, fabric.inter_latency_s
            out[s] = 2 * ring_s(shard * wl.grad_bytes_per_param, layout.dp, bw, lat)
        return out

    def opt_s(self, layout: Layout) -> float:
        """The optimizer step of the device with the most parameters."""
        wl = self.state.workload
        most = max(wl.stage_params(g.layers) / g.tp for _, g in layout.groups())
        return most * wl.step_s_per_param

    def costs(self, layout: Layout) -> Costs:
        """The simulator's costs for the full plan of `layout` (every rank)."""
        table = {(g.ranks, g.layers): self.base_cost(g) for _, g in layout.groups()}

        def compute(work: Work) -> float:
            f, b = table[(work.ranks, work.layers)]
            return f if work.kind is ActionKind.F else b if work.kind is ActionKind.B else 0.0

        return Costs(
            compute=compute,
            link=self.link_s,
            message_bytes=self.state.workload.message_bytes,
            reduce_grad=self.reduce_s(layout),
            opt_step=self.opt_s(layout),
            slowdown=self.state.slowdown(),
            step_lead={r: self.lead(g) for _, g in layout.groups() for r in g.ranks},
        )

    # -- timing ------------------------------------------------------------------------------
    def time(
        self,
        layout: Layout,
        *,
        reduce: Mapping[int, float] | None = None,
        bound: float = math.inf,
        boundary: bool = True,
    ) -> float:
        """Predicted iteration time of `layout` (seconds).

        Args:
            layout: the layout.
            reduce: per-stage gradient reduction to use instead of `reduce_s(layout)` (a
                pipeline timed alone whose gradients are reduced with other pipelines').
            bound: the caller only cares whether the time is below `bound`: once one
                component reaches it, that component's time is returned without simulating the
                rest (exact below the bound, a lower bound of the true time above it).
            boundary: include the wait for a slow device's step at the boundary
                (`boundary_s`; micro-batch balancing leaves it out: [Note: step lead]).
        """
        worst = 0.0
        for _, t, _ in self._components(layout, reduce, bound, boundary):
            worst = max(worst, t)
            if worst >= bound:
                break
        return worst

    def traces(self, layout: Layout) -> dict[Group, GroupTrace]:
        """Per group, its simulated forwards and backwards (global micro-batch ids)."""
        out: dict[Group, GroupTrace] = {}
        for result, _, (replicas, ids) in self._components(layout):
            for (i, s), trace in result.traces.items():
                out[(replicas[i], s)] = GroupTrace(
                    forwards=tuple((ids[m], a, b) for m, a, b in trace.forwards),
                    backwards=tuple((ids[m], a, b) for m, a, b in trace.backwards),
                )
        return out

    def plan(self, layout: Layout) -> ParallelPlan:
        """The layout's full `ParallelPlan`: every rank's action list, placed as the components
        were when they were timed."""
        safe = {comp[0] for result, _, (comp, _) in self._components(layout) if result.safe}
        return to_plan(layout, self.compute_cost(layout), self.group_link(layout), safe)

    def actions_of(self, layout: Layout, rank: int) -> tuple:
        """One rank's action list of `scorer.plan(layout)`, without materializing the others
        (each rank of a large job needs only its own).

        Raises:
            KeyError: the rank holds no stage in the layout.
        """
        d, s = layout.skeleton.locate(rank)
        for result, _, (comp, _) in self._components(layout):
            if d in comp:
                acts, _ = component_actions(
                    layout,
                    comp,
                    self.compute_cost(layout),
                    self.group_link(layout),
                    safe=result.safe,
                    only=(d, s),
                )
                return acts[rank]
        raise KeyError(rank)  # pragma: no cover - every replica is in a component

    def _components(
        self,
        layout: Layout,
        reduce: Mapping[int, float] | None = None,
        bound: float = math.inf,
        boundary: bool = True,
    ) -> Iterator[tuple[_Component, float, tuple[list[int], list[int]]]]:
        """Every component's result, cached ones first, then the slowest-looking ones; stops
        after a component at or above `bound`. Its time includes `boundary_s` (`boundary`)."""
        reduce = dict(self.reduce_s(layout) if reduce is None else reduce)
        opt = self.opt_s(layout)
        wait = self.boundary_s(layout) if boundary else 0.0
        pending = []
        targets = {m.replica for m in layout.migrations}
        for comp in components(layout):
            ids = [m for d in comp for m in layout.skeleton.microbatch_ids(d)]
            if not ids and not targets.intersection(comp):  # [Note: empty replica]
                idle = _idle(
                    [max(self.lead(layout.group(d, s)) for d in comp) for s in range(layout.pp)]
                )
                t = idle.time(reduce, opt) + wait
                yield idle, t, (comp, ids)
                if t >= bound:
                    return
                continue
            key, table, links, arrival, slowest = self._key(layout, comp, targets)
            if key in self.cache:
                t = self.cache[key].time(reduce, opt) + wait
                yield self.cache[key], t, (comp, ids)
                if t >= bound:
                    return
            else:
                pending.append((-slowest, len(pending), key, table, links, arrival, comp, ids))
        for *_, key, table, links, arrival, comp, ids in sorted(pending):
            if key not in self.cache:  # equal components among the pending run once
                small = self._reduced(layout, comp)[0]
                self.cache[key] = self._simulate(small, table, links, reduce, opt, arrival)
            t = self.cache[key].time(reduce, opt) + wait
            yield self.cache[key], t, (comp, ids)
            if t >= bound:
                return

    def _key(self, layout: Layout, comp: list[int], targets: set[int]) -> tuple:
        """The component's cache key (what its timeline depends on but the reduction terms),
        its cost table and links (as `_reduced`'s), whether it has a slow link, and its slowest
        group's slowdown. A replica alone with no migration is keyed without building its
        reduced plan, and memoized by (replica, micro-batches, bounds): at 4,096 GPUs every
        candidate has 64 such components, almost all unchanged."""
        if len(comp) > 1 or comp[0] in targets:
            small, table, links = self._reduced(layout, comp)
            splits = tuple(small.split(d) for d in range(small.dp))
            head = (small.microbatches, small.migrations, small.inflight, splits)
            return self._keyed(layout, comp, table, links, head)
        d = comp[0]
        memo = (layout.replicas[d], layout.microbatches[d], layout.inflight[d])
        if memo not in self._alone:
            stages = layout.replicas[d].stages
            table = {
                (0, s): (*self.base_cost(g), self.slowness(g.ranks), self.lead(g))
                for s, g in enumerate(stages)
            }
            links = {}
            for s in range(len(stages) - 1):  # `_message_pairs` without migrations
                a, b = stages[s].ranks, stages[s + 1].ranks
                links[(s, s + 1)], links[(s + 1, s)] = self.message_s(a, b), self.message_s(b, a)
            head = ((memo[1],), (), (memo[2],), (layout.split(d),))
            self._alone[memo] = self._keyed(layout, comp, table, links, head)
        return self._alone[memo]

    def _keyed(self, layout: Layout, comp: list[int], table, links, head: tuple) -> tuple:
        arrival = any(
            self.state.device(r).link_speed < 1
            for d in comp
            for g in layout.replicas[d].stages
            for r in g.ranks
        )
        key = (arrival, tuple(table.items()), tuple(sorted(links.items())), *head)
        slowest = max(slow for _, _, slow, _ in table.values())
        return key, table, links, arrival, slowest

    def _reduced(self, layout: Layout, comp: list[int]):
        """The component as a plan with one rank per group, its cost table (local (d, s) ->
        (F, B, slowness)) and message times between local ranks."""
        plan = layout.skeleton
        local = {d: i for i, d in enumerate(comp)}
        pp = layout.pp
        ids = [m for d in comp for m in plan.microbatch_ids(d)]
        renum = {m: i for i, m in enumerate(ids)}
        replicas, table = [], {}
        for i, d in enumerate(comp):
            stages = []
            for s, g in enumerate(layout.replicas[d].stages):
                stages.append(StageGroup((i * pp + s,), g.layers))
                table[(i, s)] = (*self.base_cost(g), self.slowness(g.ranks), self.lead(g))
            replicas.append(Replica(tuple(stages)))
        migrations = tuple(
            Migration(renum[m.microbatch], m.stage, local[m.replica])
            for m in layout.migrations
            if m.replica in local
        )
        small = Layout(
            replicas=tuple(replicas),
            microbatches=tuple(layout.microbatches[d] for d in comp),
            migrations=migrations,
            inflight=tuple(layout.inflight[d] for d in comp),
        )
        links = {}
        for a, b in _message_pairs(small):
            ga = layout.group(comp[a // pp], a % pp).ranks
            gb = layout.group(comp[b // pp], b % pp).ranks
            links[(a, b)] = self.message_s(ga, gb)
        return small, table, links

    def _simulate(self, small: Layout, table, links, reduce, opt, arrival: bool) -> _Component:
        self.simulations += 1
        pp = small.pp

        def order_cost(g: Group, kind: ActionKind) -> float:
            f, b, slow, _ = table[g]
            return (f if kind is ActionKind.F else b) * slow

        def compute(work: Work) -> float:
            f, b, _, _ = table[(work.replica, work.stage)]
            return f if work.kind is ActionKind.F else b if work.kind is ActionKind.B else 0.0

        def link(a: Group, b: Group) -> float:
            return links[(a[0] * pp + a[1], b[0] * pp + b[1])]

        costs = Costs(
            compute=compute,
            link=lambda src, dst, _bytes: links[(src, dst)],
            reduce_grad=dict(reduce),
            opt_step=opt,
            slowdown={i * pp + s: slow for (i, s), (_, _, slow, _) in table.items()},
            step_lead={i * pp + s: lead for (i, s), (_, _, _, lead) in table.items()},
        )
        everyone = range(small.dp)
        actions, differs = component_actions(small, everyone, order_cost, link, safe=not arrival)
        check = arrival and differs
        timeline = simulate(
            _with_actions(small, actions), costs, check_blocking=check, static_checks=False
        )
        safe = not arrival or not timeline.ok
        if arrival and safe:  # the arrival-time placement would hang with blocking sends
            actions, _ = component_actions(small, everyone, order_cost, link, safe=True)
            timeline = simulate(
                _with_actions(small, actions), costs, check_blocking=False, static_checks=False
            )
        if not timeline.ok:  # pragma: no cover - the instant placement cannot deadlock
            raise RuntimeError(f"planner lists did not complete: {timeline.deadlocks[:3]}")
        fw: dict[Group, list] = {g: [] for g in table}
        bw: dict[Group, list] = {g: [] for g in table}
        starts: dict[int, float] = {}
        for t in timeline.actions:
            if t.action.kind is ActionKind.REDUCE_GRAD:
                starts[t.rank % pp] = t.start
            elif t.action.kind in (ActionKind.F, ActionKind.B):
                g = (t.rank // pp, t.rank % pp)
                (fw if t.action.kind is ActionKind.F else bw)[g].append(
                    (t.action.microbatch, t.start, t.end)
                )
        traces = {g: GroupTrace(tuple(fw[g]), tuple(bw[g])) for g in table}
        out = _Component(starts, traces, safe)
        if out.time(reduce, opt) != timeline.iteration_time:  # pragma: no cover - the note's claim
            raise RuntimeError("reduction-free timing differs from the simulator's")
        return out


def _idle(leads: Sequence[float]) -> _Component:
    """A replica with no micro-batch ([Note: empty replica] in `unbroken.plan.balance`): its
    list is REDUCE_GRAD, OPT_STEP, so stage s's reduction is ready once its group's step lead
    `leads[s]` has passed (`Costs.step_lead`: a slow device's long step of the iteration
    before)."""
    empty = GroupTrace((), ())
    return _Component(dict(enumerate(leads)), {(0, s): empty for s in range(len(leads))}, True)


def _message_pairs(small: Layout) -> set[tuple[int, int]]:
    """(sender, receiver) local ranks of every message of a reduced layout (both directions)."""
    pp = small.pp
    if not small.migrations:  # consecutive stages of each replica
        return {
            pair
            for d in range(small.dp)
            for s in range(pp - 1)
            for pair in ((d * pp + s, d * pp + s + 1), (d * pp + s + 1, d * pp + s))
        }
    pairs = set()
    work = work_lists(small, range(small.dp))
    where = {(m, s): d * pp + s for (d, s), mbs in work.items() for m in mbs}
    for (m, s), rank in where.items():
        if s + 1 < pp:
            nxt = where[(m, s + 1)]
            pairs.add((rank, nxt))
            pairs.add((nxt, rank))
    return pairs


def _with_actions(layout: Layout, actions) -> ParallelPlan:
    skeleton = layout.skeleton
    return ParallelPlan(
        replicas=skeleton.replicas,
        num_layers=skeleton.num_layers,
        microbatches=skeleton.microbatches,
        schedule="1f1b",
        migrations=skeleton.migrations,
        actions=actions,
    )
