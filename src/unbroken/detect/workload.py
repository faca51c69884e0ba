"""The workload model: healthy micro-batch and iteration times from the packed documents.

Micro-batch (ResiHP §5.2, eq. 1): a packed micro-batch of N tokens holding documents of
lengths l_i (sum l_i = N) with block-diagonal attention costs T_MB = alpha * N + beta * sum l_i^2
(the MLP and projections scale with N, attention with sum l_i^2). alpha and beta are fitted on
the micro-batches timed during warm-up, by least absolute relative deviation (`fit` says why).

Iteration: the healthy iteration time is the critical path of the plan's schedule with every
compute chunk priced by the micro-batch model. The schedule timing is behind a small interface,
`ScheduleModel`: a hybrid-parallel plan's is `unbroken.detect.pipeline.PlanSchedule` (the plan's
dry-run simulator, `unbroken.parallel.simulate`); the data-parallel plan's model is here: each
replica runs its micro-batches one after another, all replicas meet at the gradient all-reduce,
so T_iter = max over replicas of (sum of its T_MB) + c, with c (all-reduce, sync, update,
boundary) a constant fitted on warm-up. This module never reads clocks: it only models.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "DataParallelFit",
    "DataParallelSchedule",
    "MicroBatchModel",
    "ScheduleModel",
    "WorkloadPredictor",
    "sum_sq",
]

DocLengths = Sequence[int]
"""Segment lengths l_i of one packed micro-batch."""


def sum_sq(doc_lengths: DocLengths) -> int:
    """sum l_i^2 of one micro-batch."""
    return int(sum(int(x) * int(x) for x in doc_lengths))


@dataclass(frozen=True, slots=True)
class MicroBatchModel:
    """T_MB = alpha * N + beta * sum l_i^2 (seconds)."""

    alpha: float
    beta: float

    def predict(self, doc_lengths: DocLengths) -> float:
        return self.alpha * sum(doc_lengths) + self.beta * sum_sq(doc_lengths)

    @classmethod
    def fit(cls, samples: Sequence[tuple[DocLengths, float]], rounds: int = 30) -> MicroBatchModel:
        """Least absolute relative deviation on (doc lengths, measured seconds) pairs: minimizes
        sum |T_MB - t| / t by iteratively reweighted least squares.

        Why not least squares: timing noise is one-sided — a preempted or interrupted rank
        takes longer, never shorter than its work — so the mean that least squares predicts is
        pulled up by the outliers, while a healthy time is the typical one (on the loaded
        2-vCPU VM least squares gave 32% micro-batch MAPE, this 25%, same logs;
        docs/detect.md).

        With a fixed token budget N the N column is constant, so alpha * N is the intercept; if
        every sample has the same sum l^2 (all single-document micro-batches) beta is not
        identifiable and is set to 0 (the model then predicts the median). Neither cost can be
        negative: samples whose sum l^2 spans too little for the noise (a warm-up that saw only
        short documents) can fit beta < 0, which would predict negative times for long ones;
        then beta is 0 too.

        Raises:
            ValueError: no samples.
        """
        if not samples:
            raise ValueError("no micro-batch samples to fit alpha and beta")
        n = np.array([float(sum(d)) for d, _ in samples])
        q = np.array([float(sum_sq(d)) for d, _ in samples])
        y = np.array([s for _, s in samples], dtype=float)
        if np.ptp(q / n**2) < 1e-9:
            return cls._constant(n, y)
        # Scale columns for conditioning, solve, scale back.
        sn, sq = n.mean(), q.mean()
        x = np.c_[n / sn, q / sq]
        weight = 1.0 / y
        for _ in range(rounds):
            root = np.sqrt(weight)
            coef, *_ = np.linalg.lstsq(x * root[:, None], y * root, rcond=None)
            # |r| / y = r^2 * w with w = 1 / (y |r|); floor |r| so exact fits stay finite.
            weight = 1.0 / (y * np.maximum(np.abs(x @ coef - y), 1e-6 * y))
        if coef[1] < 0 or coef[0] < 0:
            return cls._constant(n, y)
        return cls(alpha=float(coef[0] / sn), beta=float(coef[1] / sq))

    @classmethod
    def _constant(cls, n: np.ndarray, y: np.ndarray) -> MicroBatchModel:
        """beta = 0: the median time per token."""
        # statistics, not np.median: that imports numpy.ma on first use (15 ms), which on a
        # busy 2-core machine the coordinator takes from the trainers it is timing.
        return cls(alpha=float(statistics.median((y / n).tolist())), beta=0.0)


class ScheduleModel(Protocol):
    """Times one iteration of a plan given each compute chunk's predicted time.

    `mb_times[r][m]` is the predicted time of replica r's m-th micro-batch (forward + backward
    of the whole model on one device of that replica). A pipeline simulator splits it into
    per-stage F/B/W chunks by its own layer shares and returns the DAG's critical path.
    """

    def iteration_time(self, mb_times: Sequence[Sequence[float]]) -> float: ...


@dataclass(frozen=True, slots=True)
class DataParallelSchedule:
    """Data-parallel plan: replicas in parallel, micro-batches in sequence, then a sync."""

    sync_s: float = 0.0
    """Constant per iteration after the compute (all-reduce, sync, update, boundary)."""

    def iteration_time(self, mb_times: Sequence[Sequence[float]]) -> float:
        return max((sum(r) for r in mb_times), default=0.0) + self.sync_s


@dataclass(frozen=True, slots=True)
class DataParallelFit:
    """What a data-parallel job's warm-up measured, for the scheduler
    (`Adaptation.calibrate`): a typical micro-batch's forward + backward (`mb_s`, the median
    of the warm-up's timed micro-batches) and the per-iteration constant after the compute
    (`sync_s`: all-reduce, sync, optimizer step, boundary — the step is most of it on the
    tiny CPU model, and a slow device stretches all but the all-reduce)."""

    mb_s: float
    sync_s: float


@dataclass(frozen=True, slots=True)
class WorkloadPredictor:
    """Micro-batch model + schedule model: predicted healthy times of a given workload."""

    mb: MicroBatchModel
    schedule: ScheduleModel

    def mb_times(self, doc_lengths: Sequence[Sequence[DocLengths]]) -> list[list[float]]:
        return [[self.mb.predict(d) for d in replica] for replica in doc_lengths]

    def iteration_time(self, doc_lengths: Sequence[Sequence[DocLengths]]) -> float:
        """Healthy iteration time; `doc_lengths[r][m]` = replica r's m-th micro-batch."""
        return self.schedule.iteration_time(self.mb_times(doc_lengths))

    @classmethod
    def fit_data_parallel(
        cls,
        mb_samples: Sequence[tuple[DocLengths, float]],
        iterations: Sequence[tuple[Sequence[Sequence[DocLengths]], float]],
    ) -> WorkloadPredictor:
        """Fit alpha, beta on micro-batch samples, then the sync constant c as the median of
        (observed - predicted compute critical path) over the warm-up iterations (the median,
        because one noisy warm-up iteration must not shift every later prediction)."""
        mb = MicroBatchModel.fit(mb_samples)
        bare = DataParallelSchedule(sync_s=0.0)
        residuals = [
            seconds - bare.iteration_time([[mb.predict(d) for d in r] for r in lengths])
            for lengths, seconds in iterations
        ]
        sync = statistics.median(residuals) if residuals else 0.0
        return cls(mb=mb, schedule=DataParallelSchedule(sync_s=sync))
