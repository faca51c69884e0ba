"""The workload model of a hybrid-parallel plan: healthy iteration times from the dry-run
simulator, and which rank is slow.

Iteration (ResiHP §5.2, eq. 2): every compute chunk of the plan — F, B, W of micro-batch m on
virtual stage k — costs its share of the micro-batch's predicted time,

    T(k, kind, m) = share(replica, k, kind) * T_MB(m),   T_MB(m) = alpha N + beta sum l_i^2,

and `unbroken.parallel.simulate` replays the plan's action lists with these costs (the
point-to-point link time on every message, the gradient reduction per physical stage, the
optimizer step), so the predicted iteration follows the schedule that really runs: its
critical path through the pipeline's dependencies and bubbles. A constant (the trainer's work
between iterations: the state hash, logging) is the median of what the simulator leaves out on
the warm-up iterations, as `DataParallelSchedule.sync_s` is for data parallelism.

[Note: stage shares] The shares are measured, not assumed: on warm-up, T_MB(m) is the time of
micro-batch m through the whole model (the sum of its F, B, W actions over the stages) and
share(replica, k, kind) the median part of it that (k, kind) took. For even layer splits that
is each stage's layer share times the F : B : W split, but measured it also prices what the
layer count does not see (the embedding on the first stage, the head and loss on the last, TP
collectives inside a stage, a replica with other TP degrees). The micro-batch model (alpha,
beta) is fitted on the same whole-model times, so the workload enters every chunk through
T_MB(m). An action's time is the shortest over its TP group's members: all of them run it
together, and the member that arrived last at its collectives waited least.

Localization: a rank's busy time (`StageTiming.busy_s`: not blocked on peers) follows its own
compute; on warm-up its ratio to the rank's predicted compute (its actions' costs above) is
fitted per rank. A slowed rank's busy time grows; its pipeline neighbours and TP peers wait
for it, which lands in their blocked time. So the rank whose busy time over the window is the
largest multiple of its predicted one, compared with the other ranks' median, is the slow
one, and its physical stage is named with it.

Recovery: a rank reported slow is at full speed again when it runs at the pace of the
ranks that hold its stages in the other replicas (`PlanFit.pace`). A one-replica pipeline has
no such ranks, and a re-plan may have moved layers off the slow rank, so it is measured
against itself per layer instead (`LayerPace`): its compute seconds per layer and per second
of the micro-batch's predicted T_MB, on healthy iterations before the slowdown and now — the
scheduler's model of a stage (its cost is its layer count), priced per micro-batch by the
fitted workload model.

Never reads clocks, never talks to ranks; only models.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from unbroken.detect.timing import StageTiming
from unbroken.detect.workload import DocLengths, MicroBatchModel, WorkloadPredictor
from unbroken.parallel import (
    ActionKind,
    Costs,
    DeadlockError,
    ParallelPlan,
    Timeline,
    held_stages,
    simulate,
)

__all__ = ["LayerPace", "PlanFit", "PlanSchedule", "by_microbatch", "fit_plan"]

Workload = Sequence[Sequence[DocLengths]]
"""`[replica][i] -> segment lengths` of replica's i-th micro-batch."""
Share = tuple[int, int, str]
"""(executing replica, virtual stage, kind "F"/"B"/"W")."""
T = TypeVar("T")
_CACHE = 64


def by_microbatch(plan: ParallelPlan, per_replica: Sequence[Sequence[T]]) -> dict[int, T]:
    """`[replica][i] -> x` re-keyed by global micro-batch id ([Note: micro-batch ids])."""
    return {
        mb: per_replica[d][i] for d in range(plan.dp) for i, mb in enumerate(plan.microbatch_ids(d))
    }


