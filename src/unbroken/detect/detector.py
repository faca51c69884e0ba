"""The online workload-aware fail-slow detector (ResiHP §5.2) and its Greyhound-style baseline.

Per iteration the caller feeds an `Observation`: the iteration time, the packed documents of
every replica's micro-batches and, when available, each rank's `RankTiming`. The detector

1. warms up: skips the first `skip_iters` iterations (process start), then fits the workload
   model (alpha, beta on the timed micro-batches; the sync constant on the iterations) and the
   change-point prior on the next `warmup_iters`; a rank already slow through the whole
   warm-up (no change point would ever show it) is reported at its end by comparing the ranks'
   observed / predicted compute (`_slow_through_warmup`);
2. runs BOCPD on the series of log(iteration time / predicted healthy time of that
   iteration's workload) (the baseline: over the warm-up median), so the swings the workload
   explains do not reach the change-point detector at all (the log: `_x`);
3. at a change point covering iterations c..t compares the observed time of c..t with the
   predicted healthy time of the same workload. Observed > `slow_ratio` (1.25, ResiHP §5.2) x
   predicted: validation. Otherwise the change is benign (workload-induced): its points are
   removed from the series (BOCPD is restored to its state before c) and validation is skipped;
4. validation localizes: per rank, observed / predicted compute time of its timed
   micro-batches over c..t; the rank with the largest ratio is slow if it exceeds the median of
   the other ranks' ratios by `localize_ratio`; the quotient is the slowdown factor (`what` =
   compute). Then the communication: per rank, its gradient all-reduce time (`comm_s`) less
   its observed wait for the last rank to finish computing (measured, not predicted: a
   mispredicted workload must not turn waiting into a slow link), over its healthy link time
   (the warm-up median of the same); a rank whose own excess explains `comm_explains` of the
   iteration's excess that the slowest replica's compute does not, and is at least
   `localize_ratio - 1` of the iteration time, is comm-slow (`what` = comm, factor = link time
   over healthy). One such rank: it is named (a rank whose
   collective returns late, as the `slow ... what=comm` fault does). Several: the collective
   itself is slow on every member (a slow link in a ring) and per-rank timings cannot say
   whose link it is — reported with rank None, at the sync stage. If both a compute outlier
   and a comm-slow rank are found, the one whose excess (seconds over the window) is larger
   is reported: on a noisy machine a rank's compute can stand out by chance while its link
   costs seconds. Found: a `FailSlowReport`
   (also sent to the sink as a `DetectionEvent`). Not found: a false alarm — and if the
   window's micro-batches lie outside the sum l^2 / N^2 span the model was fitted on (the
   model was extrapolating), the model is refitted with them and the window dropped from the
   series (`_learn`).

A hybrid-parallel plan (`FailSlowDetector(plan=...)`) changes the model, not the steps: the
prediction is the plan's dry-run simulation with per-micro-batch chunk costs, and validation
compares the ranks' busy time (`StageTiming`) with their predicted compute; the report names
the slow rank's physical stage (`unbroken.detect.pipeline`). The communication checks of
step 4 are data-parallel only (a plan's ranks fire no all-reduce bucket hooks).

`baseline=True` is the same detector without step 3's workload filter (Greyhound): every change
point goes to validation, and a validation that finds no slow rank is a false alarm. With
`baseline_slowdowns_only` only change points to a slower level are validated (a change to a
faster level is accepted as the new normal), a stricter baseline reported next to it. Both modes count the time spent in `observe` and in validation.

The detector never reads the fault injector's records, never sleeps, and never talks to ranks:
what it knows comes from the observations.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from unbroken.detect.bocpd import Bocpd, BocpdConfig, BocpdState, ChangePoint
from unbroken.detect.events import DetectionEvent, DetectionKind, DetectionSink
from unbroken.detect.pipeline import (
    LayerPace,
    PlanFit,
    fit_plan,
    fixed_share,
    held_layers,
    layout_bias,
)
from unbroken.detect.timing import RankTiming, StageTiming
from unbroken.detect.workload import (
    DataParallelFit,
    DataParallelSchedule,
    WorkloadPredictor,
    sum_sq,
)
from unbroken.parallel import ParallelPlan

__all__ = [
    "Decision",
    "DetectorConfig",
    "FailSlowDetector",
    "FailSlowReport",
    "Observation",
    "SpeedRecovered",
    "Verdict",
    "mb_samples",
]


@dataclass(kw_only=True, slots=True)
class DetectorConfig:
    """Thresholds of the fail-slow detector (sources in docs/detect.md)."""

    skip_iters: int = 2
    """First iterations ignored (process start, allocator and cache warm-up)."""
    warmup_iters: int = 10
    """Iterations after the skipped ones that fit alpha, beta, the sync constant and the prior."""
    slow_ratio: float = 1.25
    """Observed > slow_ratio x predicted at a change point -> validation (ResiHP §5.2)."""
    localize_ratio: float = 1.2
    """A rank is slow when its observed/predicted compute ratio is this much over its peers'."""
    comm_explains: float = 0.5
    """A rank's own all-reduce excess (beyond waiting for slower peers) must be at least this
    share of the iteration's excess over predicted that compute does not explain, for a comm
    fail-slow."""
    plan_explains: float = 0.5
    """A plan's slow rank: its busy-time excess (seconds beyond its peers' pace) must be at
    least this share of the iteration's excess over predicted. A slow stage stretches a
    pipeline by at most (M + pp - 1) / M <= 2 times its own excess; a machine that slows every
    rank (other load on the host) gives a large iteration excess that no one rank explains."""
    recover_ratio: float = 1.1
    """A rank reported compute-slow is whole again when its observed/predicted compute ratio
    is at most this much over its peers' (its own healthy pace with no peers) over the last
    `recover_window` iterations, all after the report (a plan's rank: against the holders of
    its stages in the other replicas; a one-replica pipeline's: against its own healthy
    compute per layer before the slowdown, `LayerPace`, read as the median iteration of the
    window, so a device back at full speed is found once most of the window is)."""
    recover_window: int = 8
    noise_floor: float = 0.02
    """Smallest relative standard deviation assumed for a run of the series (prior)."""
    history: int = 8
    """Accepted points before a change that define the level it changed from (baseline)."""
    baseline: bool = False
    """Greyhound-style: no workload filter; every change point is validated."""
    baseline_slowdowns_only: bool = False
    """Baseline variant: validate only change points to a slower level (a speed-up is taken
    as the new normal). Stricter than the issue's baseline; reported next to it."""
    bocpd: BocpdConfig = field(default_factory=BocpdConfig)

    def __post_init__(self) -> None:
        if self.skip_iters < 0 or self.warmup_iters < 3:
            raise ValueError("detector.skip_iters must be >= 0 and warmup_iters >= 3")
        if self.slow_ratio <= 1.0 or self.localize_ratio <= 1.0:
            raise ValueError("detector.slow_ratio and localize_ratio must be > 1")
        if not 0.0 < self.noise_floor < 1.0:
            raise ValueError("detector.noise_floor must be in (0, 1)")
        if self.history < 1:
            raise ValueError("detector.history must be >= 1")
        if not 1.0 <= self.recover_ratio <= self.localize_ratio or self.recover_window < 2:
            raise ValueError(
                "detector.recover_ratio must be in [1, localize_ratio], recover_window >= 2"
            )
        if not 0.0 < self.comm_explains <= 1.0 or not 0.0 <= self.plan_explains <= 1.0:
            raise ValueError("detector.comm_explains must be in (0, 1], plan_explains in [0, 1]")


