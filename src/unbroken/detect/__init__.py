"""Failure detection: workload-aware fail-slow detection (ResiHP §5.2) and the interface that
hands fail-stop and fail-slow detections to recovery and planning.

- `bocpd`: Bayesian online change-point detection on the iteration-time series;
- `workload`: T_MB = alpha N + beta sum l_i^2 and the schedule model of an iteration;
- `detector`: `FailSlowDetector` (and its Greyhound-style baseline mode);
- `timing`: `PhaseTimer`, the trainer hook recording per-rank compute for validation;
- `events`: `DetectionEvent` / `DetectionSink` (+ a JSONL sink for `events.jsonl`);
- `levels`: weak/medium/severe fail-slow factors;
- `varlen`, `evaluate`, `_jobs`: what `unbroken bench detect` runs and scores.

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
from unbroken.detect.timing import PhaseTimer, RankTiming
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
    "RankTiming",
    "ScheduleModel",
    "Verdict",
    "WorkloadPredictor",
    "slow_factor_for",
]
