"""Replays measured jobs through the detector (ours and the Greyhound-style baseline) and scores
both, as in ResiHP §8.2 (Tables 4 and 5).

Input per job: rank 0's iteration times, every rank's `RankTiming` and documents, and the
injected fault (rank, iteration) from the event log — the fault is used only for scoring,
never shown to the detector. Both detectors see the same observations.

Scores (per mode):
- `mb_mape`: |predicted - measured| / measured over every timed micro-batch of every rank in
  the healthy iterations after warm-up (the model fitted on warm-up predicts; %).
- `iter_mape`: the same for the predicted healthy iteration time against rank 0's `iter_s`.
- `false_alarms_per_job`: validations started on a change point that begins before the fault
  (or in a fault-free job) — each one is validation work a healthy job did not need.
- `validation_s_per_false_alarm`: mean seconds the detector spent validating one of them.
- `accuracy`: jobs classified correctly (faulty: the first report, at or after the fault's
  iteration, says what is slow — compute or comm — and names the injected rank; a comm report
  without a rank, "slow at the sync stage", also counts for a comm fault; fault-free: no
  report).
- `detect_delay_iters`: mean over detected faults of (report iteration - fault iteration).
- `overhead_pct`: detector time (every `observe` call, plus the `PhaseTimer` hook's own cost
  per iteration) over the iterations' wall time.

Diagnostics of the timing noise (`noise_diagnostics`, the same for every mode):
- `mb_mape_cpu`: `mb_mape` with the model fitted on and predicting the micro-batches' process
  CPU time (`mb_cpu_s`) instead of wall time: what is left when the time a rank was not
  scheduled is taken out.
- `mb_mape_floor`: the error of a perfect model on this noise: per job, the mean absolute
  deviation of single-document micro-batches (all identical work, Σl² = N²) from their
  median, in % — no model of the workload can predict those better.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.detect.detector import (
    DetectorConfig,
    FailSlowDetector,
    FailSlowReport,
    Observation,
    Verdict,
    mb_samples,
)
from unbroken.detect.timing import PhaseTimer, RankTiming
from unbroken.detect.workload import MicroBatchModel, sum_sq
from unbroken.metrics.log import read_jsonl
from unbroken.train.phases import Phase

__all__ = ["JobSeries", "Score", "load_jobs", "noise_diagnostics", "score_jobs", "timer_cost_s"]


@dataclass(slots=True)
class JobSeries:
    """One measured job."""

    index: int
    observations: list[Observation]
    fault_rank: int | None = None
    fault_iter: int | None = None
    fault_spec: str = ""
    fault_active: dict[str, Any] | None = None
    """The injector's `slow_active` event (the factor it used; for comm, the comm share)."""

    @property
    def fault_what(self) -> str | None:
        """compute or comm (from the spec), None for a fault-free job."""
        if not self.fault_spec:
            return None
        return "comm" if "what=comm" in self.fault_spec else "compute"


@dataclass(slots=True)
class Score:
    mb_mape: float = 0.0
    iter_mape: float = 0.0
    false_alarms_per_job: float = 0.0
    validation_s_per_false_alarm: float = 0.0
    accuracy: float = 0.0
    detect_delay_iters: float | None = None
    overhead_pct: float = 0.0
    benign_dropped_per_job: float = 0.0
    validations_per_job: float = 0.0
    detail: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mb_mape": self.mb_mape,
            "iter_mape": self.iter_mape,
            "false_alarms_per_job": self.false_alarms_per_job,
            "validation_s_per_false_alarm": self.validation_s_per_false_alarm,
            "accuracy": self.accuracy,
            "detect_delay_iters": self.detect_delay_iters,
            "overhead_pct": self.overhead_pct,
            "benign_dropped_per_job": self.benign_dropped_per_job,
            "validations_per_job": self.validations_per_job,
        }


def load_jobs(out: Path, world_size: int) -> list[JobSeries]:
    """Read `job{j}-rank{r}.jsonl` and `events.jsonl` written by the bench's runner."""
    faults: dict[int, dict] = {}
    active: dict[int, dict] = {}
    for e in read_jsonl(out / "events.jsonl"):
        if e.get("kind") == "failure_injected":
            faults.setdefault(int(e["run"].removeprefix("job")), e)
        elif e.get("kind") == "slow_active":
            active.setdefault(int(e["run"].removeprefix("job")), e)
    jobs = []
    j = 0
    while (out / f"job{j}-rank0.jsonl").exists():
        per_rank = [
            {r["iter"]: r for r in read_jsonl(out / f"job{j}-rank{k}.jsonl")}
            for k in range(world_size)
        ]
        obs = []
        for it in sorted(per_rank[0]):
            if not all(it in p for p in per_rank):
                break
            rows = [p[it] for p in per_rank]
            obs.append(
                Observation(
                    iteration=it,
                    seconds=rows[0]["t_end"] - rows[0]["t_start"],
                    doc_lengths=[[tuple(d) for d in row["doc_lengths"]] for row in rows],
                    ranks={k: RankTiming.from_dict(row) for k, row in enumerate(rows)},
                )
            )
        f = faults.get(j)
        jobs.append(
            JobSeries(
                index=j,
                observations=obs,
                fault_rank=None if f is None else int(f["rank"]),
                fault_iter=None if f is None else int(f["iter"]),
                fault_spec="" if f is None else f["spec"],
                fault_active=active.get(j),
            )
        )
        j += 1
    return jobs


