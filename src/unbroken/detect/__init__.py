"""Failure detection: workload-aware fail-slow detection (ResiHP §5.2) and the interface that
hands fail-stop and fail-slow detections to recovery and planning.

- `bocpd`: Bayesian online change-point detection on the iteration-time series;
- `workload`: T_MB = alpha N + beta sum l_i^2 and the schedule model of an iteration;
- `pipeline`: the model of a hybrid-parallel plan (chunk costs through the plan's dry-run
  simulator, per-rank busy time for localization);
- `detector`: `FailSlowDetector` (and its Greyhound-style baseline mode);
- `timing`: `PhaseTimer`, the trainer hook recording per-rank compute for validation, and
  `StageTiming`, what a plan's worker records instead;
- `events`: `DetectionEvent` / `DetectionSink` (+ a JSONL sink for `events.jsonl`);
- `levels`: weak/medium/severe fail-slow factors.

What `unbroken bench detect` runs and scores (its loss function, workloads, job runner and
scorer) lives in `unbroken.bench`, above this package.

Heartbeat fail-stop detection lives in `unbroken.launch` (it needs the control plane) and
reports through the same `DetectionEvent`. This package never injects faults and never reads
the injector's records.
"""

from unbroken.detect.bocpd import Bocpd, BocpdConfig, ChangePoint
from unbroken.detect.detector import (
    Decision,
    DetectorConfig,
    FailSlowDetector,
    FailSlowReport,
    Observation,
    SpeedRecovered,
    Verdict,
)
from unbroken.detect.events import (
    DetectionEvent,
    DetectionKind,
    DetectionSink,
    FailStopCause,
    JsonlSink,
    ListSink,
)
from unbroken.detect.levels import Level, slow_factor_for
from unbroken.detect.pipeline import PlanFit, PlanSchedule, fit_plan
from unbroken.detect.timing import PhaseTimer, RankTiming, StageTiming
from unbroken.detect.workload import (
    DataParallelSchedule,
    MicroBatchModel,
    ScheduleModel,
    WorkloadPredictor,
)

__all__ = [
    "Bocpd",
    "BocpdConfig",
    "ChangePoint",
    "DataParallelSchedule",
    "Decision",
    "DetectionEvent",
    "DetectionKind",
    "DetectionSink",
    "DetectorConfig",
    "FailSlowDetector",
    "FailSlowReport",
    "FailStopCause",
    "JsonlSink",
    "Level",
    "ListSink",
    "MicroBatchModel",
    "Observation",
    "PhaseTimer",
    "PlanFit",
    "PlanSchedule",
    "RankTiming",
    "ScheduleModel",
    "SpeedRecovered",
    "StageTiming",
    "Verdict",
    "WorkloadPredictor",
    "fit_plan",
    "slow_factor_for",
]
