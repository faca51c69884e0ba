"""The run monitor analyzes a pending failure over a window of the run, not its whole history
(an hour-long soak made the whole-history analysis stall the coordinator): the breakdown of
every failure of recorded real runs is the same either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from unbroken.launch.coordinator.monitor import ANALYSIS_WINDOW_S
from unbroken.metrics.analysis import analyze_run, healthy_iter_s
from unbroken.metrics.log import read_jsonl

FIXTURES = Path(__file__).parent.parent / "sim" / "fixtures"
# real-run-d's events predate the `level` field of `shadows_promoted`: not analyzable at all.
RUNS = [FIXTURES / f"real-run-{x}" for x in "abcef"]


@pytest.mark.parametrize("run", RUNS, ids=[p.name for p in RUNS])
def test_the_windowed_breakdown_equals_the_whole_runs(run):
    rows = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("run") != "reference"]
    events = [e for e in read_jsonl(run / "events.jsonl") if e.get("run") != "reference"]
    healthy = healthy_iter_s(rows)
    whole = analyze_run(rows, events, healthy_s=healthy)
    assert whole, "the fixture has recoveries"
    for r in whole:
        since = r.detected_t - ANALYSIS_WINDOW_S
        window = analyze_run(
            [m for m in rows if m["t_end"] >= since],
            [e for e in events if e.get("t", 0.0) >= since],
            healthy_s=healthy,
        )
        assert r in window, (r, window)