@dataclass(frozen=True, slots=True)
class Observation:
    """What the detector sees of one iteration.

    Attributes:
        iteration: the iteration number.
        seconds: its wall time (rank 0's `iter_s`).
        doc_lengths: `[replica][micro-batch] -> segment lengths`; in a data-parallel plan rank
            r runs replica r.
        ranks: per-rank timings of this iteration (`PhaseTimer`), or None if not collected.
        stages: a plan's per-rank timings (`StageTiming`, from the engine's workers).
    """

    iteration: int
    seconds: float
    doc_lengths: Sequence[Sequence[Sequence[int]]]
    ranks: Mapping[int, RankTiming] | None = None
    stages: Mapping[int, StageTiming] | None = None


@dataclass(frozen=True, slots=True)
class FailSlowReport:
    """A validated fail-slow: `rank` (pipeline `stage`) runs `factor` x slower than healthy,
    since iteration `iteration`; detected after iteration `detected_at`. `what` says whether its
    compute or its gradient all-reduce is slow; a comm fail-slow that slows every member's
    collective alike has `rank` None (slow at the sync stage, link not localized)."""

    rank: int | None
    stage: int
    factor: float
    iteration: int
    detected_at: int
    what: str = "compute"


@dataclass(frozen=True, slots=True)
class SpeedRecovered:
    """A rank reported compute-slow (`report`) runs at `factor` x its peers' pace over
    iterations `first`..`last`: healthy again (`DetectorConfig.recover_ratio`)."""

    report: FailSlowReport
    factor: float
    first: int
    last: int


class Verdict(enum.StrEnum):
    WARMUP = "warmup"
    QUIET = "quiet"
    """No change point."""
    ACCEPTED = "accepted"
    """A change point to a faster level (slowdowns-only baseline), kept as the new normal."""
    BENIGN = "benign"
    """A change point explained by the workload: dropped from the series, not validated."""
    FALSE_ALARM = "false_alarm"
    """Validated, no slow rank found."""
    FAIL_SLOW = "fail_slow"
    """Validated, slow rank found and reported."""
    KNOWN = "known"
    """Validated, the slow rank was already reported."""


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    iteration: int
    change: ChangePoint | None = None
    change_iteration: int | None = None
    observed_over_predicted: float | None = None
    report: FailSlowReport | None = None
    validation_s: float = 0.0


SPAN_MARGIN = 0.1
"""How far (relative) outside the fitted sum l^2 / N^2 span a window must reach to be learned
from: within it, timing noise and the span's own edges are not extrapolation."""


def mb_samples(observations: Sequence[Observation]) -> list[tuple[Sequence[int], float]]:
    """(doc lengths, seconds) of every timed micro-batch of `observations`."""
    samples = []
    for obs in observations:
        for rank, t in (obs.ranks or {}).items():
            lengths = obs.doc_lengths[rank]
            samples += [(lengths[m], s) for m, s in enumerate(t.mb_s)]
    return samples


