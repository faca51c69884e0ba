"""Oobleck (Jang et al., SOSP '23): fail-stop tolerance with pipeline templates.

Owns the Oobleck policy, plain and strengthened with Greyhound's mitigation (ResiHP §8.1). From
Oobleck's code (github.com/SymbioticLab/Oobleck, `planning/instantiator.py`,
`execution/engine.py`):

- *templates*: before training, one pipeline template per size n (from the smallest that holds
  the model to the largest): the layers split over n stages to balance the stages' time.
  [Interpretation] A unit is one TP group of the job (ResiHP: Oobleck "discards entire TP
  groups"; Oobleck itself removes a whole node), and a template's split minimizes the largest
  stage time of healthy units (Oobleck's divide and conquer over profiled layers), subject to
  every stage fitting in memory.
- *reconfiguration* (`on_reconfigure`): every pipeline drops its units that lost a device; a
  pipeline left with fewer units than the smallest template borrows units, one at a time, from
  the biggest pipeline that can spare one; when none can, the short pipelines are merged (and,
  if still short, merged with a full one); when even that fails, training stops ("Ranks are
  insufficient"). Training also stops when some layer has no surviving copy to copy the model
  state from ("No alive ranks for the layer").
- *batch distribution* (`_distribute_batch`): micro-batches per pipeline n_i >= 1 summing to
  the global batch, minimizing the variance of n_i * T_i / s_i (T_i: template time of one
  micro-batch, s_i: its stages).

Pipelines of different depths cannot share one plan IR value (its replicas have equal stage
counts), so each pipeline is its own layout and the iteration takes the slowest pipeline's
time, each timed by the simulator with the gradient reduction across all pipelines — the same
value the simulator gives for the joint plan, as replicas meet only at that reduction
([Note: reduced simulation] in `unbroken.plan.score`).
"""

from __future__ import annotations

import math
from functools import cache

from unbroken.parallel import Replica, StageGroup
from unbroken.plan.balance import balance_counts
from unbroken.plan.baselines._common import Outcome, moved_bytes, per_microbatch_s, timed
from unbroken.plan.layout import Layout
from unbroken.plan.memory import need
from unbroken.plan.score import Scorer
from unbroken.plan.state import ClusterState
from unbroken.plan.workload import ring_s

__all__ = ["Oobleck", "template_split"]

Unit = tuple[int, ...]


def template_split(state: ClusterState, tp: int, n: int) -> tuple[int, ...] | None:
    """Layers per stage of the n-stage template of units of `tp` devices (None: no split of
    n stages fits in memory)."""
    wl, fabric, num = state.workload, state.fabric, state.workload.num_layers
    if n > num:
        return None
    capacity = min(d.memory_bytes for d in state.devices)

    @cache
    def best(first: int, stages: int) -> tuple[float, tuple[int, ...]] | None:
        """Min over splits of layers [first, num) into `stages` of the max stage time."""
        s = n - stages
        if stages == 1:
            layers = (first, num)
            if need(state, layers, tp, n - s) > capacity:
                return None
            f, b = wl.stage_compute_s(layers, tp, fabric)
            return f + b, (num - first,)
        out = None
        for end in range(first + 1, num - stages + 2):
            layers = (first, end)
            if need(state, layers, tp, n - s) > capacity:
                break
            rest = best(end, stages - 1)
            if rest is None:
                continue
            f, b = wl.stage_compute_s(layers, tp, fabric)
            cand = (max(f + b, rest[0]), (end - first, *rest[1]))
            if out is None or cand < out:
                out = cand
        return out

    found = best(0, n)
    return None if found is None else found[1]


def _layout(units: list[Unit], split: tuple[int, ...], count: int) -> Layout:
    edges = [sum(split[:k]) for k in range(len(split) + 1)]
    stages = tuple(StageGroup(u, (edges[s], edges[s + 1])) for s, u in enumerate(units))
    return Layout(replicas=(Replica(stages),), microbatches=(count,))