@dataclass(frozen=True, slots=True)
class PlanSchedule:
    """`ScheduleModel` of a plan: per-micro-batch times through the dry-run simulator."""

    plan: ParallelPlan
    shares: Mapping[Share, float]
    """Part of T_MB each (replica, stage, kind) takes ([Note: stage shares]); missing = 0."""
    link_s: float = 0.0
    """One message's point-to-point time (a chunk of 1/n costs 1/n of it)."""
    reduce_s: Mapping[int, float] = field(default_factory=dict)
    """Gradient reduction per physical stage."""
    opt_step_s: float = 0.0
    """The optimizer step (protect, update, boundary) of the slowest rank."""
    sync_s: float = 0.0
    """Constant per iteration that the simulator does not see."""
    _seen: dict[tuple, Timeline] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """Timelines by workload: a job whose micro-batches cost the same (single documents of N
    tokens) is simulated once, not at every change point."""

    def costs(self, mb_times: Sequence[Sequence[float]]) -> Costs:
        """The simulator's costs when replica d's i-th micro-batch takes `mb_times[d][i]`."""
        t = by_microbatch(self.plan, mb_times)
        shares = self.shares

        def compute(work) -> float:
            return shares.get((work.replica, work.stage, work.kind.value), 0.0) * t[work.microbatch]

        return Costs(
            compute=compute,
            link=self.link_s,
            reduce_grad=dict(self.reduce_s),
            opt_step=self.opt_step_s,
        )

    def timeline(self, mb_times: Sequence[Sequence[float]]) -> Timeline:
        """The simulated iteration (without `sync_s`).

        Raises:
            DeadlockError: the plan's lists cannot run (never for a plan the engine runs).
        """
        key = tuple(tuple(r) for r in mb_times)
        timeline = self._seen.get(key)
        if timeline is None:
            timeline = simulate(self.plan, self.costs(mb_times), check_blocking=False)
            if not timeline.ok:
                raise DeadlockError(timeline.deadlocks)
            if len(self._seen) >= _CACHE:
                self._seen.clear()
            self._seen[key] = timeline
        return timeline

    def iteration_time(self, mb_times: Sequence[Sequence[float]]) -> float:
        return self.timeline(mb_times).iteration_time + self.sync_s

    def rank_compute(self, rank: int, mb_times: Sequence[Sequence[float]]) -> float:
        """Predicted compute of one rank's actions (F, B, W) in one iteration."""
        t = by_microbatch(self.plan, mb_times)
        total = 0.0
        for a in self.plan.actions.get(rank, ()):
            if a.kind in (ActionKind.F, ActionKind.B, ActionKind.W):
                d = self.plan.executor(a.microbatch, a.stage)
                total += self.shares.get((d, a.stage, a.kind.value), 0.0) * t[a.microbatch]
        return total