def _waits(obs: Observation) -> dict[int, float]:
    """Seconds each rank waited in the gradient all-reduce of this iteration for the last
    rank to finish computing: the latest compute end minus its own (all start together)."""
    done = {r: sum(t.mb_s) for r, t in (obs.ranks or {}).items()}
    last = max(done.values(), default=0.0)
    return {r: last - d for r, d in done.items()}


def _span(samples: Sequence[tuple[Sequence[int], float]]) -> tuple[float, float]:
    """Smallest and largest sum l^2 / N^2 of micro-batch samples."""
    shares = [sum_sq(d) / sum(d) ** 2 for d, _ in samples]
    return min(shares), max(shares)


def _misplaced(window: Sequence[_Point], older: Sequence[_Point], min_run: int) -> int:
    """How many of a change's first points belong to the level before it: BOCPD places a
    change at the start of its likeliest run, and a point just before a slowdown that was
    itself an outlier on the fast side (one iteration 25 % quick on a loaded host) is likelier
    as the first point of the new run than as an outlier of the old one, so the change was
    placed one iteration early. A change to a slower level begins at its first point slower
    than the level before (median of `older`), a change to a faster one at its first faster
    point; at least `min_run` points stay."""
    if not older or len(window) <= min_run:
        return 0
    level = statistics.median(p.x for p in older)
    direction = statistics.fmean(p.x for p in window[1:]) - level
    skip = 0
    while len(window) - skip > min_run and (window[skip].x - level) * direction <= 0:
        skip += 1
    return skip


@dataclass(frozen=True, slots=True)
class _Point:
    obs: Observation
    x: float
    before: BocpdState


