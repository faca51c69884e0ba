"""The run monitor analyzes a pending failure over a window of the run, not its whole history
(an hour-long soak made the whole-history analysis stall the coordinator): the breakdown of
every failure of recorded real runs is the same either way."""

from __future__ import annotations

import json
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


class _Emitted:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []

    def emit(self, kind: str, **fields) -> None:
        self.records.append((kind, fields))


@pytest.mark.parametrize("run", RUNS, ids=[p.name for p in RUNS])
def test_the_monitor_replaying_a_run_reports_the_whole_runs_breakdown(run, tmp_path):
    """The live monitor (incremental window, median kept sorted, one analysis per poll) fed a
    recorded run as it grew reports every recovery the whole-run analysis finds, with the same
    detection and restart (its recompute is priced at the healthy iteration time of the rows
    seen so far, as it always was live, not of the whole run)."""
    from unbroken.launch.coordinator.monitor import RunMonitor

    rows = [m for m in read_jsonl(run / "metrics.jsonl") if m.get("run") != "reference"]
    events = [e for e in read_jsonl(run / "events.jsonl") if e.get("run") != "reference"]
    name = rows[0]["run"]
    whole = analyze_run(rows, events, healthy_s=healthy_iter_s(rows))
    log = _Emitted()
    mon = RunMonitor(tmp_path, name, 4, len(rows), log, quiet=True)
    timeline = sorted(
        [(m["t_end"], "metrics.jsonl", m) for m in rows]
        + [(e.get("t", 0.0), "events.jsonl", e) for e in events],
        key=lambda x: x[0],
    )
    for t, file, rec in timeline:
        with open(tmp_path / file, "a") as fh:
            fh.write(json.dumps(rec) + "\n")
        if file == "events.jsonl" and rec["kind"] in ("failure_detected", "node_lost"):
            mon.failure_detected(rec.get("t_detected", t))  # as the coordinator passes it
        mon.poll()
    mon.finish()
    done = [f for k, f in log.records if k == "recovery_done"]
    fields = ("mode", "rank", "detect_s", "restored_iter", "resumed_iter")
    assert [tuple(d[k] for k in fields) for d in done] == [
        (r.mode, r.rank, r.detect_s, r.restored_iter, r.iteration) for r in whole
    ]