@dataclass(frozen=True, slots=True)
class PlanFit:
    """What the warm-up fits for a plan: the predictor and each rank's busy-time scale."""

    predictor: WorkloadPredictor
    busy_scale: Mapping[int, float]
    """rank -> healthy busy time / predicted compute (ranks without compute are absent)."""
    mb_s: float = 0.0
    """A typical micro-batch's compute over all its stages (F, B, W): the warm-up's median."""
    step_s: float = 0.0
    """A typical rank's optimizer step (protect, update, boundary): the warm-up's median over
    iterations of the median over ranks (one slow rank does not move it, unlike the slowest
    rank's step the simulation ends with, `PlanSchedule.opt_step_s`)."""

    @property
    def schedule(self) -> PlanSchedule:
        assert isinstance(self.predictor.schedule, PlanSchedule)
        return self.predictor.schedule

    def busy(
        self, window: Sequence[tuple[Workload, Mapping[int, StageTiming]]]
    ) -> dict[int, tuple[float, float]]:
        """rank -> (observed, predicted healthy) busy seconds over `window`."""
        observed: dict[int, float] = defaultdict(float)
        predicted: dict[int, float] = defaultdict(float)
        for lengths, stages in window:
            mb_times = self.predictor.mb_times(lengths)
            for rank, t in stages.items():
                if rank in self.busy_scale:
                    observed[rank] += t.busy_s
                    predicted[rank] += self.busy_scale[rank] * self.schedule.rank_compute(
                        rank, mb_times
                    )
        return {r: (observed[r], predicted[r]) for r in observed if predicted[r] > 0}

    def pace(
        self, window: Sequence[tuple[Workload, Mapping[int, StageTiming]]], rank: int
    ) -> float | None:
        """`rank`'s compute pace against the ranks that hold its stages in the other replicas
        over `window`: per (virtual stage, kind) it runs, its action seconds over the predicted
        T_MB of their micro-batches, over the median of the same ratio of the stage's other
        holders; the median over its stages. None: no other replica holds a stage of it, or
        it computed nothing — a rank of an empty replica is paced by its probe micro-batch
        ([Note: probe micro-batch] in `unbroken.engine.probe`), and without one it has no
        pace: never found back, never found slow.

        Like with like, as `FailSlowDetector._pace_against_peers`: each rank's first action of
        each (stage, kind) per iteration only (the first carries the iteration's start-up, and
        a re-plan leaves the slow replica fewer micro-batches than its peers). Per layer: the
        stage's share of T_MB cancels, and after a repartition of one replica (its stage k
        holds other layers than stage k of the others) ranks are compared per layer they hold
        (an action's cost besides its layers, `fixed_share`, then biases a rank with fewer
        layers towards slow)."""
        sums: dict[tuple[int, int, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        plan = self.schedule.plan
        for lengths, stages in window:
            t = by_microbatch(plan, self.predictor.mb_times(lengths))
            for r, timing in stages.items():
                seen: set[tuple[int, str]] = set()
                # A rank of an empty replica computes only its probe ([Note: probe
                # micro-batch] in `unbroken.engine.probe`); no timing, no pace.
                actions = timing.compute or timing.probe
                if not actions:
                    continue  # a standby: it holds no stage
                # Its own replica's stages (a probe runs the rank's own layers).
                own = plan.replicas[plan.locate(r)[0]].stages
                for kind, k, mb, seconds in actions:
                    if (k, kind) in seen or mb not in t:
                        continue
                    seen.add((k, kind))
                    lo, hi = own[k].layers
                    acc = sums[(r, k, kind)]
                    acc[0] += seconds
                    # A rank's share of its stage: a TP group of t splits each layer t ways
                    # (after a TP exclusion one replica's stage runs at TP 1, the other's not).
                    acc[1] += t[mb] * (hi - lo) / own[k].tp
        paces = {key: o / p for key, (o, p) in sums.items() if p > 0}
        ratios = []
        for (r, k, kind), mine in paces.items():
            if r != rank:
                continue
            peers = [
                v for (q, k2, kind2), v in paces.items() if q != rank and (k2, kind2) == (k, kind)
            ]
            if peers:
                ratios.append(mine / statistics.median(peers))
        return statistics.median(ratios) if ratios else None


@dataclass(frozen=True, slots=True)
class LayerPace:
    """A rank's healthy compute per layer, measured before it slowed down: what it is held to
    when no other replica holds its stages (a one-replica pipeline), under any layout of the
    layers (module notes, Recovery).

    Each compute action is `layers` x T_MB(m) units of work (its virtual stage's layer count,
    the micro-batch's predicted time through the whole model): a layer's share of T_MB is
    taken to be the same on every stage, as the scheduler prices stages by their layers. What
    an action costs besides its layers (the embedding or the head, the action's own dispatch)
    makes a rank look slower per layer the fewer layers it holds: on the tiny CPU model about
    0.6 of a layer per action, so a healthy rank moved from two layers to one read 1.25-1.35x
    and was never found back (stop 47). `layout_bias` takes that out, with the fixed share
    measured on the healthy ranks whose layer count the move changed too (`fixed_share`)."""

    mb: MicroBatchModel
    """The workload model of the healthy fit (T_MB)."""
    seconds: float
    """Compute seconds per unit of work on the healthy iterations."""
    layers: int = 0
    """The layers the rank held then (`held_layers`)."""

    @classmethod
    def measure(
        cls,
        plan: ParallelPlan,
        mb: MicroBatchModel,
        window: Sequence[tuple[Workload, Mapping[int, StageTiming]]],
        rank: int,
    ) -> LayerPace | None:
        """`rank`'s pace over the healthy `window` of `plan`; None if it computed nothing."""
        seconds = _per_layer(plan, mb, window, rank)
        if seconds is None:
            return None
        return cls(mb=mb, seconds=seconds, layers=held_layers(plan, rank))

    def ratio(
        self,
        plan: ParallelPlan,
        window: Sequence[tuple[Workload, Mapping[int, StageTiming]]],
        rank: int,
    ) -> float | None:
        """`rank`'s compute per unit of work over `window` of `plan` (the running plan, which
        may hold other layers than the one measured) over its healthy one: 1.0 is healthy.
        None if it computed nothing."""
        seconds = _per_layer(plan, self.mb, window, rank)
        return None if seconds is None or self.seconds <= 0 else seconds / self.seconds


def held_layers(plan: ParallelPlan, rank: int) -> int:
    """The layers `rank` holds under `plan`, over all its virtual stages."""
    return sum(hi - lo for (lo, hi), _ in held_stages(plan, rank))


MAX_FIXED_SHARE = 4.0
"""The largest fixed cost per action `fixed_share` reports, in layers of work."""


def fixed_share(before: int, now: int, ratio: float) -> float | None:
    """An action's cost besides its layers, in layers of work, from a healthy rank that held
    `before` layers and holds `now`, whose compute per layer reads `ratio` x what it read
    before (`LayerPace.ratio`): with per-action seconds u (L + rho), the per-layer reading is
    (L' + rho) / L' over (L + rho) / L, solved for rho. None when the layer count did not
    change or the reading says nothing (noise past the model's range); capped at
    `MAX_FIXED_SHARE`."""
    if before == now or before <= 0 or now <= 0:
        return None
    denominator = ratio * now - before
    if abs(denominator) < 1e-9:
        return None
    rho = before * now * (1.0 - ratio) / denominator
    return min(rho, MAX_FIXED_SHARE) if rho >= 0 else None


def layout_bias(before: int, now: int, rho: float) -> float:
    """What a healthy rank's per-layer reading is when it went from `before` to `now` layers
    and an action costs `rho` layers of work besides its layers: 1 when nothing moved."""
    if before <= 0 or now <= 0:
        return 1.0
    return (before / now) * (now + rho) / (before + rho)


def _per_layer(
    plan: ParallelPlan,
    mb: MicroBatchModel,
    window: Sequence[tuple[Workload, Mapping[int, StageTiming]]],
    rank: int,
) -> float | None:
    """`rank`'s compute seconds per unit of work over `window` (`LayerPace`): the median of
    its iterations' readings. A window's total let two noisy iterations of eight (a 2-core VM's
    scheduling, 1.5x a healthy one's compute) hold a rank back at full speed above
    `recover_ratio` to the end of the job (the give-back test failed 2-3 runs in 11, stop
    50)."""
    readings = []
    for lengths, stages in window:
        timing = stages.get(rank)
        if timing is None:
            continue
        docs = by_microbatch(plan, lengths)
        observed = units = 0.0
        for _, k, m, seconds in timing.compute:
            if m not in docs:
                continue
            lo, hi = plan.replicas[plan.executor(m, k)].stages[k].layers
            observed += seconds
            units += (hi - lo) * mb.predict(docs[m])
        if units > 0:
            readings.append(observed / units)
    return statistics.median(readings) if readings else None


def _action_seconds(stages: Mapping[int, StageTiming]) -> dict[tuple[int, int, str], float]:
    """(micro-batch, virtual stage, kind) -> its time: the shortest over its group's members."""
    out: dict[tuple[int, int, str], float] = {}
    for t in stages.values():
        for kind, k, mb, seconds in t.compute:
            key = (mb, k, kind)
            out[key] = min(out.get(key, seconds), seconds)
    return out


# Long: three fits in order (micro-batch model, shares and links, per-rank scale), each on the last.
def fit_plan(
    plan: ParallelPlan, warm: Sequence[tuple[Workload, float, Mapping[int, StageTiming]]]
) -> PlanFit:
    """Fit the plan's model on warm-up iterations ([Note: stage shares]).

    Args:
        plan: the plan the job runs.
        warm: per iteration, its workload, its measured time and every rank's `StageTiming`.

    Raises:
        ValueError: no compute actions were timed.
    """
    samples: list[tuple[DocLengths, float]] = []
    parts: dict[Share, list[float]] = defaultdict(list)
    for lengths, _, stages in warm:
        docs = by_microbatch(plan, lengths)
        acts = _action_seconds(stages)
        whole: dict[int, float] = defaultdict(float)
        for (mb, _, _), seconds in acts.items():
            whole[mb] += seconds
        for mb, seconds in whole.items():
            samples.append((docs[mb], seconds))
        for (mb, k, kind), seconds in acts.items():
            if whole[mb] > 0:
                parts[(plan.executor(mb, k), k, kind)].append(seconds / whole[mb])
    if not samples:
        raise ValueError("fail-slow warm-up needs the plan's per-action timings (StageTiming)")
    mb_model = MicroBatchModel.fit(samples)
    shares = {key: statistics.median(v) for key, v in parts.items()}

    links = [t.p2p_min_s for _, _, st in warm for t in st.values() if t.p2p_min_s > 0]
    reduce: dict[int, list[float]] = defaultdict(list)
    steps = []
    for _, _, stages in warm:
        per_stage: dict[int, float] = {}
        for rank, t in stages.items():
            if plan.actions.get(rank):
                s = plan.locate(rank)[1]
                per_stage[s] = min(per_stage.get(s, t.reduce_s), t.reduce_s)
        for s, v in per_stage.items():
            reduce[s].append(v)
        if stages:
            steps.append(max(t.step_s for t in stages.values()))
    bare = PlanSchedule(
        plan=plan,
        shares=shares,
        # A batch that did not wait is one transfer; the shortest ones are those.
        link_s=min(links) if links else 0.0,
        reduce_s={s: statistics.median(v) for s, v in reduce.items()},
        opt_step_s=statistics.median(steps) if steps else 0.0,
    )
    bare_predictor = WorkloadPredictor(mb=mb_model, schedule=bare)
    residuals = [seconds - bare_predictor.iteration_time(lengths) for lengths, seconds, _ in warm]
    schedule = PlanSchedule(
        plan=plan,
        shares=shares,
        link_s=bare.link_s,
        reduce_s=bare.reduce_s,
        opt_step_s=bare.opt_step_s,
        sync_s=statistics.median(residuals),
    )
    predictor = WorkloadPredictor(mb=mb_model, schedule=schedule)
    scale: dict[int, list[float]] = defaultdict(list)
    for lengths, _, stages in warm:
        mb_times = predictor.mb_times(lengths)
        for rank, t in stages.items():
            compute = schedule.rank_compute(rank, mb_times)
            if compute > 0:
                scale[rank].append(t.busy_s / compute)
    return PlanFit(
        predictor=predictor,
        busy_scale={r: statistics.median(v) for r, v in scale.items()},
        mb_s=statistics.median(s for _, s in samples),
        step_s=_typical_step(plan, warm),
    )


def _typical_step(
    plan: ParallelPlan, warm: Sequence[tuple[Workload, float, Mapping[int, StageTiming]]]
) -> float:
    """`PlanFit.step_s`: the median over iterations of the median step over working ranks."""
    typical = []
    for _, _, stages in warm:
        working = [t.step_s for r, t in stages.items() if plan.actions.get(r)]
        if working:
            typical.append(statistics.median(working))
    return statistics.median(typical) if typical else 0.0
