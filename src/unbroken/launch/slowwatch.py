"""The coordinator's fail-slow watch: feeds every completed iteration — rank 0's iteration time
plus every rank's compute timings and micro-batch workload (`timings.jsonl`) — to the
workload-aware detector (`unbroken.detect.FailSlowDetector`), once per iteration and in order,
and turns its decisions into events. Redone iterations (after a recovery) are not fed again,
and the first `GRACE_ITERS` iterations of a new trainer generation are not fed at all: right
after a recovery the new shadows start up and caches are cold — a transient of the recovery,
not of a device. A rank reported compute-slow that runs at its peers' pace again (a
one-replica pipeline's rank, which has no peers: at its own compute per layer before the
slowdown, whatever layers a re-plan left it) is a `speed_recovered` event, handed to
`on_recovered` (the coordinator re-plans toward the original placement, issue 18).

With a hybrid-parallel plan each rank's record is its worker's `StageTiming` plus the
micro-batches it computed (global ids and segment lengths); the watch puts the replicas'
workloads together from all ranks' records and the detector simulates the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from unbroken.detect import (
    DetectorConfig,
    FailSlowDetector,
    Observation,
    RankTiming,
    SpeedRecovered,
    Verdict,
)
from unbroken.detect.pipeline import PlanFit
from unbroken.detect.timing import StageTiming
from unbroken.detect.workload import DataParallelFit
from unbroken.metrics.log import JsonlLog
from unbroken.parallel import ParallelPlan, held_stages

__all__ = ["GRACE_ITERS", "SlowWatch"]

GRACE_ITERS = 3
TRIAL_WARMUP = 4
"""Warm-up iterations of the detector of a world with a device re-admitted on trial (`reset`)."""


_NO_LENGTHS = "the data source reports no document lengths (T_MB = aN + b sum l^2)"


class SlowWatch:
    """Args: world_size (ranks that write timings), events (the run's event log), say
    (progress lines), cfg (detector thresholds), plan (the plan the job runs, if any)."""

    def __init__(
        self,
        world_size: int,
        events: JsonlLog,
        say,
        cfg: DetectorConfig | None = None,
        plan: ParallelPlan | None = None,
    ):
        self.world_size = world_size
        self.events = events
        self.say = say
        self.plan = plan
        self.detector = FailSlowDetector(cfg, plan=plan)
        self._timings: dict[int, dict[int, dict[str, Any]]] = {}
        self._metrics: dict[int, dict[str, Any]] = {}
        self._last_fed = -1
        self.disabled: str | None = None
        """Why the watch stopped (a dataset without document lengths, a detector error)."""
        self._generation = 0
        self._grace_until = -1
        self.on_recovered: Callable[[int, float, int], None] | None = None
        """Called with (rank, factor, iteration) when a rank reported compute-slow runs at its
        peers' pace again (`DetectorConfig.recover_ratio`); the coordinator offers its device
        back to the plan."""

    @property
    def fit(self) -> PlanFit | DataParallelFit | None:
        """The current detector's warm-up fit — a plan job's, or a data-parallel job's costs
        (None: not fitted yet): what the coordinator prices re-plans with (`calibrate`)."""
        return self.detector.plan_fit or self.detector.data_parallel_fit

    def reset(
        self,
        world_size: int,
        plan: ParallelPlan | None = None,
        *,
        same_ranks: bool = False,
        trial: tuple[int, ...] = (),
        moved: Mapping[int, int] | None = None,
    ) -> None:
        """The job continues on a world of `world_size` ranks (a lost device was planned
        around, issue 18) and, for a pipeline job, under `plan`: a fresh detector learns the
        new world (it warms up again); reports go to the same sink. `same_ranks`: a live
        switch that kept every rank (a slow device planned around) — the open reports carry
        over, so the slow rank's return to speed is still watched (`on_recovered`); else ranks
        are renumbered and the reports start over. `trial`: ranks of slow devices re-admitted
        on trial ([Note: slow device excluded] in `unbroken.launch.coordinator.adapt`): the
        detector warms up on `TRIAL_WARMUP` iterations, the fewest it fits on, so a device
        still slow is reported (against its peers through the warm-up, `suspects`) after a
        few iterations rather than a full warm-up's. `moved`: new rank -> its rank in the
        world before, for devices in both: a one-replica pipeline's rank that holds the same
        layers as before is held to its pace per layer then (`FailSlowDetector(references=)`),
        so a stage slow since before the new warm-up is found."""
        old = self.detector
        self.world_size = world_size
        before = self.plan
        if plan is not None:
            self.plan = plan
        references = {}
        if moved and self.plan is not None and self.plan.dp == 1 and before is not None:
            paces = old.layer_paces()
            references = {
                new: paces[was]
                for new, was in moved.items()
                if was in paces and held_stages(before, was) == held_stages(self.plan, new)
            }
        cfg = old.cfg
        if trial:
            cfg = dataclasses.replace(cfg, skip_iters=1, warmup_iters=TRIAL_WARMUP)
        self.detector = FailSlowDetector(
            cfg, plan=self.plan, sink=old.sink, suspects=frozenset(trial), references=references
        )
        if same_ranks:
            self.detector.carry_reports(old)
        self._timings.clear()
        self._metrics.clear()

    def add_timing(self, rec: dict[str, Any]) -> None:
        if rec["iter"] > self._last_fed:
            self._timings.setdefault(rec["iter"], {})[rec["rank"]] = rec

    def add_metric(self, m: dict[str, Any]) -> None:
        generation = m.get("generation", 0)
        if generation != self._generation:
            self._generation = generation
            self._grace_until = m["iter"] + GRACE_ITERS - 1
        if m["iter"] > self._last_fed:
            self._metrics[m["iter"]] = m

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        self._metrics.clear()
        self._timings.clear()
        self.events.emit("detector_disabled", reason=reason)
        self.say(f"fail-slow detection off: {reason}")

    def pump(self) -> None:
        """Feed every iteration whose metrics and all ranks' timings have arrived. The watch is
        an observer: whatever goes wrong in it switches it off with an event, never stops the
        job."""
        if self.disabled:
            return
        try:
            self._pump()
        except Exception as exc:
            self._disable(f"{type(exc).__name__}: {exc}")

    def _pump(self) -> None:
        while self._metrics:
            it = min(self._metrics)
            ranks = self._timings.get(it, {})
            if len(ranks) < self.world_size:
                if any(i > it for i in self._metrics) and len(self._metrics) > 3:
                    self._drop(it)  # a rank died mid-iteration; never complete
                    continue
                return
            m = self._metrics.pop(it)
            self._timings.pop(it, None)
            self._last_fed = it
            if it <= self._grace_until:
                continue
            seconds = m["iter_s"] - m.get("ckpt_s", 0.0)
            if self.plan is not None:
                obs = self._plan_observation(it, seconds, ranks)
            elif _segmented([ranks[r]["doc_lengths"] for r in ranks]):
                obs = Observation(
                    iteration=it,
                    seconds=seconds,
                    doc_lengths=[ranks[r]["doc_lengths"] for r in sorted(ranks)],
                    ranks={r: RankTiming.from_dict(ranks[r]) for r in ranks},
                )
            else:
                obs = None
            if obs is None:
                self._disable(_NO_LENGTHS)
                return
            self._decide(self.detector.observe(obs))
            for rec in self.detector.take_recovered():
                self._recovered(rec)

    def _plan_observation(
        self, it: int, seconds: float, ranks: dict[int, dict[str, Any]]
    ) -> Observation | None:
        """A plan's iteration: every replica's workload from the micro-batches the ranks
        computed (each one is reported by every rank that ran a stage of it), or None when
        some micro-batch has no segment lengths."""
        plan = self.plan
        assert plan is not None
        lengths: dict[int, list[int]] = {}
        for rec in ranks.values():
            lengths.update(zip(rec.get("microbatches", ()), rec["doc_lengths"], strict=True))
        if not all(lengths.get(mb) for mb in range(plan.total_microbatches)):
            return None
        return Observation(
            iteration=it,
            seconds=seconds,
            doc_lengths=[[lengths[mb] for mb in plan.microbatch_ids(d)] for d in range(plan.dp)],
            stages={r: StageTiming.from_dict(rec) for r, rec in ranks.items()},
        )

    def _drop(self, it: int) -> None:
        self._metrics.pop(it, None)
        self._timings.pop(it, None)
        self._last_fed = max(self._last_fed, it)

    def _decide(self, d) -> None:
        if d.verdict in (Verdict.WARMUP, Verdict.QUIET, Verdict.ACCEPTED, Verdict.KNOWN):
            return
        fields = {
            "verdict": d.verdict.value,
            "iteration": d.iteration,
            "change_iteration": d.change_iteration,
            "observed_over_predicted": d.observed_over_predicted,
            "validation_s": d.validation_s,
        }
        if d.report is not None:
            r = d.report
            self.events.emit(
                "fail_slow",
                rank=r.rank,
                what=r.what,
                stage=r.stage,
                factor=r.factor,
                since_iter=r.iteration,
                detected_at=r.detected_at,
                **fields,
            )
            where = f" (stage {r.stage})" if self.plan is not None and r.rank is not None else ""
            self.say(
                (
                    f"fail-slow detected: rank {r.rank}{where}"
                    if r.rank is not None
                    else "fail-slow detected: the sync stage (every rank's all-reduce)"
                )
                + f" {'communicates' if r.what == 'comm' else 'runs'} {r.factor:.2f}x slower "
                f"since iteration {r.iteration} (detected after iteration {r.detected_at})"
            )
        else:
            self.events.emit("change_point", **fields)

    def _recovered(self, rec: SpeedRecovered) -> None:
        r = rec.report
        self.events.emit(
            "speed_recovered",
            rank=r.rank,
            factor=rec.factor,
            slow_factor=r.factor,
            since_iter=r.iteration,
            first_iter=rec.first,
            detected_at=rec.last,
        )
        pace = "its healthy pace per layer" if self._peerless else "its peers' pace"
        self.say(
            f"rank {r.rank} runs at full speed again: {rec.factor:.2f}x {pace} over "
            f"iterations {rec.first}..{rec.last} (it ran {r.factor:.2f}x slower from "
            f"iteration {r.iteration})"
        )
        if self.on_recovered is not None and r.rank is not None:
            self.on_recovered(r.rank, rec.factor, rec.last)

    @property
    def _peerless(self) -> bool:
        """A one-replica pipeline: a rank is held to its own healthy pace (`LayerPace`)."""
        return self.plan is not None and self.plan.dp == 1

    @property
    def overhead_s(self) -> float:
        return self.detector.observe_s


def _segmented(lists: list[list[list[int]]]) -> bool:
    """Whether a data-parallel iteration can be observed: every micro-batch a rank computed
    has its segment lengths, and some rank computed one (a rank the placement left empty, not
    probing this iteration, has none: `unbroken.train.Trainer._probe`)."""
    return any(lists) and all(any(mb) for lengths in lists for mb in lengths)