class Oobleck:
    """The Oobleck policy (module docstring)."""

    def __init__(
        self, initial: Layout, state: ClusterState, *, strengthened: bool = False, cache=None
    ) -> None:
        self.name = "oobleck+" if strengthened else "oobleck"
        self.strengthened = strengthened
        self.cache = {} if cache is None else cache
        self.total = sum(initial.microbatches)
        self.tp = initial.group(0, 0).tp
        self.pipelines: list[list[Unit]] = [
            [g.ranks for g in rep.stages] for rep in initial.replicas
        ]
        self.splits: dict[int, tuple[int, ...] | None] = {}
        self.state0 = state
        sizes = [n for n in range(1, state.workload.num_layers + 1) if self.split(n)]
        self.n_min = min(sizes) if sizes else math.inf
        self.current = [_layout(p, self.split(len(p)), 1) for p in self.pipelines]

    def split(self, n: int) -> tuple[int, ...] | None:
        if n not in self.splits:
            self.splits[n] = template_split(self.state0, self.tp, n)
        return self.splits[n]

    def _reconfigure(self, alive: list[list[Unit]]) -> list[list[Unit]] | str:
        """Oobleck's `on_reconfigure` on the surviving units of every pipeline."""
        pipes = [list(p) for p in alive if p]
        out, short = [], False
        for p in pipes:
            while len(p) < self.n_min:
                donors = [q for q in pipes if len(q) > self.n_min and q is not p]
                if not donors:
                    short = True
                    break
                p.append(max(donors, key=len).pop())
            out.append(p)
        if not short:
            return out
        ready = [p for p in out if len(p) >= self.n_min]
        waiting = [p for p in out if len(p) < self.n_min]
        while waiting:
            p = waiting.pop(0)
            while len(p) < self.n_min:
                if waiting:
                    p.extend(waiting.pop(0))
                elif ready:
                    p.extend(ready.pop(0))
                else:
                    return "Oobleck: ranks are insufficient for the smallest pipeline template"
            ready.append(p)
        return ready

    def _lost_layer(self, lost: set[Unit]) -> int | None:
        held = set()
        for lay in self.current:
            for _, g in lay.groups():
                if g.ranks not in lost:
                    held.update(range(*g.layers))
        missing = sorted(set(range(self.state0.workload.num_layers)) - held)
        return missing[0] if missing else None

    def _plan(self, state: ClusterState) -> list[Layout] | str:
        lost = {u for p in self.pipelines for u in p if any(not state.device(r).alive for r in u)}
        layer = self._lost_layer(lost)
        if layer is not None:
            return f"Oobleck: no alive copy of layer {layer} to rebuild from"
        pipes = self._reconfigure([[u for u in p if u not in lost] for p in self.pipelines])
        if isinstance(pipes, str):
            return pipes
        scorer = Scorer(state, cache=self.cache)
        layouts = [_layout(p, self.split(len(p)), 1) for p in pipes]
        if self.strengthened:
            rates = [per_microbatch_s(scorer, lay, 0) for lay in layouts]
        else:
            rates = []
            for lay in layouts:
                stage = [sum(scorer.base_cost(g)) for _, g in lay.groups()]
                rates.append(sum(stage) / len(stage))
        counts = balance_counts(rates, self.total)
        self.pipelines = pipes
        return [_layout(p, self.split(len(p)), c) for p, c in zip(pipes, counts, strict=True)]

    def _time(self, scorer: Scorer, layouts: list[Layout]) -> float:
        wl, fabric = scorer.state.workload, scorer.state.fabric
        out = 0.0
        for lay in layouts:
            reduce = {}
            for s, g in enumerate(lay.replicas[0].stages):
                nbytes = wl.stage_params(g.layers) / g.tp * wl.grad_bytes_per_param
                bw = fabric.inter_bytes_per_s
                reduce[s] = 2 * ring_s(nbytes, len(layouts), bw, fabric.inter_latency_s)
            out = max(out, scorer.time(lay, reduce=reduce))
        return out

    def react(self, state: ClusterState) -> Outcome:
        layouts, seconds = timed(self._plan, state)
        if isinstance(layouts, str):
            return Outcome(policy=self.name, time_s=math.inf, reason=layouts, plan_s=seconds)
        moved = moved_bytes(state, self.current, layouts)
        self.current = layouts
        scorer = Scorer(state, cache=self.cache)
        depths = sorted(lay.pp for lay in layouts)
        return Outcome(
            policy=self.name,
            time_s=self._time(scorer, layouts),
            layouts=tuple(layouts),
            plan_s=seconds,
            moved_bytes=moved,
            notes=(f"{len(layouts)} pipelines of depths {depths}",),
        )