class FailSlowDetector:
    """Feed `observe` once per iteration, in order.

    Args:
        cfg: thresholds.
        sink: receives each report as a `DetectionEvent`.
        plan: the hybrid-parallel plan the job runs; observations then carry `stages`. None:
            data-parallel training, observations carry `ranks`.
        suspects: ranks of a plan checked against their peers through the warm-up
            (`_slow_through_warmup`): devices re-admitted on trial after being found slow.
        references: a one-replica pipeline's ranks -> their healthy compute per layer from
            the world before (`layer_paces`, same device, same layers): what a rank without
            peers is checked against through the warm-up (`_slow_through_warmup`).
    """

    def __init__(
        self,
        cfg: DetectorConfig | None = None,
        *,
        sink: DetectionSink | None = None,
        plan: ParallelPlan | None = None,
        suspects: frozenset[int] = frozenset(),
        references: Mapping[int, LayerPace] | None = None,
    ) -> None:
        self.cfg = cfg or DetectorConfig()
        self.suspects = suspects
        self.references = dict(references or {})
        self.sink = sink
        self.plan = plan
        self._plan_fit: PlanFit | None = None
        self.predictor: WorkloadPredictor | None = None
        self.bocpd: Bocpd | None = None
        self.scale = 1.0
        self._seen = 0
        self._warm: list[Observation] = []
        self._points: deque[_Point] = deque(maxlen=self.cfg.bocpd.late + self.cfg.history + 2)
        self.reported: dict[tuple[int | None, str], FailSlowReport] = {}
        """Reports so far by (rank, what)."""
        self._comm_healthy: dict[int, float] = {}
        self.observe_s = 0.0
        """Total seconds spent in `observe` (detector overhead)."""
        self.validations: list[float] = []
        """Seconds of each validation run."""
        self._fitted: list[Observation] = []
        """Observations the workload model is fitted on (warm-up, then learned windows)."""
        self._fitted_span = (0.0, 0.0)
        """Smallest and largest sum l^2 / N^2 among the fitted micro-batches."""
        self.refits = 0
        """Times the model was refitted on a window outside its span (`_learn`)."""
        self._recent: deque[Observation] = deque(maxlen=self.cfg.recover_window)
        """The last observations after the warm-up, whatever BOCPD kept (`_check_recovered`)."""
        self.recovered: list[SpeedRecovered] = []
        """Recoveries found and not yet taken (`take_recovered`)."""
        self.healthy: dict[int, LayerPace] = {}
        """A one-replica pipeline's ranks reported compute-slow -> their healthy compute per
        layer before the slowdown (`_note_healthy`): what their return to speed is measured
        against, whatever layers a re-plan left them."""
        self.layer_refs: dict[int, LayerPace] = {}
        """A one-replica pipeline's every rank -> its compute per layer on the healthy
        iterations before the first report (`_note_healthy`): the ranks the report does not
        name measure what a layer move alone does to a rank's reading (`_layout_bias`)."""

    @property
    def plan_fit(self) -> PlanFit | None:
        """A plan job's warm-up fit (None before the warm-up ends, or data parallel)."""
        return self._plan_fit

    @property
    def data_parallel_fit(self) -> DataParallelFit | None:
        """A data-parallel job's warm-up costs (None before the warm-up ends, or a plan)."""
        if self.plan is not None or self.predictor is None or not self._fitted:
            return None
        schedule = self.predictor.schedule
        samples = mb_samples(self._fitted)
        if not samples or not isinstance(schedule, DataParallelSchedule):
            return None
        return DataParallelFit(
            mb_s=statistics.median(s for _, s in samples), sync_s=max(schedule.sync_s, 0.0)
        )

    def layer_paces(self) -> dict[int, LayerPace]:
        """A plan's every rank -> its compute per layer over this detector's warm-up (healthy
        when the warm-up had no slow rank): references a next world's detector holds the same
        devices to (`references`). Empty before the warm-up ends or without a plan."""
        if self.plan is None or self.predictor is None or self.bocpd is None:
            return {}
        return self._layer_paces(self._warm)

    def _layer_paces(self, window: Sequence[Observation]) -> dict[int, LayerPace]:
        """Every rank of the plan not reported compute-slow -> its compute per layer over
        `window` (ranks that computed nothing are left out)."""
        assert self.plan is not None and self.predictor is not None
        stages = [(o.doc_lengths, o.stages or {}) for o in window]
        paces = {
            r: LayerPace.measure(self.plan, self.predictor.mb, stages, r) for r in self.plan.ranks
        }
        return {
            r: p for r, p in paces.items() if p is not None and (r, "compute") not in self.reported
        }

    def carry_reports(self, other: FailSlowDetector) -> None:
        """Take over `other`'s open compute reports: a job that switched plans live around a
        slow rank keeps its rank numbering, and this detector (warmed up on the new plan, whose
        fit holds the slowness) must still know which rank to watch for a return to speed
        (and must not report it again as new). A one-replica pipeline's rank also keeps its
        healthy pace (`healthy`): this detector's fit, on the new plan, has only seen it slow."""
        self.reported.update(other.reported)
        self.healthy.update(other.healthy)
        for rank, pace in other.layer_refs.items():
            self.layer_refs.setdefault(rank, pace)

    # -- warm-up ---------------------------------------------------------------------------

    def _finish_warmup(self) -> None:
        if self.plan is not None:
            self._plan_fit = fit_plan(
                self.plan, [(o.doc_lengths, o.seconds, o.stages or {}) for o in self._warm]
            )
            self.predictor = self._plan_fit.predictor
        else:
            self._fit_data_parallel()
        self.scale = statistics.median(o.seconds for o in self._warm)
        xs = [self._x(o) for o in self._warm]
        var = max(statistics.pvariance(xs), self.cfg.noise_floor**2)
        prior = dataclasses.replace(self.cfg.bocpd, mu0=0.0, beta0=self.cfg.bocpd.alpha0 * var)
        self.bocpd = Bocpd(prior)
        for obs in self._warm:
            before = self.bocpd.snapshot()
            x = self._x(obs)
            self.bocpd.update(x)
            self._points.append(_Point(obs=obs, x=x, before=before))
        self.bocpd.last_index = self.bocpd.t - 1

    def _slow_through_warmup(self, iteration: int) -> Decision | None:
        """A rank that was slow through the whole warm-up, reported at its end, or None.

        BOCPD finds changes, and a series that starts slow has none: a device slow from the
        job's start, or one that slowed down just before (or just after) a re-plan's fresh
        detector began warming up, would never be reported (`bench adapt`'s mixed schedule: a
        device lost, then another 5x slow three iterations later, never re-planned). Its peers
        are the reference instead: a rank whose observed / predicted compute over the warm-up
        exceeds its peers' median by `localize_ratio` and `slow_ratio` both (the stricter of
        the two: no change point backs this report). Ours, data parallel with two ranks or
        more. In a plan of two replicas or more, only the `suspects` (devices re-admitted on
        trial), held to the holders of their stages in the other replicas (`PlanFit.pace`):
        a pace is the ratio of two ranks' few first actions, and on a fault-free PP2 x DP2
        launch on this 2-core VM a healthy rank read 1.28x its peer over the warm-up. In a
        one-replica pipeline, whose ranks have no peers, the ranks with a healthy reference
        of their own from the world before (`references`: a stage left alone when a lost
        device dissolved its peer's replica), held to it."""
        cfg = self.cfg
        if cfg.baseline:
            return None
        found = self._slowest_through_warmup()
        if found is None:
            return None
        slow, factor = found
        if factor < max(cfg.localize_ratio, cfg.slow_ratio) or (slow, "compute") in self.reported:
            return None
        first = self._warm[0].iteration
        report = self._new_report(slow, factor, "compute", first, iteration)
        if slow in self.references:  # no healthy iteration here: its return is held to it
            self.healthy.setdefault(slow, self.references[slow])
        self._emit(
            report,
            reason=f"rank {slow}'s compute took {factor:.2f}x "
            + (
                "its healthy pace per layer"
                if self.plan is not None and self.plan.dp == 1
                else "its peers'"
            )
            + " through the detector's "
            f"warm-up (iterations {first}..{iteration}): slow since before it began",
        )
        return Decision(verdict=Verdict.FAIL_SLOW, iteration=iteration, report=report)

    def _slowest_through_warmup(self) -> tuple[int, float] | None:
        """The rank whose compute over the warm-up is the slowest against its peers', and that
        factor (`_slow_through_warmup`), or None: fewer than two ranks to compare."""
        if self.plan is not None and self.plan.dp == 1:
            return self._slowest_against_references()
        if self.plan is not None:
            if self._plan_fit is None:
                return None
            window = [(o.doc_lengths, o.stages or {}) for o in self._warm]
            paces = {r: self._plan_fit.pace(window, r) for r in self.suspects}
            known = {r: p for r, p in paces.items() if p is not None}
            if not known:
                return None
            slow = max(known, key=lambda r: known[r])
            return slow, known[slow]
        _, _, ratios = self._compute_ratios(self._warm)
        if len(ratios) < 2:
            return None
        slow = max(ratios, key=lambda r: ratios[r])
        return slow, ratios[slow] / statistics.median(v for r, v in ratios.items() if r != slow)

    def _slowest_against_references(self) -> tuple[int, float] | None:
        """A one-replica pipeline's rank with a healthy reference from the world before
        (`references`, measured on the layers it holds now: the caller's check), whose
        compute per layer over the warm-up is the largest multiple of it, and that multiple;
        None when no rank has one. No layout bias (the same layers) to take out."""
        assert self.plan is not None
        window = [(o.doc_lengths, o.stages or {}) for o in self._warm]
        ratios = {}
        for rank, ref in self.references.items():
            if (ratio := ref.ratio(self.plan, window, rank)) is not None:
                ratios[rank] = ratio
        if not ratios:
            return None
        slow = max(ratios, key=lambda r: ratios[r])
        return slow, ratios[slow]

    def _x(self, obs: Observation) -> float:
        """The point BOCPD sees: the log of the iteration time over its predicted healthy time
        for this workload (ours), or over the warm-up median (baseline, which knows no
        workload).

        The log because timing noise is relative: a rank 8x slower swings 8x as many
        milliseconds as a healthy one. On the ratio itself BOCPD's new run carried the
        warm-up's (healthy) variance, so a slow level's own noise looked like outliers of it
        and an 8x slowdown on PP2 was declared 3-4 iterations after it began instead of 2
        (a CI run: 4, past the detector's documented 3). On the log the noise is one size at
        every level."""
        if self.cfg.baseline or self.predictor is None:
            ratio = obs.seconds / self.scale
        else:
            ratio = obs.seconds / max(self.predictor.iteration_time(obs.doc_lengths), 1e-9)
        return math.log(max(ratio, 1e-9))

    def _fit_data_parallel(self) -> None:
        samples = mb_samples(self._warm)
        if not samples:
            raise ValueError(
                "fail-slow warm-up needs per-rank micro-batch timings (PhaseTimer records)"
            )
        self._fitted = list(self._warm)
        self._fitted_span = _span(samples)
        self.predictor = WorkloadPredictor.fit_data_parallel(
            samples, [(o.doc_lengths, o.seconds) for o in self._warm]
        )
        comm: dict[int, list[float]] = {}
        for obs in self._warm:
            waits = _waits(obs)
            for rank, t in (obs.ranks or {}).items():
                comm.setdefault(rank, []).append(max(0.0, t.comm_s - waits[rank]))
        self._comm_healthy = {r: statistics.median(v) for r, v in comm.items()}

    # -- online ----------------------------------------------------------------------------

    def observe(self, obs: Observation) -> Decision:
        t0 = time.perf_counter()
        try:
            decision = self._observe(obs)
            # A rank with a healthy pace of its own is watched from the first iteration past
            # the skipped ones: that reference needs no fit of this detector's plan.
            if self.bocpd is not None or (self.healthy and self._seen > self.cfg.skip_iters):
                self._recent.append(obs)
                self._check_recovered()
            return decision
        finally:
            self.observe_s += time.perf_counter() - t0

    def take_recovered(self) -> list[SpeedRecovered]:
        """The recoveries found since the last call (each once)."""
        out, self.recovered = self.recovered, []
        return out

    def _check_recovered(self) -> None:
        """Each rank reported compute-slow whose last `recover_window` iterations, all after
        its report, ran within `recover_ratio` of its peers' pace: recorded in `recovered`
        and its report forgotten (a new slowdown of it is reported again). A plan's rank is
        compared with the holders of its stages in the other replicas (`PlanFit.pace`), a
        one-replica pipeline's with its own healthy pace per layer (`LayerPace`)."""
        window = list(self._recent)
        if len(window) < self.cfg.recover_window:
            return
        slow = [k for k in self.reported if k[1] == "compute" and k[0] is not None]
        for key in slow:
            report, rank = self.reported[key], key[0]
            if window[0].iteration <= report.detected_at:
                continue
            factor = self._recovery_pace(window, rank)
            if factor is not None and factor <= self.cfg.recover_ratio:
                del self.reported[key]
                self.healthy.pop(rank, None)
                self.recovered.append(
                    SpeedRecovered(report, factor, window[0].iteration, window[-1].iteration)
                )

    def _recovery_pace(self, window: Sequence[Observation], rank: int) -> float | None:
        """`rank`'s pace over `window` against what it is held to (`_check_recovered`), or
        None when that is not known yet (no fit, no healthy pace)."""
        if self.plan is not None and self.plan.dp == 1:
            healthy = self.healthy.get(rank)
            if healthy is None:
                return None
            stages = [(o.doc_lengths, o.stages or {}) for o in window]
            ratio = healthy.ratio(self.plan, stages, rank)
            return None if ratio is None else ratio / self._layout_bias(stages, rank, healthy)
        if self._plan_fit is not None:
            stages = [(o.doc_lengths, o.stages or {}) for o in window]
            return self._plan_fit.pace(stages, rank)
        if self.plan is None and self.predictor is not None:
            return self._pace_against_peers(window, rank)
        return None

    def _layout_bias(self, stages, rank: int, healthy: LayerPace) -> float:
        """What moving layers alone does to `rank`'s per-layer reading (`layout_bias`), with
        the fixed cost per action measured on the ranks not reported slow whose layer count
        changed too (`fixed_share`, their median); 1 when none did."""
        assert self.plan is not None
        shares = []
        for q, ref in self.layer_refs.items():
            if q == rank or (q, "compute") in self.reported or q not in self.plan.ranks:
                continue
            now = held_layers(self.plan, q)
            ratio = ref.ratio(self.plan, stages, q)
            if ratio is not None and (rho := fixed_share(ref.layers, now, ratio)) is not None:
                shares.append(rho)
        if not shares:
            return 1.0
        return layout_bias(healthy.layers, held_layers(self.plan, rank), statistics.median(shares))

    def _note_healthy(self, rank: int, before: int) -> None:
        """A one-replica pipeline's rank reported compute-slow from iteration `before` on:
        keep its compute per layer over the last `history` iterations before it that the
        series kept (`LayerPace`), priced by this fit's workload model."""
        assert self.plan is not None and self.predictor is not None
        healthy = [p.obs for p in self._points if p.obs.iteration < before][-self.cfg.history :]
        pace = LayerPace.measure(
            self.plan,
            self.predictor.mb,
            [(o.doc_lengths, o.stages or {}) for o in healthy],
            rank,
        )
        if pace is not None:
            self.healthy[rank] = pace
        for q, ref in self._layer_paces(healthy).items():
            self.layer_refs.setdefault(q, ref)

    def _pace_against_peers(self, window: Sequence[Observation], rank: int) -> float | None:
        """`rank`'s pace against its peers' over `window`: the observed over predicted time of
        its first micro-batches of the window's iterations, over the median of its peers' same
        ratio (its own with no peers); None if it ran in none of them.

        Like with like: a rank the re-plan left with one micro-batch runs only an iteration's
        first, which carries the iteration's start-up (and, where ranks share cores, runs
        while every peer computes too), while its peers' later micro-batches do not. Compared
        over all micro-batches, such a rank looked up to 1.3x slower than it was on the 2-core
        VM, and a device back at full speed was not found in every run."""
        observed: dict[int, float] = {}
        predicted: dict[int, float] = {}
        for obs in window:
            for r, t in (obs.ranks or {}).items():
                if t.mb_s and obs.doc_lengths[r]:
                    observed[r] = observed.get(r, 0.0) + t.mb_s[0]
                    predicted[r] = predicted.get(r, 0.0) + self.predictor.mb.predict(
                        obs.doc_lengths[r][0]
                    )
        paces = {r: observed[r] / predicted[r] for r in observed if predicted[r] > 0}
        if rank not in paces:
            return None
        peers = [v for r, v in paces.items() if r != rank]
        return paces[rank] / (statistics.median(peers) if peers else 1.0)

    def _observe(self, obs: Observation) -> Decision:
        self._seen += 1
        cfg = self.cfg
        if self._seen <= cfg.skip_iters:
            return Decision(verdict=Verdict.WARMUP, iteration=obs.iteration)
        if self.bocpd is None:
            self._warm.append(obs)
            if len(self._warm) == cfg.warmup_iters:
                self._finish_warmup()
                if (slow := self._slow_through_warmup(obs.iteration)) is not None:
                    return slow
            return Decision(verdict=Verdict.WARMUP, iteration=obs.iteration)
        before = self.bocpd.snapshot()
        x = self._x(obs)
        cp = self.bocpd.update(x)
        self._points.append(_Point(obs=obs, x=x, before=before))
        if cp is None:
            return Decision(verdict=Verdict.QUIET, iteration=obs.iteration)
        window, older, cp = self._window(cp)
        observed = sum(p.obs.seconds for p in window)
        predicted = sum(self.predictor.iteration_time(p.obs.doc_lengths) for p in window)
        ratio = observed / predicted if predicted > 0 else float("inf")
        common = dict(
            iteration=obs.iteration,
            change=cp,
            change_iteration=window[0].obs.iteration,
            observed_over_predicted=ratio,
        )
        if cfg.baseline:
            if cfg.baseline_slowdowns_only:
                level_before = statistics.fmean(p.x for p in older) if older else 0.0
                if statistics.fmean(p.x for p in window) <= level_before:
                    return Decision(verdict=Verdict.ACCEPTED, **common)
        elif ratio <= cfg.slow_ratio:
            # Benign: forget these points, as if they had never been fed; if the workload
            # model was extrapolating to them, learn them first (no validation either way).
            self._learn([p.obs for p in window])
            self._drop(window, cp)
            return Decision(verdict=Verdict.BENIGN, **common)
        v0 = time.perf_counter()
        if self._plan_fit is not None:
            found = self._localize_plan([p.obs for p in window], observed - predicted)
        else:
            found = self._localize([p.obs for p in window], observed, predicted)
        spent = time.perf_counter() - v0
        self.validations.append(spent)
        if found is None:
            if self._learn([p.obs for p in window]):
                self._drop(window, cp)
            return Decision(verdict=Verdict.FALSE_ALARM, validation_s=spent, **common)
        rank, factor, what = found
        if (rank, what) in self.reported:
            return Decision(verdict=Verdict.KNOWN, validation_s=spent, **common)
        report = self._new_report(rank, factor, what, window[0].obs.iteration, obs.iteration)
        self._emit(report, ratio)
        return Decision(verdict=Verdict.FAIL_SLOW, report=report, validation_s=spent, **common)

    def _window(self, cp: ChangePoint) -> tuple[list[_Point], list[_Point], ChangePoint]:
        """A declared change's points, the `history` points before them, and the change;
        its leading points that belong to the level before it are left out (`_misplaced`)."""
        n_new = cp.at - cp.index + 1
        older = list(self._points)[:-n_new][-self.cfg.history :]
        window = list(self._points)[-n_new:]
        if (skip := _misplaced(window, older, self.cfg.bocpd.min_run)) > 0:
            window = window[skip:]
            cp = dataclasses.replace(cp, index=cp.index + skip)
            self.bocpd.last_index = cp.index
        return window, older, cp

    def _new_report(
        self, rank: int | None, factor: float, what: str, iteration: int, detected_at: int
    ) -> FailSlowReport:
        """Record a new fail-slow of `rank` (None: every rank) in `what`, by `factor`, from
        `iteration` on, found at `detected_at`."""
        stage = 0 if self.plan is None or rank is None else self.plan.locate(rank)[1]
        report = FailSlowReport(
            rank=rank,
            stage=stage,
            factor=factor,
            iteration=iteration,
            detected_at=detected_at,
            what=what,
        )
        self.reported[(rank, what)] = report
        if self.plan is not None and self.plan.dp == 1 and what == "compute" and rank is not None:
            self._note_healthy(rank, iteration)
        return report

    def _emit(self, report: FailSlowReport, ratio: float = 0.0, reason: str | None = None) -> None:
        """Hand the report to the sink (if any) as a `DetectionEvent` with a readable reason
        (`reason`, else one built from `ratio`: observed over predicted time of the iterations
        since the change)."""
        if self.sink is None:
            return
        rank, stage, factor, what = report.rank, report.stage, report.factor, report.what
        who = "every rank's" if rank is None else f"rank {rank}'s"
        if self.plan is not None and rank is not None:
            who = f"stage {stage}: {who}"
        part = "compute" if what == "compute" else "gradient all-reduce"
        self.sink.emit(
            DetectionEvent(
                kind=DetectionKind.FAIL_SLOW,
                rank=rank,
                stage=stage,
                factor=factor,
                iteration=report.iteration,
                detected_at=report.detected_at,
                cause=what,
                reason=reason
                or (
                    f"iterations {report.iteration}..{report.detected_at} took {ratio:.2f}x the "
                    f"predicted healthy time; {who} {part} takes {factor:.2f}x "
                    + ("its peers'" if what == "compute" else "its healthy time")
                ),
            )
        )

    def _drop(self, window: Sequence[_Point], cp: ChangePoint) -> None:
        """Remove the window's points from the series (BOCPD back to its state before them)."""
        self.bocpd.restore(window[0].before)
        self.bocpd.last_index = cp.index - 1
        for _ in range(len(window)):
            self._points.pop()

    def _learn(self, window: Sequence[Observation]) -> bool:
        """After a benign change point, or a validation that found every rank healthy: if the
        window's micro-batches lie outside the sum l^2 / N^2 span the model was fitted on (it
        was extrapolating, e.g. a warm-up that saw only long documents meets a phase of
        short ones), refit it with them and return True. Within the span nothing is learned:
        there the fit is interpolating, and a slowdown validation could not localize must not
        become the new normal. A benign window is learned without validation: its time is
        within `slow_ratio` of the prediction, so whatever slowness it holds is below what
        the detector reports anyway. Ours, data parallel only (a plan's fit is
        `fit_plan`'s)."""
        if self.cfg.baseline or self.plan is not None:
            return False
        samples = mb_samples(window)
        if not samples:
            return False
        lo, hi = self._fitted_span
        new_lo, new_hi = _span(samples)
        if lo * (1 - SPAN_MARGIN) <= new_lo and new_hi <= hi * (1 + SPAN_MARGIN):
            return False
        self._fitted += window
        fitted = mb_samples(self._fitted)
        self._fitted_span = _span(fitted)
        self.predictor = WorkloadPredictor.fit_data_parallel(
            fitted, [(o.doc_lengths, o.seconds) for o in self._fitted]
        )
        self.refits += 1
        return True

    def _localize_plan(
        self, window: Sequence[Observation], excess_s: float
    ) -> tuple[int, float, str] | None:
        """(slow rank, factor, "compute") of a plan from its ranks' busy time, or None: the
        rank whose busy time over the window is the largest multiple of its predicted one, by
        at least `localize_ratio` over the other ranks' median, and whose excess explains
        `plan_explains` of the iteration's `excess_s` (`unbroken.detect.pipeline`)."""
        assert self._plan_fit is not None
        busy = self._plan_fit.busy([(o.doc_lengths, o.stages or {}) for o in window])
        ratios = {r: o / p for r, (o, p) in busy.items()}
        if len(ratios) < 2:
            return None
        slow = max(ratios, key=lambda r: ratios[r])
        peers = statistics.median(v for r, v in ratios.items() if r != slow)
        factor = ratios[slow] / peers
        observed, predicted = busy[slow]
        own_excess = observed - peers * predicted  # beyond what slows every rank alike
        if factor >= self.cfg.localize_ratio and own_excess >= self.cfg.plan_explains * excess_s:
            return slow, factor, "compute"
        return None

    def _localize(
        self, window: Sequence[Observation], observed_s: float, predicted_s: float
    ) -> tuple[int | None, float, str] | None:
        """(slow rank or None, factor, "compute" | "comm") from per-rank timings, or None.

        `observed_s`, `predicted_s`: iteration time over the window, measured and predicted.
        """
        observed, predicted, ratios = self._compute_ratios(window)
        comm: dict[int, float] = {}
        waited: dict[int, float] = {}
        for obs in window:
            for rank, w in _waits(obs).items():
                waited[rank] = waited.get(rank, 0.0) + w
            for rank, t in (obs.ranks or {}).items():
                comm[rank] = comm.get(rank, 0.0) + t.comm_s
        if len(ratios) == 1:
            # One rank, no peers to compare with: its own healthy pace — the workload model
            # fitted on its warm-up — is the reference, so its ratio is its slowdown.
            ((slow, factor),) = ratios.items()
            return (slow, factor, "compute") if factor >= self.cfg.localize_ratio else None
        if len(ratios) < 2:
            return None
        slow = max(ratios, key=lambda r: ratios[r])
        peers = statistics.median(v for r, v in ratios.items() if r != slow)
        factor = ratios[slow] / peers
        found = self._localize_comm(
            len(window), observed, predicted, comm, waited, observed_s, predicted_s
        )
        if factor >= self.cfg.localize_ratio:
            # A rank that computes slower arrives last at every collective, so it waits in
            # them least while its peers' all-reduce time grows by waiting for it (also for
            # its stalls outside the micro-batches, which `waited` cannot see). A slow link
            # is the opposite: its own all-reduce is the longest. So when the compute
            # outlier waited least, the peers' comm excess is waiting for it.
            if len(comm) > 1 and comm.get(slow, 0.0) <= min(
                v for r, v in comm.items() if r != slow
            ):
                return slow, factor, "compute"
            # Otherwise name what explains more of the slowdown (a noisy rank's compute must
            # not hide a link that costs seconds).
            compute_excess = observed[slow] - peers * predicted[slow]
            if found is None or found[3] <= compute_excess:
                return slow, factor, "compute"
        return None if found is None else found[:3]

    def _compute_ratios(
        self, window: Sequence[Observation]
    ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """Per rank over `window`: (observed compute seconds of its timed micro-batches, their
        predicted healthy seconds, observed / predicted)."""
        observed: dict[int, float] = {}
        predicted: dict[int, float] = {}
        for obs in window:
            for rank, t in (obs.ranks or {}).items():
                lengths = obs.doc_lengths[rank]
                observed[rank] = observed.get(rank, 0.0) + sum(t.mb_s)
                predicted[rank] = predicted.get(rank, 0.0) + sum(
                    self.predictor.mb.predict(lengths[m]) for m in range(len(t.mb_s))
                )
        ratios = {r: observed[r] / predicted[r] for r in observed if predicted[r] > 0}
        return observed, predicted, ratios

    def _localize_comm(
        self,
        n: int,
        observed: Mapping[int, float],
        predicted: Mapping[int, float],
        comm: Mapping[int, float],
        waited: Mapping[int, float],
        observed_s: float,
        predicted_s: float,
    ) -> tuple[int | None, float, str, float] | None:
        """Comm fail-slow: ranks whose own all-reduce excess explains `comm_explains` of the
        iteration's excess that compute does not, and is, like a compute slowdown, at least
        `localize_ratio - 1` of the iteration.
        Returns (rank or None, factor, "comm", the largest own excess in seconds)."""
        healthy = self._comm_healthy
        excess_s = observed_s - predicted_s
        if excess_s <= 0 or not any(healthy.values()):
            return None  # no comm timings (older records, or no replicas)
        late = {r: observed[r] - predicted[r] for r in observed}
        # The part of the excess that the slowest replica's compute does not explain.
        unexplained = excess_s - max(0.0, max(late.values(), default=0.0))
        least = max(
            self.cfg.comm_explains * unexplained, (self.cfg.localize_ratio - 1) * observed_s
        )
        # Waiting in the all-reduce for a peer that computed longer is not this rank's link:
        # what is left of its all-reduce time beyond that wait, over its healthy link time.
        link = {r: comm[r] - waited.get(r, 0.0) for r in comm}
        own = {r: link[r] - n * healthy.get(r, 0.0) for r in comm}
        slow = [r for r, e in own.items() if e >= least]
        if not slow:
            return None
        rank = slow[0] if len(slow) == 1 else None
        ranks = slow if rank is None else [rank]
        factor = statistics.fmean(
            [link[r] / (n * healthy[r]) for r in ranks if healthy.get(r)] or [float("inf")]
        )
        return rank, factor, "comm", max(own[r] for r in ranks)
