"""Event log, per-iteration metrics, recovery breakdown, ETTR, summary and plots.

Every process of a job (coordinator, agents, trainers) appends to the same `events.jsonl`;
rank 0 appends one line per completed iteration attempt to `metrics.jsonl`. Each line is written
with one `write(2)` on an `O_APPEND` descriptor, so lines from different processes never
interleave. The summary is derived from these two files after the run (`analyze`) and returned typed
(`RunSummary`). While a job runs, its coordinator's monitor tells live observers
(`RunObserver`) what the logs show: the Prometheus exporter (`prom`), the status page's model
(`status`) and their HTTP server (`live`).
"""

from unbroken.metrics.analysis import RecoveryBreakdown, analyze_run, ettr
from unbroken.metrics.log import JsonlLog, read_jsonl
from unbroken.metrics.observer import RunInfo, RunObserver
from unbroken.metrics.run_summary import RunSummary

__all__ = [
    "JsonlLog",
    "RecoveryBreakdown",
    "RunInfo",
    "RunObserver",
    "RunSummary",
    "analyze_run",
    "ettr",
    "read_jsonl",
]