def timer_cost_s(calls: int = 20000) -> float:
    """Seconds one `PhaseTimer` hook call costs (measured here, mean over `calls`)."""
    timer = PhaseTimer(rank=0)
    t0 = time.perf_counter()
    for i in range(calls // 4):
        timer(Phase.FORWARD, i, 0, 2)
        timer(Phase.BACKWARD, i, 0, 2)
        timer(Phase.FORWARD, i, 1, 2)
        timer(Phase.PROTECT, i, 0, 1)
    return (time.perf_counter() - t0) / calls


def _correct(job: JobSeries, report: FailSlowReport | None) -> bool:
    if job.fault_iter is None:
        return report is None
    if report is None or report.detected_at < job.fault_iter or report.what != job.fault_what:
        return False
    return report.rank == job.fault_rank or (report.what == "comm" and report.rank is None)


def _healthy(job: JobSeries, obs: Observation) -> bool:
    return job.fault_iter is None or obs.iteration < job.fault_iter


@dataclass(slots=True)
class _Tally:
    """What `score_jobs` sums over the jobs' replays."""

    mb_err: list[float] = field(default_factory=list)
    it_err: list[float] = field(default_factory=list)
    false_alarms: int = 0
    fa_validation_s: float = 0.0
    benign: int = 0
    validations: int = 0
    det_s: float = 0.0
    wall_s: float = 0.0


def score_jobs(jobs: Sequence[JobSeries], cfg: DetectorConfig) -> Score:
    """Replay every job through a fresh detector with `cfg` and score it."""
    hook_s = timer_cost_s()
    t = _Tally()
    correct, delays = 0, []
    detail = []
    for job in jobs:
        first_report = _replay(job, cfg, hook_s, t)
        ok = _correct(job, first_report)
        if job.fault_iter is not None and ok:
            delays.append(first_report.detected_at - job.fault_iter)
        correct += ok
        detail.append(
            {
                "job": job.index,
                "fault": job.fault_spec or None,
                "report": None
                if first_report is None
                else {
                    "rank": first_report.rank,
                    "what": first_report.what,
                    "factor": round(first_report.factor, 3),
                    "iteration": first_report.iteration,
                    "detected_at": first_report.detected_at,
                },
                "correct": bool(ok),
            }
        )
    n = max(1, len(jobs))
    return Score(
        mb_mape=100.0 * statistics.fmean(t.mb_err) if t.mb_err else float("nan"),
        iter_mape=100.0 * statistics.fmean(t.it_err) if t.it_err else float("nan"),
        false_alarms_per_job=t.false_alarms / n,
        validation_s_per_false_alarm=t.fa_validation_s / t.false_alarms if t.false_alarms else 0.0,
        accuracy=correct / n,
        detect_delay_iters=statistics.fmean(delays) if delays else None,
        overhead_pct=100.0 * t.det_s / t.wall_s if t.wall_s else 0.0,
        benign_dropped_per_job=t.benign / n,
        validations_per_job=t.validations / n,
        detail=detail,
    )


def _replay(job: JobSeries, cfg: DetectorConfig, hook_s: float, t: _Tally):
    """Feed one job's observations to a fresh detector, adding to `t`; returns its first
    report (None if it reported nothing)."""
    det = FailSlowDetector(cfg)
    first_report = None
    for obs in job.observations:
        d = det.observe(obs)
        t.wall_s += obs.seconds
        # Hook calls per rank: forward and backward per micro-batch, the first all-reduce
        # bucket, reduced, protect.
        calls = sum(2 * len(r.forward_s) + 3 for r in (obs.ranks or {}).values())
        t.det_s += hook_s * calls / max(1, len(obs.ranks or {1: 0}))
        if d.verdict is Verdict.BENIGN:
            t.benign += 1
        if d.verdict in (Verdict.FALSE_ALARM, Verdict.FAIL_SLOW, Verdict.KNOWN):
            t.validations += 1
            before_fault = job.fault_iter is None or (
                d.change_iteration is not None and d.change_iteration < job.fault_iter
            )
            if before_fault:
                t.false_alarms += 1
                t.fa_validation_s += d.validation_s
        if d.report is not None and first_report is None:
            first_report = d.report
        p = det.predictor
        if p is not None and d.verdict is not Verdict.WARMUP and _healthy(job, obs):
            pred = p.iteration_time(obs.doc_lengths)
            t.it_err.append(abs(pred - obs.seconds) / obs.seconds)
            t.mb_err += [abs(p.mb.predict(x) - y) / y for x, y in mb_samples([obs])]
    t.det_s += det.observe_s
    return first_report


def noise_diagnostics(jobs: Sequence[JobSeries], cfg: DetectorConfig) -> dict[str, float | None]:
    """`mb_mape_cpu` and `mb_mape_floor` (module docstring), in %; None without the data."""
    first = cfg.skip_iters
    last = cfg.skip_iters + cfg.warmup_iters
    cpu_err: list[float] = []
    floor_err: list[float] = []
    for job in jobs:
        warm, later = [], []
        single: list[float] = []
        for obs in job.observations[first:]:
            if not _healthy(job, obs):
                break
            for rank, t in (obs.ranks or {}).items():
                lengths = obs.doc_lengths[rank]
                pairs = list(zip(lengths, t.mb_cpu_s, strict=False))
                (warm if obs.iteration < last else later).extend(pairs)
                if obs.iteration >= last:
                    single += [
                        s
                        for m, s in enumerate(t.mb_s)
                        if sum_sq(lengths[m]) == sum(lengths[m]) ** 2
                    ]
        if warm and later:
            model = MicroBatchModel.fit(warm)
            cpu_err += [abs(model.predict(d) - s) / s for d, s in later if s > 0]
        if len(single) >= 5:
            mid = statistics.median(single)
            floor_err += [abs(s - mid) / s for s in single]
    return {
        "mb_mape_cpu": 100.0 * statistics.fmean(cpu_err) if cpu_err else None,
        "mb_mape_floor": 100.0 * statistics.fmean(floor_err) if floor_err else None,
    }
